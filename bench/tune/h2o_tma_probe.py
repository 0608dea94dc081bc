"""Probe (issue 25): does a TMA store of the decode tile's p (a host-made tensor descriptor:
shared memory, then an asynchronous bulk copy) cost the attention loop less than the register
store (`_store_scores`), whose time is ~3x its bytes (h2o_store_probe)?

The 1B shape's decode attention over 16 layers (own caches, 4k context), batch 1 and 64, CUDA
graph medians: none (no mass), and the folded mass with p stored through the descriptor or from
registers (paged_attention.SCORES_TMA on and off), p in float32 and float16; each TMA variant's
out and mass checked bit for bit against the register store's.

    python bench/tune/h2o_tma_probe.py --out $OUT/h2o_tma_probe.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "lib"))

from mxserve.kernels import paged_attention as pa  # noqa: E402

LAYERS, HQ, HKV, D, BS = 16, 32, 8, 64, 16


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

    def step(with_mass: bool):
        mass.zero_()
        for kc, vc in caches:
            pa.paged_decode_attention(q, kc, vc, tables, lens, out=out, max_seq_len=width,
                                      return_attn_mass=with_mass,
                                      mass=mass if with_mass else None, backend="triton")

    none_us = None
    if timed:
        from gpu_timing import graph_median_us
        none_us = graph_median_us(lambda: step(False), rep=200)
        rows.append({"batch": b, "variant": "none", "us": none_us})
    for sd in (torch.float32, torch.float16):
        pa.SCORES_DTYPE = sd
        pa.SCORES_TMA = False
        step(True)
        want_out, want_mass = out.clone(), mass.clone()
        for tma in (False, True):
            pa.SCORES_TMA = tma
            step(True)
            row = {"batch": b, "variant": f"{'tma' if tma else 'registers'}_{str(sd)[6:]}",
                   "out_equal": bool(out.equal(want_out)),
                   "mass_equal": bool(mass.equal(want_mass))}
            if timed:
                row["us"] = graph_median_us(lambda: step(True), rep=200)
                row["over_none"] = round(row["us"] / none_us, 4)
            print(row, flush=True)
            rows.append(row)
    pa.SCORES_DTYPE, pa.SCORES_TMA = torch.float32, True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--context", type=int, default=4000)
    parser.add_argument("--check", action="store_true",
                        help="correctness only, small shapes (the interpreter on a CPU)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0, rows = time.time(), []
    if args.check:
        global LAYERS
        LAYERS = 2
        for b in (1, 3):
            probe(b, 200, 200 + 16, device, rows, timed=False)
        ok = all(r["out_equal"] and r["mass_equal"] for r in rows)
        print("check", "ok" if ok else "FAILED", rows)
        sys.exit(0 if ok else 1)
    from gpu_timing import write_sweep
    for b in (1, 64):
        probe(b, args.context, args.context + 160, device, rows, timed=True)
        torch.cuda.empty_cache()
    write_sweep(args.out, rows, t0, context=args.context)


if __name__ == "__main__":
    main()
