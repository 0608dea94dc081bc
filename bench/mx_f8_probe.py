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

import time

import mx_f8_kernel as f8  # bench/mx_f8_kernel.py
from gpu_timing import (  # bench/
    decode_probe_args,
    graph_median_us,
    mx_decode_cases,
    recorder,
    write_sweep,
)

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


def main() -> None:
    args = decode_probe_args("mx_f8_probe", VARIANTS, SHAPES, "1,16")
    t0 = time.time()
    rows = []
    record = recorder(rows)
    prepare = {"f8": f8.prepare_weight, "f8t": lambda q: f8.prepare_weight(q, tile=64)}
    for case in mx_decode_cases(args.shapes, args.ms, record, t0 + args.budget, prepare):
        x, m = case.x, case.shape["M"]
        parts = f8.prepare_x(x)
        record(**case.shape, var="prepare_x", us=graph_median_us(lambda x=x: f8.prepare_x(x)))
        for name in args.variants:
            bn, nw, ns, pps, mode, *tile = VARIANTS[name]
            if mode in ("stack", "stackx") and m > 4:
                continue
            opts = dict(block_n=bn, num_warps=nw, num_stages=ns, programs_per_sm=pps,
                        dup=mode is not False, lag=mode == "lag", no_scale=mode == "noscale",
                        stack=mode in ("stack", "stackx"), inkx=mode == "stackx")
            for with_prep in (True, False):
                def fn(x=x, ws=case.weights["f8t" if tile else "f8"], opts=opts,
                       x_parts=None if with_prep else parts):
                    for w_i in ws:
                        y = f8.mx_linear_f8(x, w_i, x_parts=x_parts, **opts)
                    return y
                if not case.time(name + ("" if with_prep else "-noprep"), fn):
                    break  # a variant Triton cannot compile: said, go on
    write_sweep(args.out, rows, t0)


if __name__ == "__main__":
    main()
