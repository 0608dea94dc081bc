"""Probe (issue 25): does a TMA store of the decode tile's p (through a per-program tensor
descriptor: shared memory, then an asynchronous bulk copy) cost the attention loop less than the
shipped register store (`_store_scores`), whose time is ~3x its bytes (h2o_store_probe)?

The 1B shape's decode attention over 16 layers (own caches, 4k context), batch 1 and 64, CUDA
graph medians: none (no mass), shipped (folded mass), and the variant module (kernels/
paged_attention.py patched in a temporary file) storing p through a descriptor, p in float32 and
float16; each variant's out and mass checked against the shipped path's.

    python bench/tune/h2o_tma_probe.py --out $OUT/h2o_tma_probe.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "lib"))

from mxserve.kernels import paged_attention as pa  # noqa: E402

LAYERS, HQ, HKV, D, BS = 16, 32, 8, 64, 16

# the descriptor: this program's GROUP rows of p [GROUP, hi] (rows past GROUP and columns past
# hi clipped by the copy), made once the split's end is known
DESC = """    hi = tl.where(split == NUM_SPLITS - 1, kv_end, tl.minimum(lo + tokens_per_split, kv_end))
    if STORE_SCORES:
        p_desc = tl.make_tensor_descriptor(
            scores_ptr + q_start * stride_st + kv_head * GROUP * stride_sh, shape=[GROUP, hi],
            strides=[stride_sh, 1], block_shape=[BLOCK_G, BLOCK_N])
"""
STORE = """        if STORE_SCORES:  # decode: the mass's numerators, normalised once splits are merged
            s_g = tl.sum(tl.reshape(tl.where((qi == 0)[:, None], p, 0.0),
                                    [BLOCK_M // BLOCK_G, BLOCK_G, BLOCK_N]), axis=0)
            p_desc.store([0, start], s_g.to(scores_ptr.dtype.element_ty))
"""


def variant_module(scores_dtype: torch.dtype):
    """kernels/paged_attention.py with p stored through a tensor descriptor, from a temp file."""
    import importlib.util
    import inspect
    import re
    import tempfile

    src = inspect.getsource(pa)
    src = src.replace("from .triton_compat import", "from mxserve.kernels.triton_compat import")
    src, n1 = re.subn(r"    hi = tl\.where\(split == NUM_SPLITS - 1, kv_end, tl\.minimum\(lo \+ "
                      r"tokens_per_split, kv_end\)\)\n", DESC, src)
    src, n2 = re.subn(r"        if STORE_SCORES:  # decode: the mass's numerators.*?"
                      r"GROUP, BLOCK_G, BLOCK_M, BLOCK_N\)\n", STORE, src, flags=re.S)
    assert n1 == 1 and n2 == 1, (n1, n2)
    path = os.path.join(tempfile.mkdtemp(), "pa_tma.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("pa_tma", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.SCORES_DTYPE = scores_dtype
    return mod


def probe(b: int, context: int, width: int, device: str, rows: list, timed: bool) -> None:
    gen = torch.Generator(device=device).manual_seed(b)
    nblk = b * -(-width // BS)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    caches = [(torch.randn(nblk, BS, HKV, D, generator=gen, device=device).to(dtype),
               torch.randn(nblk, BS, HKV, D, generator=gen, device=device).to(dtype))
              for _ in range(LAYERS)]
    tables = torch.randperm(nblk, generator=gen, device=device).to(torch.int32).view(b, -1)
    lens = torch.randint(context // 2, context + 1, (b,), generator=gen, device=device,
                         dtype=torch.int32)
    lens[0] = context
    q = torch.randn(b, HQ, D, generator=gen, device=device).to(dtype)
    out, mass = torch.empty_like(q), torch.zeros(b, width, device=device)

    def step(with_mass: bool, mod=pa):
        mass.zero_()
        for kc, vc in caches:
            mod.paged_decode_attention(q, kc, vc, tables, lens, out=out, max_seq_len=width,
                                       return_attn_mass=with_mass,
                                       mass=mass if with_mass else None, backend="triton")

    step(True)
    want_out, want_mass = out.clone(), mass.clone()
    if timed:
        from gpu_timing import graph_median_us
        none_us = graph_median_us(lambda: step(False), rep=200)
        rows.append({"batch": b, "variant": "none", "us": none_us})
        shipped_us = graph_median_us(lambda: step(True), rep=200)
        rows.append({"batch": b, "variant": "shipped", "us": shipped_us,
                     "over_none": round(shipped_us / none_us, 4)})
    for name, sd in (("tma_fp32", torch.float32), ("tma_fp16", torch.float16)):
        mod = variant_module(sd)
        step(True, mod)
        row = {"batch": b, "variant": name,
               "out_max_err": float((out.float() - want_out.float()).abs().max()),
               "mass_rel_err": float((mass - want_mass).abs().max() / want_mass.abs().max())}
        if timed:
            row["us"] = graph_median_us(lambda: step(True, mod), rep=200)
            row["over_none"] = round(row["us"] / none_us, 4)
        print(row, flush=True)
        rows.append(row)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--context", type=int, default=4000)
    parser.add_argument("--check", action="store_true",
                        help="correctness only, small shapes (the interpreter on a CPU)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8,
                                                                 device=device))
    t0, rows = time.time(), []
    if args.check:
        global LAYERS
        LAYERS = 2
        for b in (1, 3):
            probe(b, 200, 200 + 16, device, rows, timed=False)
        ok = all(r["out_max_err"] == 0 and r["mass_rel_err"] < (1e-6 if "32" in r["variant"]
                                                                  else 1e-3) for r in rows)
        print("check", "ok" if ok else "FAILED", rows)
        sys.exit(0 if ok else 1)
    from gpu_timing import write_sweep
    for b in (1, 64):
        probe(b, args.context, args.context + 160, device, rows, timed=True)
        torch.cuda.empty_cache()
    write_sweep(args.out, rows, t0, context=args.context)


if __name__ == "__main__":
    main()
