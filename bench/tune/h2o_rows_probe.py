"""Probe (issue 25): does decode attention with tiles of exactly GROUP rows (q k^T and p v as
broadcast products on CUDA cores, no tl.dot and so no padding to 16 rows) store the folded
mass's p cheaper than the shipped kernel (tl.dot over 16 rows, the real rows taken out by a
reshape before the store), without slowing the no-mass kernel? 16 layers of the 1B shape,
own caches, 4k context, batch 1 and 64, CUDA graph medians; each variant's out and mass checked
against the shipped kernel's.

    python bench/tune/h2o_rows_probe.py --out $OUT/h2o_rows_probe.json
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

ATTEND_OLD = "s = tl.where(keep, _qk(q, k, INTERP_BF16) * qk_scale, float(\"-inf\"))"
ATTEND_NEW = ("s = tl.where(keep, tl.sum(q[:, None, :].to(tl.float32) * "
              "k[None, :, :].to(tl.float32), axis=2) * qk_scale, float(\"-inf\"))")
PV_OLD = "        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=\"ieee\")\n"
PV_NEW = ("        acc = acc + tl.sum(p.to(v.dtype).to(tl.float32)[:, :, None] * "
          "v[None, :, :].to(tl.float32), axis=1)\n")
STORE_OLD = """            _store_scores(scores_ptr + q_start * stride_st, p, qi, kv_head, pos, hi, stride_sh,
                          GROUP, BLOCK_G, BLOCK_M, BLOCK_N)
"""
STORE_NEW = """            tl.store(scores_ptr + q_start * stride_st + heads[:, None] * stride_sh
                     + pos[None, :], p.to(scores_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & (pos < hi)[None, :])
"""
TILES_OLD = "    return block_q, block_g, max(16, block_q * block_g), block_n, opts\n"


def variant(block_n: int, warps: int):
    """kernels/paged_attention.py with decode tiles of GROUP rows (see the docstring)."""
    src = inspect.getsource(pa)
    src = src.replace("from .triton_compat import", "from mxserve.kernels.triton_compat import")
    for old, new in ((ATTEND_OLD, ATTEND_NEW), (PV_OLD, PV_NEW), (STORE_OLD, STORE_NEW),
                     (TILES_OLD, f"    return block_q, block_g, block_q * block_g, {block_n}, "
                                 f"dict(num_warps={warps})\n")):
        assert src.count(old) == 1, old
        src = src.replace(old, new)
    path = os.path.join(tempfile.mkdtemp(), f"pa_rows_{block_n}_{warps}.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(f"pa_rows_{block_n}_{warps}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def probe(b: int, context: int, width: int, rows: list, variants: dict, layers: int,
          timed: bool) -> None:
    dev = "cuda" if timed else "cpu"
    gen = torch.Generator(device=dev).manual_seed(b)
    nblk = b * -(-width // BS)
    caches = [(torch.randn(nblk, BS, HKV, D, generator=gen, device=dev).bfloat16(),
               torch.randn(nblk, BS, HKV, D, generator=gen, device=dev).bfloat16())
              for _ in range(layers)]
    tables = torch.randperm(nblk, generator=gen, device=dev).to(torch.int32).view(b, -1)
    lens = torch.full((b,), context, dtype=torch.int32, device=dev)
    q = torch.randn(b, HQ, D, generator=gen, device=dev).bfloat16()
    out, mass = torch.empty_like(q), torch.zeros(b, width, device=dev)

    def step(with_mass: bool, mod):
        mass.zero_()
        for kc, vc in caches:
            mod.paged_decode_attention(q, kc, vc, tables, lens, out=out, max_seq_len=width,
                                       return_attn_mass=with_mass,
                                       mass=mass if with_mass else None, backend="triton")

    step(True, pa)
    want_out, want_mass = out.clone(), mass.clone()
    for name, mod in [("shipped", pa)] + list(variants.items()):
        step(True, mod)
        row = {"batch": b, "kernel": name,
               "out_max_err": float((out.float() - want_out.float()).abs().max()),
               "mass_rel_err": float((mass - want_mass).abs().max() / want_mass.abs().max())}
        if timed:
            from gpu_timing import graph_median_us
            row["none_us"] = graph_median_us(lambda: step(False, mod), rep=200)
            row["folded_us"] = graph_median_us(lambda: step(True, mod), rep=200)
        print(row, flush=True)
        rows.append(row)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--context", type=int, default=4000)
    parser.add_argument("--check", action="store_true",
                        help="CPU (TRITON_INTERPRET=1): small shapes, correctness only")
    args = parser.parse_args()
    t0, rows = time.time(), []
    configs = [(16, 2)] if args.check else [(32, 2), (32, 4), (64, 4), (64, 8)]
    variants = {f"rows_n{n}_w{w}": variant(n, w) for n, w in configs}
    if args.check:
        probe(2, 100, 128, rows, variants, 2, timed=False)
        return
    for b in (1, 64):
        probe(b, args.context, args.context + 160, rows, variants, LAYERS, timed=True)
        torch.cuda.empty_cache()
    from gpu_timing import write_sweep
    write_sweep(args.out, rows, t0, context=args.context)


if __name__ == "__main__":
    main()
