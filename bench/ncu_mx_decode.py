"""Where the MX decode kernels stall: one launch each, for Nsight Compute (hardware counters).

Launches, each once after a warm-up call (which compiles it), on bf16 x with one row:
- mx_linear's tensor-core decode (`_mx_linear_decode_tc_kernel`) on 28672x8192 MXFP4 and MXFP6
  (e2m3) and the 1B gate/up (16384x2048, MXFP4);
- gemv's whole-row pair decode (`_gemv_kernel`) on the 1B down (2048x8192, MXFP4).
Run under ncu on the GPU machine (the numbers are ncu's; this script only times nothing):

    ncu --clock-control none -k regex:"_mx_linear_decode_tc_kernel|_gemv_kernel" \\
        --launch-skip-before-match 0 --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats --section SchedulerStats --section LaunchStats \\
        --csv --page details python bench/ncu_mx_decode.py > $OUT/ncu_mx_decode.csv

Every second launch of a kernel is the measured one (the first compiled it).
"""

from __future__ import annotations

import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(REPO))

from mxserve.kernels import gemv as gemv_mod  # noqa: E402
from mxserve.kernels.mx import quantize_mx  # noqa: E402
from mxserve.kernels.mx_linear import mx_linear, prepare_mx_weight  # noqa: E402

CASES = [("tc", 28672, 8192, "e2m1"), ("tc", 28672, 8192, "e2m3"), ("tc", 16384, 2048, "e2m1"),
         ("gemv", 2048, 8192, "e2m1")]


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    for kind, n, k, fmt in CASES:
        w = prepare_mx_weight(quantize_mx(torch.randn(n, k, device="cuda", generator=gen) * 0.02,
                                          fmt))
        x = torch.randn(1, k, device="cuda", generator=gen, dtype=torch.bfloat16)
        for _ in range(2):  # compile, then the launch to read
            y = gemv_mod.gemv(x, w) if kind == "gemv" else mx_linear(x, w)
            torch.cuda.synchronize()
        print(kind, n, k, fmt, float(y.float().norm()), flush=True)


if __name__ == "__main__":
    main()
