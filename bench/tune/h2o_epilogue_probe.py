"""Does normalising the folded H2O mass inside the decode program (its lse known once its loop
ends) beat the separate mass kernel? One GPU call.

1B shape, 16 layers of decode attention (own caches), 4k context, batch 1 and 64, CUDA graph
medians: none; the folded mass with paged_attention.MASS_EPILOGUE "kernel" (shipped),
"atomic", "heads", "serial", p in float32 / float16, the p store with and without an
evict_last hint;
each checked against the torch reference, "atomic" also for run-to-run bit equality. Then
bench/h2o_gpu.py runs with the fastest batch-64 mode and hint (its engine rows: plain vs h2o).

    python bench/tune/h2o_epilogue_probe.py --out $OUT
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "lib"))

from gpu_timing import graph_median_us, write_sweep  # noqa: E402

from mxserve.kernels import paged_attention as pa  # noqa: E402

LAYERS, HQ, HKV, D, BS = 16, 32, 8, 64, 16


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
    _, want = pa.paged_decode_attention_torch(q, *caches[0], tables, lens, return_attn_mass=True,
                                              max_seq_len=width)

    def step(with_mass: bool, layers=caches):
        mass.zero_()
        for kc, vc in layers:
            pa.paged_decode_attention(q, kc, vc, tables, lens, out=out, max_seq_len=width,
                                      return_attn_mass=with_mass,
                                      mass=mass if with_mass else None)

    none_us = graph_median_us(lambda: step(False), rep=200)
    rows.append({"batch": b, "variant": "none", "us": none_us})
    for mode in ("kernel", "atomic", "heads", "serial"):
        for dtype in (torch.float32, torch.float16):
            for hint in ("", "evict_last"):
                pa.MASS_EPILOGUE, pa.SCORES_DTYPE, pa.STORE_HINT = mode, dtype, hint
                step(True, caches[:1])
                err = float((mass - want).abs().max())
                first = mass.clone()
                step(True, caches[:1])
                row = {"batch": b, "variant": f"{mode}/{str(dtype)[6:]}/{hint or 'none'}",
                       "mode": mode, "dtype": str(dtype)[6:], "hint": hint, "max_abs_err": err,
                       "bit_repeat": bool(mass.equal(first)),
                       "us": graph_median_us(lambda: step(True), rep=200)}
                row["over_none"] = round(row["us"] / none_us, 4)
                print(row, flush=True)
                rows.append(row)
    pa.MASS_EPILOGUE, pa.SCORES_DTYPE, pa.STORE_HINT = "kernel", torch.float32, ""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--context", type=int, default=4000)
    args = parser.parse_args()
    t0, rows = time.time(), []
    for b in (1, 64):
        probe(b, args.context, args.context + 160, rows)
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    write_sweep(os.path.join(args.out, "h2o_epilogue_probe.json"), rows, t0,
                context=args.context)
    best = min((r for r in rows if r["batch"] == 64 and r.get("mode", "kernel") != "kernel"
                and r["dtype"] == "float32"), key=lambda r: r["us"])
    print("engine with", best, flush=True)
    pa.MASS_EPILOGUE, pa.STORE_HINT = best["mode"], best["hint"]
    sys.argv = ["bench/h2o_gpu.py", "--out", os.path.join(args.out, "engine")]
    runpy.run_path(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "h2o_gpu.py"), run_name="__main__")


if __name__ == "__main__":
    main()
