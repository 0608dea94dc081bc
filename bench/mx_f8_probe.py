"""MX decode on FP8 tensor cores (kernels/mx_decode_f8.py) against the bf16 tensor-core decode
(kernels/mx_linear.py) and cuBLAS bf16, one GPU call.

For the issue-3 shapes (and the 1B gate/up), MXFP4, M = 1 and 16, weights cycled past L2 (as a
model reads them): cuBLAS bf16 (`F.linear`); the bf16 tensor-core decode at its tuned tile; the
FP8 decode over a few tiles, timed with x's hi/lo split (`prepare_x`) in the call and without it.
Each output is checked against x @ dequantized(w) in fp32. CUDA-graph medians
(triton.testing.do_bench_cudagraph). Writes JSON (device, date, versions, command, rows) and
prints a table.

    python bench/mx_f8_probe.py --out $OUT/mx_f8_probe.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

import mx_f8_kernel as f8  # bench/mx_f8_kernel.py
import torch
import torch.nn.functional as F
import triton
import triton.testing
from gpu_timing import recorder  # bench/gpu_timing.py

from mxserve.kernels.mx import dequantize_mx, quantize_mx
from mxserve.kernels.mx_linear import _launch_decode, prepare_mx_weight

SHAPES = [(14336, 4096), (4096, 14336), (28672, 8192), (16384, 2048)]
# name -> block_n, num_warps, num_stages, programs per SM, mode (True: x's parts against the
# duplicated weight registers, one k64 dot a block; False: two k32 dots; "lag": a block's
# partial scaled a step later; "noscale": no scales, one k256 dot a step - wrong values, the
# time without the scales; "stack": M <= 4, see VARIANTS), [tile]
VARIANTS = {
    "n128s3p4": (128, 4, 3, 4, True),
    "n128s4p4": (128, 4, 4, 4, True),
    "n128s3p2": (128, 4, 3, 2, True),
    "n128s3p6": (128, 4, 3, 6, True),
    "n64s3p8": (64, 4, 3, 8, True),
    "n64s4p4": (64, 4, 4, 4, True),
    "n128s3p4nodup": (128, 4, 3, 4, False),
    "n256w8s3p2": (256, 8, 3, 2, True),
    "n128s3p4lag": (128, 4, 3, 4, "lag"),
    "n128s3p4noscale": (128, 4, 3, 4, "noscale"),
    "n128s4p4noscale": (128, 4, 4, 4, "noscale"),
    "n64s3p8noscale": (64, 4, 3, 8, "noscale"),
    # tile-major words (one [BLOCK_N, 16]-word load a step, as the bf16 decode)
    "t-n128s3p4": (128, 4, 3, 4, True, 64),
    "t-n128s4p4": (128, 4, 4, 4, True, 64),
    "t-n64s3p8": (64, 4, 3, 8, True, 64),
    "t-n128s3p4noscale": (128, 4, 3, 4, "noscale", 64),
    "t-n64s3p8noscale": (64, 4, 3, 8, "noscale", 64),
    # M <= 4: the 4 blocks of a step in 4 column groups of one k256 dot (one wgmma wait a step)
    "t-n128s3p4stack": (128, 4, 3, 4, "stack", 64),
    "t-n128s4p4stack": (128, 4, 4, 4, "stack", 64),
    "t-n64s3p8stack": (64, 4, 3, 8, "stack", 64),
    "t-n128s3p6stack": (128, 4, 3, 6, "stack", 64),
    # the same with x split in the kernel (bf16 x in, a power-of-2 scale per row and block)
    "t-n128s3p4stackx": (128, 4, 3, 4, "stackx", 64),
    "t-n64s3p8stackx": (64, 4, 3, 8, "stackx", 64),
}


def us(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/mx_f8_probe.json")
    ap.add_argument("--budget", type=float, default=400.0, help="seconds; stops early past it")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES))
    ap.add_argument("--ms", default="1,16")
    args = ap.parse_args()
    t0 = time.time()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    record = recorder(rows)

    for n, k in [tuple(int(v) for v in nk.split("x")) for nk in args.shapes.split(",")]:
        w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
        q = quantize_mx(w, "e2m1")
        deq = dequantize_mx(q, torch.float32)
        mbytes = n * k // 2 + n * k // 32
        ncopies = 1 + int(120e6 // mbytes)
        weights = {"tc": [prepare_mx_weight(q) for _ in range(ncopies)],
                   "f8": [f8.prepare_weight(q) for _ in range(ncopies)],
                   "f8t": [f8.prepare_weight(q, tile=64) for _ in range(ncopies)],
                   "dense": [w.to(torch.bfloat16) for _ in range(1 + int(120e6 // (2 * n * k)))]}
        for m in [int(v) for v in args.ms.split(",")]:
            if time.time() - t0 > args.budget:
                break
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            ref = x.float() @ deq.T
            shape = dict(N=n, K=k, M=m)
            dense = weights["dense"]
            t_bf16 = us(lambda x=x, ws=dense: [F.linear(x, d) for d in ws]) / len(dense)
            record(**shape, var="cublas", us=t_bf16, tbs=n * k * 2 / t_bf16 / 1e6)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)

            def tc_fn(x=x, out=out, ws=weights["tc"]):
                for w_i in ws:
                    _launch_decode(x, w_i, out, None, None, tc=True)
                return out
            err = ((tc_fn().float() - ref).norm() / ref.norm()).item()
            t_tc = us(tc_fn) / ncopies
            record(**shape, var="bf16tc", us=t_tc, x_bf16=t_bf16 / t_tc,
                   tbs=mbytes / t_tc / 1e6, err=err)
            parts = f8.prepare_x(x)
            record(**shape, var="prepare_x", us=us(lambda x=x: f8.prepare_x(x)))
            for name in args.variants.split(","):
                bn, nw, ns, pps, mode, *tile = VARIANTS[name]
                if mode in ("stack", "stackx") and m > 4:
                    continue
                opts = dict(block_n=bn, num_warps=nw, num_stages=ns, programs_per_sm=pps,
                            dup=mode is not False, lag=mode == "lag", no_scale=mode == "noscale",
                            stack=mode in ("stack", "stackx"), inkx=mode == "stackx")
                for with_prep in (True, False):
                    def fn(x=x, ws=weights["f8t" if tile else "f8"], opts=opts,
                           x_parts=None if with_prep else parts):
                        for w_i in ws:
                            y = f8.mx_linear_f8(x, w_i, x_parts=x_parts, **opts)
                        return y
                    try:
                        err = ((fn().float() - ref).norm() / ref.norm()).item()
                        t = us(fn) / ncopies
                    except Exception as exc:  # a variant Triton cannot compile: say so, go on
                        record(**shape, var=name, error=str(exc)[:300])
                        break
                    record(**shape, var=name + ("" if with_prep else "-noprep"), us=t,
                           x_bf16=t_bf16 / t, x_tc=t_tc / t, tbs=mbytes / t / 1e6, err=err)
        del weights
        torch.cuda.empty_cache()
    result = {"device": torch.cuda.get_device_name(),
              "date": datetime.date.today().isoformat(), "torch": torch.__version__,
              "triton": triton.__version__, "command": " ".join(sys.argv), "rows": rows}
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"done in {time.time() - t0:.0f} s, {len(rows)} rows")


if __name__ == "__main__":
    main()
