"""The issue's GPU kernels vs their library baselines, correctness checked inside (issue: MX
kernels). Two sections, side by side in one run each:

- linear: for each weight shape (N, K) and batch M, `torch.nn.functional.linear` on bf16 weights
  vs `mx_linear` on MXFP4 (e2m1) and MXFP6 (e2m3, e3m2) weights of the same matrix: speed-up and
  weight bandwidth. Every timed variant is first checked against its reference (||y - ref|| /
  ||ref||, with ref = x @ dequantized(w) in fp32).
- attention: paged decode attention (32 query / 8 KV heads, head dim 128, page 16, bf16) over
  shuffled pages vs SDPA on the same K/V held contiguously (the faster of its GQA and
  expanded-heads forms), at batch 64 x 4096 and 1 x 32768 tokens; max error vs fp32 SDPA, time,
  K/V bandwidth, and the ratio to SDPA.

    python bench/kernels_gpu.py --out bench/results/kernels_gpu.json            # both sections
    python bench/kernels_gpu.py --sections attention --out bench/results/kernels_gpu.attention.json
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
from mxserve.kernels.mx_layout import prepare_mx_weight
from mxserve.kernels.mx_linear import mx_linear
from mxserve.kernels.paged_attention import paged_decode_attention

SHAPES = [(14336, 4096), (4096, 14336), (28672, 8192)]  # (N, K)
L2_BYTES = 120e6  # weight copies cycled past the H200's 50 MB L2 (run_shape)
MS = [1, 2, 4, 8, 16, 32, 64, 256, 2048]
FORMATS = ["e2m1", "e2m3", "e3m2"]
BITS = {"e2m1": 4.25, "e2m3": 6.25, "e3m2": 6.25, "bf16": 16}
ATTN_SHAPES = [(64, 4096), (1, 32768)]  # (batch, tokens); targets: >= 0.9x SDPA's bandwidth at
HQ, HKV, HEAD_DIM, PAGE = 32, 8, 128, 16  # the first; the second's 1.5x is not physical (README)


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
    # each timed call reads the next of weight copies that together exceed L2 (50 MB), as a
    # model reads each weight once a step: else a weight under ~50 MB is half read from L2
    dense = [w_bf16] + [w_bf16.clone() for _ in range(int(L2_BYTES // (2 * n * k)))]
    copies = {f: [mx[f]] + [prepare_mx_weight(quantize_mx(w, f))
                            for _ in range(int(L2_BYTES // (n * k * BITS[f] / 8)))]
              for f in FORMATS}
    rows = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        ref16 = x.float() @ w_bf16.float().T
        row = {"N": n, "K": k, "M": m}
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        row["bf16_err"] = rel_err(F.linear(x, w_bf16), ref16)
        row["bf16_ms"] = bench_ms(lambda x=x, ds=dense: [F.linear(x, wb) for wb in ds]) / len(dense)
        for f in FORMATS:
            out.fill_(float("nan"))
            mx_linear(x, mx[f], out=out)
            row[f"{f}_err"] = rel_err(out, x.float() @ deq[f].T)
            row[f"{f}_ms"] = bench_ms(lambda x=x, ws=copies[f], out=out: [
                mx_linear(x, wq, out=out) for wq in ws]) / len(copies[f])
            row[f"{f}_speedup"] = row["bf16_ms"] / row[f"{f}_ms"]
        for f in ["bf16", *FORMATS]:
            row[f"{f}_weight_TBps"] = n * k * BITS[f] / 8 / (row[f"{f}_ms"] * 1e-3) / 1e12
        rows.append(row)
        print(_line(row), flush=True)
    del w, w_bf16, mx, deq, dense, copies
    torch.cuda.empty_cache()
    return rows


def attention_case(batch: int, seq_len: int, gen: torch.Generator) -> dict:
    """K/V over shuffled pages, the same K/V contiguous for SDPA (the faster of its GQA and
    expanded-heads forms, timed here), q, the fp32 reference output (also for
    bench/tune/paged_decode_tune.py)."""
    pages = batch * seq_len // PAGE
    shape = (pages + 1, PAGE, HKV, HEAD_DIM)
    k_cache = torch.randn(shape, device="cuda", generator=gen).bfloat16()
    v_cache = torch.randn(shape, device="cuda", generator=gen).bfloat16()
    tables = torch.randperm(pages, device="cuda", generator=gen).view(batch, -1).int()
    pos = torch.arange(seq_len, device="cuda")
    slots = tables[:, pos // PAGE].long(), pos % PAGE
    k4 = k_cache[slots].transpose(1, 2).contiguous()  # [B, Hkv, L, D]
    v4 = v_cache[slots].transpose(1, 2).contiguous()
    q = torch.randn(batch, HQ, HEAD_DIM, device="cuda", generator=gen).bfloat16()
    ref = F.scaled_dot_product_attention(q[:, :, None].float(), k4.float(), v4.float(),
                                         enable_gqa=True)[:, :, 0]
    ke, ve = k4.repeat_interleave(HQ // HKV, 1), v4.repeat_interleave(HQ // HKV, 1)
    sdpa_gqa = bench_ms(lambda: F.scaled_dot_product_attention(q[:, :, None], k4, v4,
                                                               enable_gqa=True))
    sdpa_expanded = bench_ms(lambda: F.scaled_dot_product_attention(q[:, :, None], ke, ve))
    lens = torch.full((batch,), seq_len, dtype=torch.int32, device="cuda")
    return dict(args=(q, k_cache, v_cache, tables, lens), ref=ref, sdpa_gqa_ms=sdpa_gqa,
                sdpa_expanded_ms=sdpa_expanded, sdpa_ms=min(sdpa_gqa, sdpa_expanded),
                kv_bytes=2 * k4.numel() * 2)


def run_attention(batch: int, seq_len: int, gen: torch.Generator) -> dict:
    case = attention_case(batch, seq_len, gen)
    args = case["args"]
    out = torch.full_like(args[0], float("nan"))
    paged_decode_attention(*args, out=out, max_seq_len=seq_len)
    row = {"batch": batch, "tokens": seq_len,
           "paged_err": (out.float() - case["ref"]).abs().max().item()}
    row["paged_ms"] = bench_ms(lambda: paged_decode_attention(*args, out=out,
                                                              max_seq_len=seq_len))
    row.update({k: case[k] for k in ("sdpa_gqa_ms", "sdpa_expanded_ms", "sdpa_ms")})
    for name in ("paged", "sdpa"):
        row[f"{name}_TBps"] = case["kv_bytes"] / (row[f"{name}_ms"] * 1e-3) / 1e12
    row["paged_vs_sdpa"] = row["sdpa_ms"] / row["paged_ms"]
    print(f"attention {batch}x{seq_len}: paged {row['paged_ms'] * 1e3:.1f}us "
          f"({row['paged_TBps']:.2f} TB/s, err {row['paged_err']:.1e}), SDPA "
          f"{row['sdpa_ms'] * 1e3:.1f}us ({row['sdpa_TBps']:.2f} TB/s): "
          f"{row['paged_vs_sdpa']:.2f}x", flush=True)
    return row  # (its tensors go with this frame; main empties the cache between shapes)


def attention_markdown(rows: list[dict]) -> str:
    text = "| batch x tokens | paged us (TB/s) | SDPA us (TB/s) | paged vs SDPA | max err |\n"
    text += "|---|---|---|---|---|\n"
    for r in rows:
        text += (f"| {r['batch']}x{r['tokens']} | {r['paged_ms'] * 1e3:.1f} "
                 f"({r['paged_TBps']:.2f}) | {r['sdpa_ms'] * 1e3:.1f} ({r['sdpa_TBps']:.2f}) | "
                 f"{r['paged_vs_sdpa']:.2f}x | {r['paged_err']:.1e} |\n")
    return text


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
    parser.add_argument("--sections", default="linear,attention")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    sections = args.sections.split(",")
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = SHAPES[:1] if args.quick else SHAPES
    rows = [r for n, k in shapes for r in run_shape(n, k, MS, gen)] \
        if "linear" in sections else []
    attention = []
    for batch, tokens in ATTN_SHAPES if "attention" in sections else []:
        attention.append(run_attention(batch, tokens, gen))
        torch.cuda.empty_cache()
    command = "python bench/kernels_gpu.py" + (
        f" --sections {args.sections}" if args.sections != "linear,attention" else "")
    result = {
        "bench": "kernels_gpu",
        "device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "triton": triton.__version__, "cuda": torch.version.cuda},
        "commit": _commit(), "command": command,
        "copy_TBps": copy_bandwidth(), "rows": rows, "attention": attention,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    text = f"On {result['device']} ({result['date']}), copy {result['copy_TBps']:.2f} TB/s\n\n"
    if rows:
        text += "MX linear vs cuBLAS bf16\n\n" + markdown(rows) + "\n"
    if attention:
        text += "Paged decode attention vs SDPA (contiguous K/V)\n\n" + \
            attention_markdown(attention)
    with open(args.out.replace(".json", ".md"), "w") as f:
        f.write(text)
    print(text)


def _commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip()
    except Exception:
        return "unknown"


if __name__ == "__main__":
    main()
