"""Probe (issue 25): which part of the folded mass's in-loop work slows the batch-64 decode loop?

The decode kernel, when it folds the mass, does three things a tile that the plain kernel does
not: takes the tile's real rows out of p (a reshape and a sum over the padding rows), stores them
([GROUP, BLOCK_N] of p), and stores the tile's running max ([BLOCK_M], masked to the real rows).
Variants of kernels/paged_attention.py (patched in temporary files), the mass kernel skipped in
all of them (only the attention loop is timed), 16 layers, 4k context, CUDA graph medians:
- none: no mass; shipped: all three;
- p_only: no running-max store; max_only: no p (no extraction either);
- extract_masked: the extraction and the p store issued with a mask false at run time (no bytes
  move: the instructions and the layout change alone), no running-max store.

    python bench/tune/h2o_parts_probe.py --out $OUT/h2o_parts_probe.json
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import re
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "lib"))

from mxserve.kernels import paged_attention as pa  # noqa: E402

LAYERS, HQ, HKV, D, BS = 16, 32, 8, 64, 16
BLOCK = re.compile(r"        if STORE_SCORES:  # decode: the mass's numerators.*?mask=row_ok\)\n",
                   re.S)
P_STORE = (" " * 12 + "_store_scores(scores_ptr + q_start * stride_st, p, qi, kv_head, pos, hi, "
           "stride_sh, GROUP, BLOCK_G, BLOCK_M, BLOCK_N)\n")
MAX_STORE = (" " * 12 + "tl.store(tile_max_ptr + q_start * stride_xt + heads * stride_xh "
             "+ start // BLOCK_N, m, mask=row_ok)\n")
MASKED = """            _store_scores(scores_ptr + q_start * stride_st, p, qi, kv_head, pos,
                          tl.where(qk_scale < 0, hi, 0), stride_sh, GROUP, BLOCK_G, BLOCK_M,
                          BLOCK_N)
"""
HEAD = "        if STORE_SCORES:\n"
VARIANTS = {"p_only": HEAD + P_STORE, "max_only": HEAD + MAX_STORE, "extract_masked": HEAD + MASKED}


class _Skip:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def variant_module(name: str):
    src = inspect.getsource(pa)
    src = src.replace("from .triton_compat import", "from mxserve.kernels.triton_compat import")
    src, n = BLOCK.subn(VARIANTS[name], src)
    assert n == 1, name
    path = os.path.join(tempfile.mkdtemp(), f"pa_{name}.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(f"pa_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod._decode_mass_kernel = _Skip()
    return mod


def probe(b: int, context: int, width: int, rows: list) -> None:
    from gpu_timing import graph_median_us

    gen = torch.Generator(device="cuda").manual_seed(b)
    nblk = b * -(-width // BS)
    caches = [(torch.randn(nblk, BS, HKV, D, generator=gen, device="cuda").bfloat16(),
               torch.randn(nblk, BS, HKV, D, generator=gen, device="cuda").bfloat16())
              for _ in range(LAYERS)]
    tables = torch.randperm(nblk, generator=gen, device="cuda").to(torch.int32).view(b, -1)
    lens = torch.full((b,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(b, HQ, D, generator=gen, device="cuda").bfloat16()
    out, mass = torch.empty_like(q), torch.zeros(b, width, device="cuda")

    def step(mod, with_mass: bool):
        def run():
            for kc, vc in caches:
                mod.paged_decode_attention(q, kc, vc, tables, lens, out=out, max_seq_len=width,
                                           return_attn_mass=with_mass,
                                           mass=mass if with_mass else None)
        return run

    none = graph_median_us(step(pa, False), rep=300)
    rows.append({"batch": b, "variant": "none", "us": none})
    real = pa._decode_mass_kernel
    pa._decode_mass_kernel = _Skip()
    try:
        shipped = graph_median_us(step(pa, True), rep=300)
    finally:
        pa._decode_mass_kernel = real
    rows.append({"batch": b, "variant": "shipped", "us": shipped, "extra_us": shipped - none})
    for name in VARIANTS:
        us = graph_median_us(step(variant_module(name), True), rep=300)
        rows.append({"batch": b, "variant": name, "us": us, "extra_us": us - none})
    again = graph_median_us(step(pa, False), rep=300)
    rows.append({"batch": b, "variant": "none_again", "us": again})
    for r in rows[-6:]:
        print(r, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--context", type=int, default=4000)
    args = parser.parse_args()
    from gpu_timing import write_sweep

    t0, rows = time.time(), []
    for b in (64, 1):
        probe(b, args.context, args.context + 160, rows)
        torch.cuda.empty_cache()
    write_sweep(args.out, rows, t0, context=args.context)


if __name__ == "__main__":
    main()
