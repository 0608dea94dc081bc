"""Why is the MX tensor-core decode (M <= 16) short of the weight bandwidth? One GPU call.

For the issue's three linear shapes, MXFP4 (e2m1) and MXFP6 (e2m3), M = 1 and 16:
- cuBLAS bf16 (`F.linear`), the baseline of issue 3's targets;
- the tensor-core decode kernel (`launch_decode(tc=True)`) over a grid of variants: BLOCK_N,
  warps, software-pipeline stages (Triton's cp.async ring), programs per SM (split-K). Each
  output is checked against x @ dequantized(w) in fp32 (relative Frobenius error);
- a load-only probe: the same word tiles ([BLOCK_N, 16] int32 of each plane per step, same grid
  and split), XOR-reduced, no decode and no dot. Its bandwidth is the ceiling of this load
  pattern; the gap to the kernel is decode + dot not hidden behind the loads.

Times are CUDA-graph medians (triton.testing.do_bench_cudagraph). Writes JSON (device, date,
versions, command, rows) and prints a table.

    python bench/tune/mx_decode_probe.py --out $OUT/mx_decode_probe.json

results/mx_decode_probe.run1.json: the first run (commit cb625cc's kernel, which also had a
register-prefetch variant "pf*": slower everywhere, dropped). It chose 3 stages and 8 programs
per SM (FP4 1.43-1.69x -> 1.64-1.76x bf16; FP6 0.78x -> 1.27-1.48x).
results/mx_decode_probe.json: after the FP4 word layout change (commit 07f82de), which also
had STEPS (two spread groups a loop iteration, "x2" variants): no steady gain, dropped.
results/mx_decode_probe.fp6_halves.json: FP6 decoded in two 128-k halves, one dot each
(commit 23a47a7; 159 -> 119 registers): about the same speed, reverted.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # bench/'s benchmarks
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "lib"))  # and helpers
from gpu_timing import graph_median_us, recorder, write_sweep  # noqa: E402 (put on the path above)

from mxserve.kernels.mx import dequantize_mx, quantize_mx
from mxserve.kernels.mx_decode import launch_decode
from mxserve.kernels.mx_layout import PLANES, prepare_mx_weight

SHAPES = [(14336, 4096), (4096, 14336), (28672, 8192)]
# name -> (BLOCK_N, num_warps, num_stages), programs per SM
VARIANTS = {
    "n64s3p8": ((64, 4, 3), 8),
    "n64s3p4": ((64, 4, 3), 4),
    "n64s3p6": ((64, 4, 3), 6),
    "n128s3p4": ((128, 4, 3), 4),
    "n128s3p6": ((128, 4, 3), 6),
    "n64s3p2": ((64, 4, 3), 2),
    "n64s3p16": ((64, 4, 3), 16),
    "n64s4p4": ((64, 4, 4), 4),
    "n64s2p8": ((64, 4, 2), 8),
    "n128s3p2": ((128, 4, 3), 2),
    "n128w8s3p4": ((128, 8, 3), 4),
    # ncu (results/ncu_mx_decode.*): 128 registers and ~50 KB of shared memory hold the FP4
    # kernel to 4 programs an SM, ~1 eligible warp a scheduler; capped registers, fewer stages
    "n128s3p4r96": ((128, 4, 3, 96), 4),
    "n128s2p4": ((128, 4, 2), 4),
    "n128s2p4r96": ((128, 4, 2, 96), 4),
    "n64s3p4r96": ((64, 4, 3, 96), 4),
    "n64s2p8r80": ((64, 4, 2, 80), 8),
    # with the wgmma chain no longer serialized (tl.assume, tests/cpu/test_wgmma_pipeline.py):
    # deeper rings and 8-warp tiles
    "n128s4p4": ((128, 4, 4), 4),
    "n128s4p2": ((128, 4, 4), 2),
    "n128w8s3p2": ((128, 8, 3), 2),
    "n256w8s3p2": ((256, 8, 3), 2),
    "n256w8s3p1": ((256, 8, 3), 1),
    "n128w8s4p2": ((128, 8, 4), 2),
}


@triton.jit
def _load_probe_kernel(planes_ptr, out_ptr, N, num_words, words_per_split, stride_plane,
                       stride_wn, P: tl.constexpr, BLOCK_N: tl.constexpr, TILED: tl.constexpr):
    """XOR of the words each decode program would load (spread groups of 16, P planes).
    TILED: tile-major addresses, each [BLOCK_N, 16]-word step one contiguous run and a
    program's steps one after another (N a multiple of BLOCK_N); else row-major ones. (The
    kernels' layout is tile-major in 64-row tiles since 2026-11-30, mx_layout.TILE_ROWS; the
    probe reads the same buffer either way, only the address pattern differs.)"""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    j_lo = pid_k * words_per_split
    j_hi = tl.minimum(j_lo + words_per_split, num_words)
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.int32)
    for j0 in range(j_lo, j_hi, 16):
        j = j0 + tl.arange(0, 16)
        ptrs = planes_ptr + offs_n[:, None] * stride_wn + j[None, :]
        if TILED:  # tile pid_n's group j0 // 16: BLOCK_N * 16 words from (pid_n * G + j0 / 16)
            ptrs = planes_ptr + (pid_n * num_words + j0) * BLOCK_N \
                + tl.arange(0, BLOCK_N)[:, None] * 16 + tl.arange(0, 16)[None, :]
        mask = (offs_n[:, None] < N) & (j[None, :] < j_hi)
        acc ^= tl.load(ptrs, mask=mask, other=0)
        if P > 1:
            acc ^= tl.load(ptrs + stride_plane, mask=mask, other=0)
        if P > 2:
            acc ^= tl.load(ptrs + 2 * stride_plane, mask=mask, other=0)
    tl.atomic_xor(out_ptr + offs_n, tl.xor_sum(acc, axis=1), mask=offs_n < N)


def load_probe(w, out, block_n, num_warps, num_stages, programs_per_sm, tiled=False):
    n, k = w.shape
    e, p = PLANES[{"e2m1": 4, "e2m3": 6, "e3m2": 6}[w.fmt]]
    tiles = triton.cdiv(n, block_n)
    groups = k // (e * 16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    split_k = max(1, min(programs_per_sm * sms // tiles, groups))
    words_per_split = triton.cdiv(groups, split_k) * 16
    split_k = triton.cdiv(k // e, words_per_split)
    _load_probe_kernel[(tiles, split_k)](w.planes, out, n, k // e, words_per_split,
                                         w.planes.stride(0), w.planes.stride(1), P=p,
                                         BLOCK_N=block_n, TILED=tiled, num_warps=num_warps,
                                         num_stages=num_stages)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/mx_decode_probe.json")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds; stops early past it")
    ap.add_argument("--fmts", default="e2m1,e2m3", help="comma list of e2m1, e2m3, e3m2")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma list of VARIANTS")
    ap.add_argument("--no-load-probe", action="store_true")
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES),
                    help="comma list of NxK")
    ap.add_argument("--ms", default="1,16", help="rows of x")
    ap.add_argument("--past-l2", action="store_true",
                    help="cycle weight copies that together exceed L2")
    args = ap.parse_args()
    variants = {name: VARIANTS[name] for name in args.variants.split(",")}
    t0 = time.time()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    record = recorder(rows)

    for n, k in [tuple(int(v) for v in nk.split("x")) for nk in args.shapes.split(",")]:
        w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
        w_bf16 = w.to(torch.bfloat16)
        for fmt in args.fmts.split(","):
            q = quantize_mx(w, fmt)
            wq = prepare_mx_weight(q)
            deq = dequantize_mx(q, torch.float32)
            mbytes = wq.planes.numel() * 4 + wq.scales.numel()
            sink = torch.zeros(n, dtype=torch.int32, device="cuda")
            probes = [] if args.no_load_probe else [
                ((64, 4, 3), 4, False), ((64, 4, 1), 8, False), ((128, 4, 3), 4, False),
                ((64, 4, 3), 4, True), ((64, 4, 1), 8, True), ((128, 4, 3), 4, True)]
            pcopies = [wq] + ([prepare_mx_weight(q) for _ in range(int(120e6 // mbytes))]
                              if args.past_l2 else [])
            for cfg, pps, tiled in probes:
                def fn(cfg=cfg, pps=pps, tiled=tiled, ws=pcopies, sink=sink):
                    for w_i in ws:
                        load_probe(w_i, sink, *cfg, pps, tiled)
                t = graph_median_us(fn) / len(pcopies)
                record(N=n, K=k, fmt=fmt, M=0, var=f"{'t' if tiled else ''}load{cfg[0]}w{cfg[1]}"
                       f"s{cfg[2]}p{pps}", us=t, tbs=mbytes / t / 1e6)
            del pcopies
            for m in [int(v) for v in args.ms.split(",")]:
                if time.time() - t0 > args.budget:
                    break
                x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
                ref = x.float() @ deq.T
                dense = [w_bf16] + ([w_bf16.clone() for _ in range(int(120e6 // (2 * n * k)))]
                                    if args.past_l2 else [])
                t_bf16 = graph_median_us(
                    lambda x=x, ws=dense: [F.linear(x, w_i) for w_i in ws]) / len(dense)
                record(N=n, K=k, fmt="bf16", M=m, var="cublas", us=t_bf16,
                       tbs=n * k * 2 / t_bf16 / 1e6)
                out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                # --past-l2: the kernel cycles over weight copies that together exceed L2 (as
                # in a model, where each weight is read once a step), time per call
                copies = [wq] + ([prepare_mx_weight(q) for _ in range(int(120e6 // mbytes))]
                                 if args.past_l2 else [])
                for name, (cfg, pps) in variants.items():
                    if fmt != "e2m1" and cfg[0] // cfg[1] > 16:
                        continue  # FP6: 128 registers at 16 rows a warp, more rows spill
                    def fn(cfg=cfg, pps=pps, x=x, out=out, ws=copies):
                        for w_i in ws:
                            launch_decode(x, w_i, out, None, None, config=cfg, tc=True,
                                           programs_per_sm=pps)
                    out.fill_(float("nan"))
                    try:
                        fn()
                        err = ((out.float() - ref).norm() / ref.norm()).item()
                        t = graph_median_us(fn) / len(copies)
                    except Exception as exc:  # a config Triton cannot compile: say so, go on
                        record(N=n, K=k, fmt=fmt, M=m, var=name, error=str(exc)[:200])
                        continue
                    record(N=n, K=k, fmt=fmt, M=m, var=name, us=t, x_bf16=t_bf16 / t,
                           tbs=mbytes / t / 1e6, err=err)
            torch.cuda.empty_cache()
    write_sweep(args.out, rows, t0)


if __name__ == "__main__":
    main()
