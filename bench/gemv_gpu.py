"""The few-row dense linear (kernels/gemv.py) against cuBLAS on the H200, and what it does to the
engine's decode step. One script, side by side in one run:

0. mx: MX weights (MXFP4, MXFP6 e2m3) at M = 1, mx_linear's tensor-core decode vs gemv's
   whole-row kernel (each of its program shapes), 1B and 8B decoder shapes and issue 3's
   linear shapes, with cuBLAS bf16 on each shape; each output checked against mx_linear_torch.
1. kernels: the 1B and 8B Llama decode shapes (q/k/v, o, gate/up, down, LM head) at M = 1..8
   rows: F.linear (cuBLAS) vs gemv with its default program shape and two others; every gemv
   output checked against an fp32 reference first (max error in bf16 ulps of the output).
   CUDA graphs of 2 passes over weight copies that together exceed L2, per call.
2. engine: the 1B dummy bf16 model (and MXFP4, whose LM head is bf16), decode batch 1 and 4,
   with the model's dense linears on gemv (GemvOptions: rows <= max_rows, 1 and 4; with and
   without PDL) vs all on cuBLAS (max_rows = 0), one engine each: graph replay p50 and engine
   step p50 over 128 greedy tokens, against the weight-read roofline (bytes / 4.27 TB/s).
   MXFP4 also with every MX weight on gemv at one row (mx_max_elements lifted).

    python bench/gemv_gpu.py --out DIR     (DIR/gemv_gpu.json, DIR/gemv_gpu.md)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(REPO))
sys.path.insert(0, os.path.join(REPO, "bench", "lib"))

from engine_gpu_common import step_bytes  # noqa: E402
from gpu_timing import drain, graph_us, header, replay_ms  # noqa: E402
from revision import head_commit  # noqa: E402

from mxserve import LLM, SamplingParams  # noqa: E402
from mxserve.kernels import gemv as gemv_mod  # noqa: E402
from mxserve.kernels.options import GemvOptions  # noqa: E402

SHAPES = {"1b": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048),
                 "down": (2048, 8192), "lm_head": (128256, 2048)},
          "8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                 "down": (4096, 14336), "lm_head": (128256, 4096)}}
MS = [1, 2, 3, 4, 6, 8]
COPY_TBS = 4.27


def _configs(k: int, tile: int = gemv_mod.TILE) -> dict[str, tuple[int, ...] | None]:
    bk = 1 << (k - 1).bit_length()
    bn = max(1, tile // bk)
    alt = {"default": None, "rows_x2": (2 * bn, 4 if 2 * bn * bk <= 16384 else 8),
           "8_warps": (bn, 8), "one_row_a_pass": (bn, 4 if bn * bk <= tile else 8, 1)}
    if bn > 1:
        alt["rows_half"] = (bn // 2, 4)
    return alt


def kernel_section(models=tuple(SHAPES), ms=MS) -> list[dict]:
    rows = []
    for model in models:
        shapes = SHAPES[model]
        for name, (n, k) in shapes.items():
            copies = max(2, min(8, int(240e6 // (n * k * 2)) + 1))  # > 2x L2 in all
            gen = torch.Generator(device="cuda").manual_seed(n + k)
            ws = [torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
                  for _ in range(copies)]
            for m in ms:
                x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
                ref = x.float() @ ws[0].float().T
                row = {"model": model, "layer": name, "n": n, "k": k, "m": m,
                       "cublas_us": graph_us([lambda w=w, x=x: F.linear(x, w) for w in ws * 2])}
                for cname, cfg in _configs(k).items():
                    y = gemv_mod.gemv(x, ws[0], config=cfg).float()
                    ulps = ((y - ref).abs() / (ref.abs() * 2.0**-8 + 1e-6)).max().item()
                    us = graph_us([lambda w=w, x=x, c=cfg: gemv_mod.gemv(x, w, config=c)
                                   for w in ws * 2])
                    row[cname] = {"us": us, "max_err_ulps": round(ulps, 2),
                                  "x_cublas": round(row["cublas_us"] / us, 3)}
                rows.append(row)
                print(json.dumps({k2: (v["x_cublas"] if isinstance(v, dict) else v)
                                  for k2, v in row.items()}), flush=True)
            del ws
            torch.cuda.empty_cache()
    return rows


def fused_section(ms=MS) -> list[dict]:
    """The fused decode projections of the 1B shape (add + RMSNorm + q/k/v + RoPE + KV write;
    add + RMSNorm + gate/up + SiLU-and-mul) at M rows, per program shape of _configs (dense),
    us a call, weights cycled past L2; cuBLAS's F.linear of the same weight alone (no norm, no
    epilogue: what the unfused path's GEMM costs) beside it."""
    from mxserve.kernels.gemv import KVWrite, Norm, Rope, decode_projection

    rows = []
    heads, kv_heads, d, hidden = 32, 8, 64, 2048
    gen = torch.Generator(device="cuda").manual_seed(7)
    angles = torch.outer(torch.arange(4096.0, device="cuda"),
                         1.0 / 10000 ** (torch.arange(0, d, 2, device="cuda") / d))
    cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
    caches = [torch.zeros(256, 16, kv_heads, d, device="cuda", dtype=torch.bfloat16)
              for _ in range(2)]
    norm_w = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
    for name, n in (("qkv_rope_kv", (heads + 2 * kv_heads) * d), ("gate_up_silu", 16384)):
        copies = max(2, min(8, int(240e6 // (n * hidden * 2)) + 1))
        ws = [torch.randn(n, hidden, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
              for _ in range(copies)]
        for m in ms:
            x = torch.randn(m, hidden, device="cuda", generator=gen, dtype=torch.bfloat16)
            res = torch.randn(m, hidden, device="cuda", generator=gen, dtype=torch.bfloat16)
            norm = Norm(res, norm_w, 1e-5)
            if name == "qkv_rope_kv":
                steps = dict(rope=Rope(torch.arange(m, device="cuda") + 100, cos, sin, heads,
                                       kv_heads, d),
                             kv=KVWrite(*caches, torch.arange(m, device="cuda") + 200))
            else:
                steps = dict(silu_and_mul=True)
            ref, _ = decode_projection(x, ws[0], norm=norm, backend="torch", **steps)
            row = {"layer": name, "n": n, "k": hidden, "m": m,
                   "cublas_linear_us": graph_us([lambda w=w, x=x: F.linear(x, w)
                                                 for w in ws * 2])}
            for cname, cfg in _configs(hidden).items():
                y, _ = decode_projection(x, ws[0], norm=norm, config=cfg, **steps)
                err = ((y.float() - ref.float()).abs() / (ref.float().abs() + 1e-2)).max()
                us = graph_us([lambda w=w, x=x, c=cfg, nm=norm, st=steps: decode_projection(
                    x, w, norm=nm, config=c, **st) for w in ws * 2])
                row[cname] = {"us": us, "max_rel_err": round(err.item(), 4)}
            rows.append(row)
            print(json.dumps({k2: (v["us"] if isinstance(v, dict) else v)
                              for k2, v in row.items()}), flush=True)
        del ws
    return rows


ISSUE3_SHAPES = {"up": (14336, 4096), "down": (4096, 14336), "gate_up": (28672, 8192)}


def mx_section() -> list[dict]:
    """MX weights at one row: mx_linear (its tensor-core decode) vs gemv's whole-row kernel (its
    default program shape and the others of _configs), on the 1B and 8B decoder shapes and
    issue 3's linear shapes, MXFP4 and MXFP6 (e2m3), with cuBLAS bf16 on the same shape; each
    output checked against mx_linear_torch."""
    from mxserve.kernels.mx import quantize_mx
    from mxserve.kernels.mx_layout import prepare_mx_weight
    from mxserve.kernels.mx_linear import mx_linear, mx_linear_torch

    rows = []
    shapes = [(m, name, nk) for m, by in SHAPES.items() for name, nk in by.items()
              if name != "lm_head"]  # (bf16 in MX checkpoints)
    shapes += [("issue3", name, nk) for name, nk in ISSUE3_SHAPES.items()]
    for model, name, (n, k) in shapes:
        gen = torch.Generator(device="cuda").manual_seed(n + k)
        x = torch.randn(1, k, device="cuda", generator=gen, dtype=torch.bfloat16)
        copies = max(2, min(8, int(240e6 // (n * k * 2)) + 1))
        dense = [torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
                 for _ in range(copies)]
        bf16_us = graph_us([lambda w=w, x=x: F.linear(x, w) for w in dense * 2])
        del dense
        for fmt in ("e2m1", "e2m3"):
            copies = max(2, min(8, int(240e6 // (n * k * 0.55)) + 1))
            ws = [prepare_mx_weight(quantize_mx(torch.randn(n, k, device="cuda",
                                                            generator=gen) * 0.02, fmt))
                  for _ in range(copies)]
            ref = mx_linear_torch(x, ws[0]).float()
            row = {"model": model, "layer": name, "n": n, "k": k, "fmt": fmt,
                   "bf16_us": round(bf16_us, 2)}
            fns = {"mx_linear": mx_linear}
            for label, cfg in _configs(k, gemv_mod.MX_TILE).items():
                fns["gemv" if label == "default" else "gemv_" + label] = \
                    lambda x, w, cfg=cfg: gemv_mod.gemv(x, w, config=cfg)
            for label, fn in fns.items():
                y = fn(x, ws[0]).float()
                row[label + "_err"] = round(((y - ref).norm() / ref.norm()).item(), 6)
                row[label + "_us"] = round(graph_us([lambda w=w, f=fn, x=x: f(x, w)
                                                     for w in ws * 2]), 2)
            best = min((v, key[:-3]) for key, v in row.items()
                       if key.startswith("gemv") and key.endswith("_us"))
            row["gemv_best"] = best[1]
            row["gemv_x_mx_linear"] = round(row["mx_linear_us"] / row["gemv_us"], 3)
            row["mx_linear_x_bf16"] = round(bf16_us / row["mx_linear_us"], 3)
            row["gemv_x_bf16"] = round(bf16_us / row["gemv_us"], 3)
            row["best_x_bf16"] = round(bf16_us / min(best[0], row["mx_linear_us"]), 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
            del ws
    return rows


def engine_section(quantization: str | None, batches=(1, 4)) -> list[dict]:
    default = GemvOptions()
    variants = {"cublas": GemvOptions(max_rows=0), "gemv": GemvOptions(pdl=False),
                "gemv_pdl": default, "gemv_pdl_2_rows": GemvOptions(max_rows=2),
                "gemv_pdl_4_rows": GemvOptions(max_rows=4)}
    if quantization:  # every MX weight on gemv at one row, whatever its size
        variants["gemv_pdl_mx_all"] = GemvOptions(mx_max_elements=1 << 62)
    greedy = SamplingParams(temperature=0, ignore_eos=True, max_tokens=128)
    rows, tokens_by = [], {}
    for label, options in variants.items():  # one engine a variant: options are frozen
        llm = LLM(model="llama-3.2-1b", load_format="dummy", dtype="bfloat16",
                  load_progress=False, max_num_seqs=8, kv_cache_memory_gb=2.0,
                  max_model_len=4096, quantization=quantization, gemv=options)
        engine, runner = llm.engine, llm.engine.runner
        roofline_ms = step_bytes(llm, 4.25 if quantization else 16) / (COPY_TBS * 1e12) * 1e3
        for batch in batches:
            out = {"quantization": quantization or "bf16", "batch": batch, "linears": label,
                   "roofline_ms": round(roofline_ms, 4)}
            for rep in range(2):  # warm-up, then measured (distinct prompts: no prefix hits)
                for b in range(batch):
                    engine.add_request([(1000 + 7 * b + 131 * rep + i) % 128000
                                        for i in range(128)], greedy)
                times, tokens = drain(engine)
                out["engine_step_ms_p50"] = round(statistics.median(times[3:]), 4)
            tokens_by[label, batch] = tokens
            graph = runner.graphs.graphs[runner.graphs.last_size].graph  # the last step's
            out["graph_replay_ms_p50"] = replay_ms(graph, 200)
            out["step_x_roofline"] = round(out["engine_step_ms_p50"] / roofline_ms, 3)
            rows.append(out)
            print(json.dumps(out), flush=True)
        del llm, engine, runner
        torch.cuda.empty_cache()
    rows.sort(key=lambda r: (r["batch"], list(variants).index(r["linears"])))
    for batch in batches:
        last = [r for r in rows if r["batch"] == batch][-1]
        last["greedy_tokens_equal_cublas"] = tokens_by["gemv", batch] == tokens_by["cublas", batch]
        last["greedy_tokens_equal_without_pdl"] = \
            tokens_by["gemv_pdl", batch] == tokens_by["gemv", batch]
        last["greedy_tokens_equal_2_rows"] = \
            tokens_by["gemv_pdl_2_rows", batch] == tokens_by["cublas", batch]
        last["greedy_tokens_equal_4_rows"] = \
            tokens_by["gemv_pdl_4_rows", batch] == tokens_by["cublas", batch]
        if quantization:
            last["greedy_tokens_equal_mx_rule"] = \
                tokens_by["gemv_pdl_mx_all", batch] == tokens_by["gemv_pdl", batch]
    return rows


def markdown(res: dict) -> str:
    lines = [f"# gemv_gpu ({res['device']}, {res['date']}, commit {res.get('commit', '?')})",
             "", f"`{res['command']}`", "",
             "Few-row dense linear (kernels/gemv.py, default program shape) vs cuBLAS "
             "(F.linear), us per call, CUDA graphs, weights cycled past L2:", "",
             "| model | layer | N x K | " + " | ".join(f"M={m}" for m in res["ms"]) + " |",
             "|---|---|---|" + "---|" * len(res["ms"])]
    by = {}
    for r in res.get("kernels", []):
        by.setdefault((r["model"], r["layer"], r["n"], r["k"]), {})[r["m"]] = r
    for (model, layer, n, k), ms in by.items():
        cells = [f"{ms[m]['default']['us']:.1f} vs {ms[m]['cublas_us']:.1f} "
                 f"({ms[m]['default']['x_cublas']:.2f}x)" for m in res["ms"]]
        lines.append(f"| {model} | {layer} | {n}x{k} | " + " | ".join(cells) + " |")
    if res.get("mx"):
        lines += ["", "MX weights at M = 1: mx_linear (tensor-core decode) vs gemv (whole row, "
                  "default shape; best of its shapes), us, and cuBLAS bf16 on the same shape:",
                  "", "| model | layer | N x K | format | bf16 | mx_linear (x bf16) | gemv "
                  "(x bf16) | gemv best | gemv vs mx_linear |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in res["mx"]:
            lines.append(f"| {r['model']} | {r['layer']} | {r['n']}x{r['k']} | {r['fmt']} | "
                         f"{r['bf16_us']} | {r['mx_linear_us']} ({r['mx_linear_x_bf16']}x) | "
                         f"{r['gemv_us']} ({r['gemv_x_bf16']}x) | {r['gemv_best']} "
                         f"{r[r['gemv_best'] + '_us']} | {r['gemv_x_mx_linear']}x |")
    lines += ["", "Engine decode step, 1B dummy model (ms, p50), linears on cuBLAS vs gemv:", "",
              "| weights | batch | linears | graph replay | engine step | x roofline |",
              "|---|---|---|---|---|---|"]
    for r in res.get("engine", []):
        lines.append(f"| {r['quantization']} | {r['batch']} | {r['linears']} | "
                     f"{r['graph_replay_ms_p50']} | {r['engine_step_ms_p50']} | "
                     f"{r['step_x_roofline']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--sections", default="kernels,mx,engine")
    p.add_argument("--batches", default="1,4", help="engine section: decode batch sizes")
    p.add_argument("--models", default="1b,8b", help="kernels section: decoder shapes")
    p.add_argument("--ms", default=",".join(map(str, MS)), help="kernels section: rows of x")
    p.add_argument("--weights", default="bf16,mxfp4", help="engine section: bf16 and/or mxfp4")
    args = p.parse_args()
    res = header("gemv_gpu")
    res["command"] = "python bench/gemv_gpu.py " + " ".join(sys.argv[1:])
    res["commit"] = head_commit()
    res["max_rows"] = GemvOptions().max_rows
    res["ms"] = [int(m) for m in args.ms.split(",")]
    if "kernels" in args.sections:
        res["kernels"] = kernel_section(tuple(args.models.split(",")), res["ms"])
    if "fused" in args.sections:
        res["fused"] = fused_section(res["ms"])
    if "mx" in args.sections:
        res["mx"] = mx_section()
    if "engine" in args.sections:
        batches = tuple(int(b) for b in args.batches.split(","))
        res["engine"] = [r for q in args.weights.split(",")
                         for r in engine_section(None if q == "bf16" else q, batches)]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gemv_gpu.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(args.out, "gemv_gpu.md"), "w") as f:
        f.write(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
