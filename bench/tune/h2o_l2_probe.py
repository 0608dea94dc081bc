"""Probe (issue 25): can p stay in L2 between the decode kernel's store and the mass kernel's
read (and be overwritten there by the next layer's, never reaching DRAM)?

h2o_parts_probe: at batch 64 the in-loop extraction and the running-max store cost ~45 us each
over 16 layers, the p bytes ~285 us. p of one layer at batch 64, 4k context is 16 MB in float16
(33 MB in float32), under the 50 MB L2, but the 524 MB of K/V streamed past it evict it. Variants
of kernels/paged_attention.py (patched in temporary files), the whole folded path (mass kernel
included), 16 layers, CUDA graph medians, float32 and float16 p:
- shipped; p_last: p stored with evict_last, read by the mass kernel with evict_first;
- kv_first: K/V tiles loaded with evict_first (streamed, kept out of L2's way);
- both: p_last + kv_first. `none` is timed for the shipped and the kv_first module alike.

    python bench/tune/h2o_l2_probe.py --out $OUT/h2o_l2_probe.json
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "lib"))

from mxserve.kernels import paged_attention as pa  # noqa: E402

LAYERS, HQ, HKV, D, BS = 16, 32, 8, 64, 16
P_LAST = [("s_g.to(row_ptr.dtype.element_ty), mask=(g < GROUP)[:, None] & (pos < hi)[None, :])",
           "s_g.to(row_ptr.dtype.element_ty), mask=(g < GROUP)[:, None] & (pos < hi)[None, :], "
           "eviction_policy='evict_last')"),
          ("                    other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_P]",
           "                    other=0.0, eviction_policy='evict_first').to(tl.float32)")]
KV_FIRST = [("k = tl.load(k_ptrs, mask=kv_mask, other=0.0)",
             "k = tl.load(k_ptrs, mask=kv_mask, other=0.0, eviction_policy='evict_first')"),
            ("v = tl.load(v_ptrs, mask=kv_mask, other=0.0)",
             "v = tl.load(v_ptrs, mask=kv_mask, other=0.0, eviction_policy='evict_first')")]
VARIANTS = {"shipped": [], "p_last": P_LAST, "kv_first": KV_FIRST, "both": P_LAST + KV_FIRST}


def variant_module(name: str):
    src = inspect.getsource(pa)
    src = src.replace("from .triton_compat import", "from mxserve.kernels.triton_compat import")
    for a, b in VARIANTS[name]:
        assert src.count(a) == 1, (name, a)
        src = src.replace(a, b)
    path = os.path.join(tempfile.mkdtemp(), f"pa_{name}.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(f"pa_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def probe(b: int, context: int, width: int, rows: list, device: str, timed: bool) -> None:
    gen = torch.Generator(device=device).manual_seed(b)
    nblk = b * -(-width // BS)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    caches = [(torch.randn(nblk, BS, HKV, D, generator=gen, device=device).to(dtype),
               torch.randn(nblk, BS, HKV, D, generator=gen, device=device).to(dtype))
              for _ in range(LAYERS)]
    tables = torch.randperm(nblk, generator=gen, device=device).to(torch.int32).view(b, -1)
    lens = torch.full((b,), context, dtype=torch.int32, device=device)
    q = torch.randn(b, HQ, D, generator=gen, device=device).to(dtype)
    out, mass = torch.empty_like(q), torch.zeros(b, width, device=device)

    def step(mod, with_mass: bool):
        def run():
            mass.zero_()
            for kc, vc in caches:
                mod.paged_decode_attention(q, kc, vc, tables, lens, out=out, max_seq_len=width,
                                           return_attn_mass=with_mass,
                                           mass=mass if with_mass else None, backend="triton")
        return run

    mods = {name: variant_module(name) for name in VARIANTS}
    if timed:
        from gpu_timing import graph_median_us
        for name in ("shipped", "kv_first"):
            rows.append({"batch": b, "variant": f"none/{name}",
                         "us": graph_median_us(step(mods[name], False), rep=300)})
            print(rows[-1], flush=True)
        none = rows[-2]["us"]
    for sd in (torch.float32, torch.float16):
        for mod in mods.values():
            mod.SCORES_DTYPE = sd
        step(mods["shipped"], True)()
        want_out, want_mass = out.clone(), mass.clone()
        for name, mod in mods.items():
            step(mod, True)()
            row = {"batch": b, "variant": f"{name}/{str(sd)[6:]}",
                   "same_bits": bool(out.equal(want_out) and mass.equal(want_mass))}
            if timed:
                row["us"] = graph_median_us(step(mod, True), rep=300)
                row["over_none"] = round(row["us"] / none, 4)
            print(row, flush=True)
            rows.append(row)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--context", type=int, default=4000)
    parser.add_argument("--check", action="store_true", help="the interpreter, small shapes")
    args = parser.parse_args()
    t0, rows = time.time(), []
    if args.check:
        global LAYERS
        LAYERS = 2
        probe(3, 100, 116, rows, "cpu", timed=False)
        sys.exit(0 if all(r["same_bits"] for r in rows) else 1)
    from gpu_timing import write_sweep
    for b in (64, 1):
        probe(b, args.context, args.context + 160, rows, "cuda", timed=True)
        torch.cuda.empty_cache()
    write_sweep(args.out, rows, t0, context=args.context)


if __name__ == "__main__":
    main()
