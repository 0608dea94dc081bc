"""Probe (issue 25): do the decode attention kernel's pipeline depth (num_stages), warps or
BLOCK_N move the folded mass's cost (the p store inside the K/V loop) at batch 64? 16 layers of
the 1B shape, own caches, 4k context, CUDA graph medians of none and folded per launch config;
each config's out and mass checked against the shipped launch's.

    python bench/tune/h2o_stages_probe.py --out $OUT/h2o_stages_probe.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "lib"))

from gpu_timing import graph_median_us, write_sweep  # noqa: E402

from mxserve.kernels import paged_attention as pa  # noqa: E402

LAYERS, HQ, HKV, D, BS = 16, 32, 8, 64, 16
SHIPPED = pa._tiles


def launch_config(block_n: int | None, **opts):
    """pa._tiles with this decode BLOCK_N and these launch options (None: shipped)."""
    def tiles(q, group, is_decode):
        block_q, block_g, block_m, shipped_n, shipped_opts = SHIPPED(q, group, is_decode)
        if not is_decode:
            return block_q, block_g, block_m, shipped_n, shipped_opts
        return block_q, block_g, block_m, block_n or shipped_n, {**shipped_opts, **opts}
    return tiles


def probe(b: int, context: int, width: int, rows: list, configs: list) -> None:
    gen = torch.Generator(device="cuda").manual_seed(b)
    nblk = b * -(-width // BS)
    caches = [(torch.randn(nblk, BS, HKV, D, generator=gen, device="cuda").bfloat16(),
               torch.randn(nblk, BS, HKV, D, generator=gen, device="cuda").bfloat16())
              for _ in range(LAYERS)]
    tables = torch.randperm(nblk, generator=gen, device="cuda").to(torch.int32).view(b, -1)
    lens = torch.full((b,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(b, HQ, D, generator=gen, device="cuda").bfloat16()
    out, mass = torch.empty_like(q), torch.zeros(b, width, device="cuda")

    def step(with_mass: bool):
        mass.zero_()
        for kc, vc in caches:
            pa.paged_decode_attention(q, kc, vc, tables, lens, out=out, max_seq_len=width,
                                      return_attn_mass=with_mass,
                                      mass=mass if with_mass else None)

    step(True)
    want_out, want_mass = out.clone(), mass.clone()
    for block_n, opts in configs:
        pa._tiles = launch_config(block_n, **opts)
        try:
            step(True)
            row = {"batch": b, "block_n": block_n or "shipped", **opts,
                   "out_max_err": float((out.float() - want_out.float()).abs().max()),
                   "mass_rel_err": float((mass - want_mass).abs().max()
                                         / want_mass.abs().max()),
                   "none_us": graph_median_us(lambda: step(False), rep=200),
                   "folded_us": graph_median_us(lambda: step(True), rep=200)}
            row["folded_over_none"] = round(row["folded_us"] / row["none_us"], 4)
        except Exception as e:  # a config that does not compile (shared memory)
            row = {"batch": b, "block_n": block_n, **opts, "error": repr(e)[:200]}
        finally:
            pa._tiles = SHIPPED
        print(row, flush=True)
        rows.append(row)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--context", type=int, default=4000)
    args = parser.parse_args()
    t0, rows = time.time(), []
    configs = [(None, {})] + [(64, dict(num_warps=4, num_stages=s)) for s in (1, 2, 3, 4, 5)] \
        + [(64, dict(num_warps=2, num_stages=s)) for s in (2, 3)] \
        + [(32, dict(num_warps=4, num_stages=s)) for s in (2, 3, 4)] \
        + [(32, dict(num_warps=2, num_stages=s)) for s in (2, 3, 4)]
    for b in (64, 1):
        probe(b, args.context, args.context + 160, rows, configs)
        torch.cuda.empty_cache()
    write_sweep(args.out, rows, t0, context=args.context)


if __name__ == "__main__":
    main()
