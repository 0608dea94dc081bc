"""Probe (H200): kernels/decode_gemv.py against cuBLAS on the 1B model's decode linears.

Per shape (q/k/v 3072x2048, o 2048x2048, gate/up 16384x2048, down 2048x8192), in CUDA graphs of
16 calls cycling over 8 weight copies (more than L2 together), per call:
- cublas: F.linear alone; step: what the model runs today before it (the fused add + RMSNorm
  kernel for q/k/v and gate/up, SiLU-and-mul for down) and F.linear;
- triton configs (BLOCK_N, BLOCK_K, warps, stages) with no prologue, then the best three with
  the prologue the model would fold in, at M = 1 and 8.
Every output is checked against the torch reference.

    python bench/decode_gemv_probe.py --out DIR     (DIR/decode_gemv_probe.json)
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(REPO))

from mxserve.kernels import layer_ops  # noqa: E402
from mxserve.kernels.decode_gemv import decode_gemv, decode_gemv_torch  # noqa: E402

SHAPES = {"qkv": (3072, 2048, "rms_norm"), "o": (2048, 2048, "none"),
          "gate_up": (16384, 2048, "rms_norm"), "down": (2048, 8192, "silu_and_mul")}
CONFIGS = [(bn, bk, 4, st) for bn, bk, st in itertools.product((16, 32, 64), (128, 256), (2, 3, 4))]
CONFIGS += [(64, 128, 8, 3), (64, 256, 8, 3), (128, 128, 8, 3), (32, 512, 4, 2)]


def graph_us(fns, reps: int = 30) -> float:
    """Per-call device time of the calls fns (one CUDA graph of them all; median)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(fns))
    return round(statistics.median(times), 2)


def inputs(n: int, k: int, prologue: str, m: int):
    gen = torch.Generator(device="cuda").manual_seed(n + k + m)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
          for _ in range(8)]
    width = 2 * k if prologue == "silu_and_mul" else k
    x = torch.randn(m, width, device="cuda", dtype=torch.bfloat16, generator=gen)
    opts = {}
    if prologue == "rms_norm":
        opts = dict(residual=torch.randn(m, k, device="cuda", dtype=torch.bfloat16,
                                         generator=gen),
                    norm_weight=torch.ones(k, device="cuda", dtype=torch.bfloat16), eps=1e-5)
    return ws, x, opts


def today(x, w, prologue, opts):
    """The model's current path: the layer kernel, then cuBLAS."""
    if prologue == "rms_norm":
        x = layer_ops.add_rms_norm_(x, opts["residual"].clone(), opts["norm_weight"],
                                    opts["eps"])
    elif prologue == "silu_and_mul":
        x = layer_ops.silu_and_mul(x)
    return F.linear(x, w)


def check(out, ref) -> float:
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < 1e-2, err
    return err


def probe_shape(name: str, n: int, k: int, prologue: str) -> dict:
    res = {"n": n, "k": k, "prologue": prologue, "configs": []}
    ws, x1, _ = inputs(n, k, "none", 1)
    res["cublas_m1_us"] = graph_us([lambda w=w: F.linear(x1, w) for w in ws * 2])
    for cfg in CONFIGS:
        out, _ = decode_gemv(x1, ws[0], config=cfg)
        err = check(out, F.linear(x1, ws[0]))
        us = graph_us([lambda w=w, c=cfg: decode_gemv(x1, w, config=c) for w in ws * 2])
        res["configs"].append({"config": cfg, "m1_us": us, "rel_err": round(err, 5)})
    best = sorted(res["configs"], key=lambda r: r["m1_us"])[:3]
    res["fused"] = []
    for m in (1, 8):
        ws, x, opts = inputs(n, k, prologue, m)
        res[f"today_m{m}_us"] = graph_us([lambda w=w, x=x, o=opts: today(x, w, prologue, o)
                                          for w in ws * 2])
        res[f"cublas_m{m}_only_us"] = graph_us([lambda w=w, x=x: F.linear(x[:, :k], w)
                                                for w in ws * 2])
        for r in best:
            cfg = tuple(r["config"])
            out, new_res = decode_gemv(x, ws[0], prologue=prologue, config=cfg, **opts)
            ref, ref_res = decode_gemv_torch(x, ws[0], prologue=prologue, **opts)
            err = check(out, ref)
            if ref_res is not None:
                assert torch.equal(new_res, ref_res)
            us = graph_us([lambda w=w, c=cfg, x=x, o=opts: decode_gemv(
                x, w, prologue=prologue, config=c, **o) for w in ws * 2])
            res["fused"].append({"m": m, "config": cfg, "us": us, "rel_err": round(err, 5)})
    print(name, json.dumps({key: v for key, v in res.items() if key != "configs"}), flush=True)
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    args = p.parse_args()
    res = {"bench": "decode_gemv_probe", "device": torch.cuda.get_device_name(),
           "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "versions": {"torch": torch.__version__, "python": sys.version.split()[0]},
           "command": "python bench/decode_gemv_probe.py --out $OUT", "shapes": {}}
    for name, (n, k, prologue) in SHAPES.items():
        res["shapes"][name] = probe_shape(name, n, k, prologue)
        with open(os.path.join(args.out, "decode_gemv_probe.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
