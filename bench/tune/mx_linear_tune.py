"""Tile / path sweep for mx_linear on the GPU, one call: checks each variant against its reference
(||y - ref|| / ||ref||, ref = x @ dequantized(w) in fp32) and times it (CUDA-graph median), next to
bf16 cuBLAS. Feeds the tables in kernels/mx_decode.py (_DECODE_*) and mx_prefill.py (_PREFILL).

    python bench/tune/mx_linear_tune.py --out /tmp/tune.json --budget 150
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # bench/'s benchmarks
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "lib"))  # and helpers
from gpu_timing import graph_median_us, recorder  # noqa: E402 (put on the path above)

from mxserve.kernels.mx import dequantize_mx, quantize_mx
from mxserve.kernels.mx_decode import launch_decode
from mxserve.kernels.mx_layout import prepare_mx_weight
from mxserve.kernels.mx_linear import mx_linear
from mxserve.kernels.mx_prefill import launch_prefill

SHAPES = [(14336, 4096), (4096, 14336), (28672, 8192)]
# name -> launch_decode overrides
DECODE = {
    "fma8x512pf": dict(config=(8, 512, 4, 1), use_dot=False, prefetch=True, tc=False),
    "tc64": dict(config=(64, 4, 1), tc=True),
    "tc64pf": dict(config=(64, 4, 1), tc=True, prefetch=True),
    "tc64pps8": dict(config=(64, 4, 1), tc=True, programs_per_sm=8),
    "tc64pfpps8": dict(config=(64, 4, 1), tc=True, prefetch=True, programs_per_sm=8),
    "tc128w8": dict(config=(128, 8, 1), tc=True),
    "tc128w8pf": dict(config=(128, 8, 1), tc=True, prefetch=True),
    "tc32": dict(config=(32, 4, 1), tc=True),
    "tc64pps2": dict(config=(64, 4, 1), tc=True, programs_per_sm=2),
}
PREFILL = {
    "fused64x128x64": (64, 128, 64, 4, 3),
    "fused128x128x64": (128, 128, 64, 8, 3),
    "fused128x256x64": (128, 256, 64, 8, 3),
    "fused128x128x128": (128, 128, 128, 8, 3),
}


def rel_err(y, ref) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/tune.json")
    ap.add_argument("--budget", type=float, default=150.0)
    ap.add_argument("--prefill-ms", type=int, nargs="*", default=[64, 256, 2048])
    args = ap.parse_args()
    t0 = time.time()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []

    def left() -> bool:
        return time.time() - t0 < args.budget

    record = recorder(rows)

    for si, (n, k) in enumerate(SHAPES):
        w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
        w_bf16 = w.to(torch.bfloat16)
        fmts = ["e2m1", "e2m3", "e3m2"]
        qs = {f: quantize_mx(w, f) for f in fmts}
        mx = {f: prepare_mx_weight(q) for f, q in qs.items()}
        deq = {f: dequantize_mx(q, torch.float32) for f, q in qs.items()}
        for m in [1, 4, 16] + [m for m in args.prefill_ms if m]:
            if not left():
                break
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            t_bf16 = graph_median_us(lambda x=x, w_bf16=w_bf16: F.linear(x, w_bf16), rep=20)
            record(N=n, K=k, M=m, fmt="bf16", var="cublas", us=t_bf16)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            for f in fmts:
                ref = x.float() @ deq[f].T
                if m <= 16:
                    names = [v for v in DECODE if m == 1 or not v.startswith("fma")]
                    if f == "e3m2":
                        names = [v for v in names if v in ("tc64", "tc64pf")]
                    for v in names:
                        if not left():
                            break
                        kw = dict(DECODE[v])
                        split_k = kw.pop("split_k", None)

                        def fn(kw=kw, split_k=split_k, x=x, wq=mx[f], out=out):
                            launch_decode(x, wq, out, None, split_k, **kw)
                        out.fill_(float("nan"))
                        fn()
                        err = rel_err(out, ref)
                        t = graph_median_us(fn, rep=20)
                        record(N=n, K=k, M=m, fmt=f, var=v, us=t, x=t_bf16 / t, err=err)
                else:
                    names = ["dequant"] + [p for p in PREFILL if m < 2048 or "64x128" not in p]
                    if si > 0 or f != "e2m1":
                        names = ["dequant", "fused128x128x64"]
                    for v in names:
                        if not left():
                            break
                        if v == "dequant":
                            def fn(x=x, wq=mx[f], out=out):
                                mx_linear(x, wq, path="dequant", out=out)
                        else:
                            def fn(cfg=PREFILL[v], x=x, wq=mx[f], out=out):
                                launch_prefill(x, wq, out, None, False, config=cfg)
                        out.fill_(float("nan"))
                        fn()
                        err = rel_err(out, ref)
                        t = graph_median_us(fn, rep=20)
                        record(N=n, K=k, M=m, fmt=f, var=v, us=t, x=t_bf16 / t, err=err)
        torch.cuda.empty_cache()
    with open(args.out, "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(), "triton": triton.__version__,
                   "torch": torch.__version__, "rows": rows}, fh, indent=1)
    print(f"done in {time.time() - t0:.0f}s, {len(rows)} rows")


if __name__ == "__main__":
    main()
