"""Where the folded H2O mass's time goes (bench/h2o_gpu.py times the whole). One GPU call.

The 1B shape's decode attention over 16 layers (own caches, 4k context), batch 1 and 64, CUDA
graph medians:
- none: no mass; store: the decode kernel storing its scores, the mass kernel not launched
  (patched out); folded: both (the shipped path);
- the mass kernel alone over the same scores, for a grid of BLOCK_P, BLOCK_H and warps (the
  bytes it must move: the scores read, the mass row read and written), each checked against
  the shipped configuration's output;
- a variant of the kernel module (patched source, in a temporary file) with the other scores
  store, checked against the shipped mass. results/h2o_fold_probe.json (commit daedd82, rows
  "compact_*"): the variant stored only the tile's real rows ([BLOCK_M, BLOCK_N] reshaped to
  [queries, BLOCK_G, BLOCK_N], the first query's taken), faster than the masked whole tile
  then shipped, so it became _store_scores; the variant is now the whole tile ("whole_*").

    python bench/tune/h2o_fold_probe.py --out $OUT/h2o_fold_probe.json
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

from gpu_timing import graph_median_us, write_sweep  # noqa: E402

from mxserve.kernels import paged_attention as pa  # noqa: E402

LAYERS, HQ, HKV, D, BS = 16, 32, 8, 64, 16


class _Skip:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


WHOLE = """        if STORE_SCORES:
            tl.store(scores_ptr + (q_start + qi)[:, None] * stride_st
                     + heads[:, None] * stride_sh + pos[None, :], p, mask=row_ok[:, None] & keep)
"""


def variant_module():
    """kernels/paged_attention.py with the whole-tile scores store, from a temp file."""
    import importlib.util
    import inspect
    import re
    import tempfile

    src = inspect.getsource(pa)
    src = src.replace("from .triton_compat import", "from mxserve.kernels.triton_compat import")
    src, n = re.subn(r"        if STORE_SCORES:.*?GROUP, BLOCK_G, BLOCK_M, BLOCK_N\)\n", WHOLE, src,
                     flags=re.S)
    assert n == 1
    path = os.path.join(tempfile.mkdtemp(), "pa_variant.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location("pa_variant", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def probe(b: int, context: int, width: int, rows: list) -> None:
    gen = torch.Generator(device="cuda").manual_seed(b)
    nblk = b * -(-width // BS)
    caches = [(torch.randn(nblk, BS, HKV, D, generator=gen, device="cuda").bfloat16(),
               torch.randn(nblk, BS, HKV, D, generator=gen, device="cuda").bfloat16())
              for _ in range(LAYERS)]
    tables = torch.randperm(nblk, generator=gen, device="cuda").to(torch.int32).view(b, -1)
    lens = torch.full((b,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(b, HQ, D, generator=gen, device="cuda").bfloat16()
    out, mass = torch.empty_like(q), torch.zeros(b, width, device="cuda")

    def step(with_mass: bool, mod=pa):
        mass.zero_()
        for kc, vc in caches:
            mod.paged_decode_attention(q, kc, vc, tables, lens, out=out, max_seq_len=width,
                                       return_attn_mass=with_mass,
                                       mass=mass if with_mass else None)

    row = {"batch": b, "none_us": graph_median_us(lambda: step(False), rep=200),
           "folded_us": graph_median_us(lambda: step(True), rep=200)}
    variant = variant_module()
    step(True)
    want = mass.clone()
    step(True, variant)
    row["whole_rel_err"] = float((mass - want).abs().max() / want.abs().max())
    row["whole_folded_us"] = graph_median_us(lambda: step(True, variant), rep=200)
    real = pa._decode_mass_kernel
    pa._decode_mass_kernel = _Skip()
    try:
        row["store_us"] = graph_median_us(lambda: step(True), rep=200)
    finally:
        pa._decode_mass_kernel = real
    print(row, flush=True)
    rows.append(row)
    scores = torch.rand(b, HQ, width, generator=gen, device="cuda")  # p in [0, 1)
    tile_n = pa._tiles(q, HQ // HKV, True)[3]
    tile_max = torch.randn(b, HQ, triton.cdiv(width, tile_n), generator=gen, device="cuda")
    lse = tile_max.amax(-1, keepdim=True) + 8

    def mass_only(block_p, block_h, warps):
        def run():
            for _ in range(LAYERS):
                pa._decode_mass_kernel[(b, triton.cdiv(width, block_p))](
                    scores, tile_max, lse, lens, mass, width, scores.stride(0),
                    scores.stride(1), tile_max.stride(0), tile_max.stride(1), lse.stride(0),
                    mass.stride(0), NUM_HEADS=HQ, TILE_N=tile_n, BLOCK_H=block_h,
                    BLOCK_P=block_p, TRIGGER=False, num_warps=warps)
        return run

    mass.zero_()
    mass_only(256, 16, 4)()
    want = mass.clone()
    for block_p in (128, 256, 512, 1024):
        for block_h in (8, 16, 32):
            for warps in (2, 4, 8):
                run = mass_only(block_p, block_h, warps)
                mass.zero_()
                run()
                err = float((mass - want).abs().max() / want.abs().max())
                us = graph_median_us(run, rep=100)
                moved = LAYERS * b * (HQ * context * 4 + 2 * context * 4)
                rows.append({"batch": b, "mass_kernel": [block_p, block_h, warps], "us": us,
                             "TBps": round(moved / us / 1e6, 3), "rel_err": err})
    best = min((r for r in rows if r.get("mass_kernel") and r["batch"] == b),
               key=lambda r: r["us"])
    print("best mass kernel", best, flush=True)
    tiles = list(pa._mass_tiles(b, HQ, width, q.device)) + [4]
    print("shipped", next(r for r in rows if r.get("mass_kernel") == tiles
                          and r["batch"] == b), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--context", type=int, default=4000)
    args = parser.parse_args()
    t0, rows = time.time(), []
    for b in (1, 64):
        probe(b, args.context, args.context + 160, rows)
        torch.cuda.empty_cache()
    write_sweep(args.out, rows, t0, context=args.context)


if __name__ == "__main__":
    main()
