"""MX weight-only linear on the GPU vs cuBLAS bf16, correctness checked inside (issue: MX kernels).

For each weight shape (N, K) and batch M, times `torch.nn.functional.linear` on bf16 weights and
`mx_linear` on MXFP4 (e2m1) and MXFP6 (e2m3, e3m2) weights of the same matrix, side by side in one
run, and reports the speed-up and the weight bandwidth each reaches. Every timed variant is first
checked against its reference (||y - ref|| / ||ref||, with ref = x @ dequantized(w) in fp32).

    python bench/kernels_gpu.py --out bench/results/kernels_gpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess

import torch
import torch.nn.functional as F
import triton
import triton.testing

from mxserve.kernels.mx import dequantize_mx, quantize_mx
from mxserve.kernels.mx_linear import mx_linear, prepare_mx_weight

SHAPES = [(14336, 4096), (4096, 14336), (28672, 8192)]  # (N, K)
MS = [1, 2, 4, 8, 16, 64, 256, 2048]
FORMATS = ["e2m1", "e2m3", "e3m2"]
BITS = {"e2m1": 4.25, "e2m3": 6.25, "e3m2": 6.25, "bf16": 16}


def bench_ms(fn) -> float:
    """Median of CUDA-graph replays (launch gaps removed), in ms."""
    return triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median")


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()


def run_shape(n: int, k: int, ms: list[int], gen: torch.Generator) -> list[dict]:
    w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.float32) * 0.02
    w_bf16 = w.to(torch.bfloat16)
    mx = {f: prepare_mx_weight(quantize_mx(w, f)) for f in FORMATS}
    deq = {f: dequantize_mx(quantize_mx(w, f), torch.float32) for f in FORMATS}
    rows = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        ref16 = x.float() @ w_bf16.float().T
        row = {"N": n, "K": k, "M": m}
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        row["bf16_err"] = rel_err(F.linear(x, w_bf16), ref16)
        row["bf16_ms"] = bench_ms(lambda x=x, wb=w_bf16: F.linear(x, wb))
        for f in FORMATS:
            out.fill_(float("nan"))
            mx_linear(x, mx[f], out=out)
            row[f"{f}_err"] = rel_err(out, x.float() @ deq[f].T)
            row[f"{f}_ms"] = bench_ms(lambda x=x, wq=mx[f], out=out: mx_linear(x, wq, out=out))
            row[f"{f}_speedup"] = row["bf16_ms"] / row[f"{f}_ms"]
        for f in ["bf16", *FORMATS]:
            row[f"{f}_weight_TBps"] = n * k * BITS[f] / 8 / (row[f"{f}_ms"] * 1e-3) / 1e12
        rows.append(row)
        print(_line(row), flush=True)
    del w, w_bf16, mx, deq
    torch.cuda.empty_cache()
    return rows


def _line(r: dict) -> str:
    cells = [f"{r['N']:>5}x{r['K']:<5} M={r['M']:<4} bf16 {r['bf16_ms'] * 1e3:8.1f}us"]
    for f in FORMATS:
        cells.append(f"{f} {r[f + '_ms'] * 1e3:8.1f}us x{r[f + '_speedup']:.2f} "
                     f"err {r[f + '_err']:.1e}")
    return " | ".join(cells)


def copy_bandwidth() -> float:
    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), return_mode="median")
    return 2 * a.numel() / (ms * 1e-3) / 1e12


def markdown(rows: list[dict]) -> str:
    head = "| N x K | M | bf16 us | MXFP4 us (x) | MXFP6 e2m3 us (x) | MXFP6 e3m2 us (x) |\n"
    head += "|---|---|---|---|---|---|\n"
    for r in rows:
        cells = [f"{r['N']}x{r['K']}", str(r["M"]), f"{r['bf16_ms'] * 1e3:.1f}"]
        cells += [f"{r[f + '_ms'] * 1e3:.1f} ({r[f + '_speedup']:.2f}x)" for f in FORMATS]
        head += "| " + " | ".join(cells) + " |\n"
    return head


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/results/kernels_gpu.json")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = SHAPES[:1] if args.quick else SHAPES
    rows = [r for n, k in shapes for r in run_shape(n, k, MS, gen)]
    result = {
        "bench": "kernels_gpu/mx_linear",
        "device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "triton": triton.__version__, "cuda": torch.version.cuda},
        "commit": _commit(), "command": "python bench/kernels_gpu.py",
        "copy_TBps": copy_bandwidth(), "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    with open(args.out.replace(".json", ".md"), "w") as f:
        f.write(f"MX linear vs cuBLAS bf16 on {result['device']} ({result['date']}), "
                f"copy {result['copy_TBps']:.2f} TB/s\n\n" + markdown(rows))
    print(markdown(rows))


def _commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip()
    except Exception:
        return "unknown"


if __name__ == "__main__":
    main()
