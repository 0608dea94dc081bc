"""Tile sweep of the MX dequantize kernel (the prefill path from 17 rows on: dequantize once per
call, then cuBLAS), on the GPU: each config's output must equal the default's bit for bit; times
are CUDA-graph medians, next to a bf16 copy of the output's size. Feeds `dequantize_linear_weight`.

    python bench/tune/mx_dequant_tune.py --out /tmp/dequant.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton
import triton.testing

from mxserve.kernels.mx import get_format, quantize_mx
from mxserve.kernels.mx_layout import PLANES, format_args, prepare_mx_weight
from mxserve.kernels.mx_linear import mx_linear
from mxserve.kernels.mx_prefill import _mx_linear_dequant_kernel, dequantize_linear_weight

SHAPES = [(14336, 4096), (4096, 14336), (28672, 8192)]
CONFIGS = [(32, 256, 4), (16, 256, 2), (8, 256, 1), (16, 256, 1), (8, 512, 2), (16, 128, 2),
           (32, 256, 2), (16, 512, 2)]  # (BLOCK_N, BLOCK_K, num_warps)


def dequant(w, out, block_n, block_k, num_warps):
    n, k = w.shape
    e = PLANES[get_format(w.fmt).bits][0]
    block_k = max(block_k, e * w.group)
    _mx_linear_dequant_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        w.planes, w.scales, out, n, k, k // e, w.planes.stride(0), w.planes.stride(1),
        w.scales.stride(0), out.stride(0), **format_args(w), BLOCK_N=block_n, BLOCK_K=block_k,
        WBF16=True, INTERP_BF16=False, num_warps=num_warps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/mx_dequant_tune.json")
    args = ap.parse_args()
    rows = []
    for n, k in SHAPES:
        for fmt in ("e2m1", "e2m3"):
            w = prepare_mx_weight(quantize_mx(torch.randn(n, k, device="cuda") * 0.05, fmt))
            want = dequantize_linear_weight(w, torch.bfloat16)
            src = torch.empty_like(want)
            copy_us = triton.testing.do_bench_cudagraph(
                lambda src=src, want=want: src.copy_(want)) * 1e3
            row = {"N": n, "K": k, "fmt": fmt, "bf16_copy_us": round(copy_us, 1)}
            for cfg in CONFIGS:
                out = torch.full_like(want, float("nan"))
                try:
                    dequant(w, out, *cfg)
                    ok = torch.equal(out, want)
                    t = triton.testing.do_bench_cudagraph(
                        lambda cfg=cfg, out=out, w=w: dequant(w, out, *cfg))
                    row["x".join(map(str, cfg))] = round(t * 1e3, 1) if ok else "WRONG"
                except Exception as e:  # noqa: BLE001 - a config that does not compile
                    row["x".join(map(str, cfg))] = f"error: {str(e)[:80]}"
            for m in (64, 256):  # the linear at prefill sizes, default tile, vs bf16 cuBLAS
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                dense = want.clone()
                row[f"linear_M{m}_us"] = round(triton.testing.do_bench_cudagraph(
                    lambda x=x, w=w: mx_linear(x, w)) * 1e3, 1)
                row[f"bf16_M{m}_us"] = round(triton.testing.do_bench_cudagraph(
                    lambda x=x, dense=dense: x @ dense.T) * 1e3, 1)
            rows.append(row)
            print(row, flush=True)
    with open(args.out, "w") as f:
        json.dump({"bench": "mx_dequant_tune", "device": torch.cuda.get_device_name(),
                   "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "torch": torch.__version__,
                   "triton": triton.__version__, "configs": "BLOCK_N x BLOCK_K x num_warps",
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
