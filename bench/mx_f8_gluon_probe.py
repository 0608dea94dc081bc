"""The Gluon FP8 MXFP4 decode (bench/mx_f8_gluon.py) against the bf16 tensor-core decode
(kernels/mx_linear.py), the Triton FP8 probe's best mode (bench/mx_f8_kernel.py, STACK) and
cuBLAS bf16, one GPU call.

Issue-3 shapes (and the 1B gate/up), MXFP4, weights cycled past L2 (as a model reads them),
CUDA-graph medians (triton.testing.do_bench_cudagraph); every output checked against
x @ dequantized(w) in fp32. The Gluon kernel is timed with x's split (`prepare_x_rows`, its own
launch) in the call and without it (`-noprep`). Writes JSON (device, date, versions, command,
rows) and prints a table.

    python bench/mx_f8_gluon_probe.py --out $OUT/mx_f8_gluon_probe.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

import mx_f8_gluon as g  # bench/mx_f8_gluon.py
import mx_f8_kernel as f8  # bench/mx_f8_kernel.py
import torch
import torch.nn.functional as F
import triton
import triton.testing
from gpu_timing import recorder  # bench/gpu_timing.py

from mxserve.kernels.mx import dequantize_mx, quantize_mx
from mxserve.kernels.mx_linear import _launch_decode, prepare_mx_weight

SHAPES = [(14336, 4096), (4096, 14336), (28672, 8192), (16384, 2048)]
# name -> block_n, programs per SM, max steps a split, pipe (0: a wait after every wgmma;
# 2: block b + 1's wgmma issued before block b's partial is read, a drain a step), [steps of
# words loaded ahead (1)]
VARIANTS = {
    "g-n128p4w0": (128, 4, 16, 0),
    "g-n128p4w2": (128, 4, 16, 2),
    "g-n64p8w2": (64, 8, 16, 2),
    "g-n128p6w2": (128, 6, 16, 2),
    "g-n128p4s32w2": (128, 4, 32, 2),
    "g-n64p8w0": (64, 8, 16, 0),
    "g-n128p4w2d2": (128, 4, 16, 2, 2),
    "g-n128p4s32w2d2": (128, 4, 32, 2, 2),
}


def us(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/mx_f8_gluon_probe.json")
    ap.add_argument("--budget", type=float, default=400.0, help="seconds; stops early past it")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES))
    ap.add_argument("--ms", default="1,4,16")
    ap.add_argument("--commit", default="")
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
                   "f8t": [f8.prepare_weight(q, tile=64) for _ in range(ncopies)],
                   "dense": [w.to(torch.bfloat16) for _ in range(1 + int(120e6 // (2 * n * k)))]}
        for m in [int(v) for v in args.ms.split(",")]:
            if time.time() - t0 > args.budget:
                break
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            ref = x.float() @ deq.T
            shape = dict(N=n, K=k, M=m)

            def err_of(y, ref=ref):
                return ((y.float() - ref).norm() / ref.norm()).item()
            dense = weights["dense"]
            t_bf16 = us(lambda x=x, ws=dense: [F.linear(x, d) for d in ws]) / len(dense)
            record(**shape, var="cublas", us=t_bf16, tbs=n * k * 2 / t_bf16 / 1e6)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)

            def tc_fn(x=x, out=out, ws=weights["tc"]):
                for w_i in ws:
                    _launch_decode(x, w_i, out, None, None, tc=True)
                return out
            err = err_of(tc_fn())
            t_tc = us(tc_fn) / ncopies
            record(**shape, var="bf16tc", us=t_tc, x_bf16=t_bf16 / t_tc,
                   tbs=mbytes / t_tc / 1e6, err=err)
            if m <= 4:
                parts = f8.prepare_x(x)

                def stack_fn(x=x, ws=weights["f8t"], parts=parts):
                    for w_i in ws:
                        y = f8.mx_linear_f8(x, w_i, x_parts=parts, stack=True)
                    return y
                err = err_of(stack_fn())
                t = us(stack_fn) / ncopies
                record(**shape, var="triton-stack-noprep", us=t, x_bf16=t_bf16 / t,
                       x_tc=t_tc / t, tbs=mbytes / t / 1e6, err=err)
            mp = max(4, triton.next_power_of_2(m))
            gparts = g.prepare_x_rows(x, mp)
            record(**shape, var="prepare_x_rows", us=us(lambda x=x, mp=mp: g.prepare_x_rows(x, mp)))
            for name in args.variants.split(","):
                bn, pps, max_steps, pipe, *depth = VARIANTS[name]
                opts = dict(block_n=bn, programs_per_sm=pps, max_steps=max_steps, pipe=pipe,
                            depth=depth[0] if depth else 1)
                for with_prep in (True, False):
                    def fn(x=x, ws=weights["f8t"], opts=opts,
                           x_parts=None if with_prep else gparts):
                        for w_i in ws:
                            y = g.mx_linear_gluon(x, w_i, x_parts=x_parts, **opts)
                        return y
                    try:
                        err = err_of(fn())
                        t = us(fn) / ncopies
                    except Exception as exc:  # a variant that fails: say so, go on
                        record(**shape, var=name, error=str(exc)[:300])
                        break
                    record(**shape, var=name + ("" if with_prep else "-noprep"), us=t,
                           x_bf16=t_bf16 / t, x_tc=t_tc / t, tbs=mbytes / t / 1e6, err=err)
        del weights
        torch.cuda.empty_cache()
    result = {"device": torch.cuda.get_device_name(),
              "date": datetime.date.today().isoformat(), "torch": torch.__version__,
              "triton": triton.__version__, "commit": args.commit,
              "command": " ".join(sys.argv), "rows": rows}
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"done in {time.time() - t0:.0f} s, {len(rows)} rows")


if __name__ == "__main__":
    main()
