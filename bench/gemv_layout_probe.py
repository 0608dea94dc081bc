"""cuBLAS bf16 at one row (decode GEMV) on the GPU: the weight bandwidth of the Llama-3.2-1B and
Llama-3-8B linear shapes, for W [N, K] (F.linear, what the engine runs), W^T stored [K, N]
(x @ Wt), torch.mv and torch.mm. Each variant is checked against an fp32 product first. Shows how
far the small 1B shapes sit below the copy bandwidth (issue 6's batch-1 step vs its roofline).

    python bench/gemv_layout_probe.py --out bench/results/gemv_layout_probe.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform

import torch
import triton
import triton.testing

SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192),  # 1B: qkv, o, gate_up, down
          (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # 8B


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/results/gemv_layout_probe.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for n, k in SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        wt, x = w.t().contiguous(), torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ w.float().t()
        variants = {"F.linear": lambda x=x, w=w: torch.nn.functional.linear(x, w),
                    "x@Wt": lambda x=x, wt=wt: x @ wt,
                    "mv": lambda x=x, w=w: torch.mv(w, x[0]),
                    "mm": lambda x=x, w=w: torch.mm(x, w.t())}
        row = {"N": n, "K": k}
        for name, fn in variants.items():
            err = ((fn().float().reshape(1, -1) - ref).norm() / ref.norm()).item()
            assert err < 1e-2, (name, n, k, err)
            ms = triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
            row[name] = {"us": round(ms * 1e3, 2), "TBps": round(n * k * 2 / ms / 1e9, 2),
                         "err": err}
        rows.append(row)
    result = {"bench": "gemv_layout_probe", "device": torch.cuda.get_device_name(),
              "date": datetime.date.today().isoformat(),
              "versions": {"python": platform.python_version(), "torch": torch.__version__,
                           "triton": triton.__version__, "cuda": torch.version.cuda},
              "command": "python bench/gemv_layout_probe.py", "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    names = ["F.linear", "x@Wt", "mv", "mm"]
    text = f"bf16 GEMV (M = 1) on {result['device']} ({result['date']}): us (TB/s)\n\n"
    text += "| N x K | " + " | ".join(names) + " |\n|---|" + "---|" * len(names) + "\n"
    for r in rows:
        text += f"| {r['N']}x{r['K']} | " + " | ".join(
            f"{r[v]['us']} ({r[v]['TBps']})" for v in names) + " |\n"
    with open(args.out.replace(".json", ".md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
