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

import time

import mx_f8_gluon as g  # bench/mx_f8_gluon.py
import mx_f8_kernel as f8  # bench/mx_f8_kernel.py
import triton
from gpu_timing import (  # bench/
    decode_probe_args,
    graph_median_us,
    mx_decode_cases,
    recorder,
    write_sweep,
)

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


def main() -> None:
    args = decode_probe_args("mx_f8_gluon_probe", VARIANTS, SHAPES, "1,4,16", commit="")
    t0 = time.time()
    rows = []
    record = recorder(rows)
    prepare = {"f8t": lambda q: f8.prepare_weight(q, tile=64)}
    for case in mx_decode_cases(args.shapes, args.ms, record, t0 + args.budget, prepare):
        x, m, ws = case.x, case.shape["M"], case.weights["f8t"]
        if m <= 4:
            parts = f8.prepare_x(x)

            def stack_fn(x=x, ws=ws, parts=parts):
                for w_i in ws:
                    y = f8.mx_linear_f8(x, w_i, x_parts=parts, stack=True)
                return y
            case.time("triton-stack-noprep", stack_fn)
        mp = max(4, triton.next_power_of_2(m))
        gparts = g.prepare_x_rows(x, mp)
        record(**case.shape, var="prepare_x_rows",
               us=graph_median_us(lambda x=x, mp=mp: g.prepare_x_rows(x, mp)))
        for name in args.variants:
            bn, pps, max_steps, pipe, *depth = VARIANTS[name]
            opts = dict(block_n=bn, programs_per_sm=pps, max_steps=max_steps, pipe=pipe,
                        depth=depth[0] if depth else 1)
            for with_prep in (True, False):
                def fn(x=x, ws=ws, opts=opts, x_parts=None if with_prep else gparts):
                    for w_i in ws:
                        y = g.mx_linear_gluon(x, w_i, x_parts=x_parts, **opts)
                    return y
                if not case.time(name + ("" if with_prep else "-noprep"), fn):
                    break  # a variant that fails: said, go on
    write_sweep(args.out, rows, t0, commit=args.commit)


if __name__ == "__main__":
    main()
