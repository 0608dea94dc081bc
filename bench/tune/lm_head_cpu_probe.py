"""Probe: the CPU LM head kernel (kernels/cpu_linear.py) before and after its weight prefetch
and 32-channel tasks at up to 4 rows, side by side in one process on SmolLM2-135M (bf16, the
default CPU engine, 2 threads): (1) the head alone, repeated, and right after a forward pass of
the model over the same rows (as every step calls it), M = 1..8 rows; (2) the engine end to end,
greedy chat prompts at batch 1, without speculation and with EAGLE (k = 3), the kernels swapped
per pass, interleaved.

Run: python bench/tune/lm_head_cpu_probe.py OLD_CPU_LINEAR.py --out DIR   (~6 min, 2 cores)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

import torch

from mxserve import LLM, SamplingParams
from mxserve.kernels import cpu_build, cpu_linear
from mxserve.worker.attention import AttentionBatch
from mxserve.worker.eagle_train import chat_prompts


def old_library(path: str):
    spec = importlib.util.spec_from_file_location("cpu_linear_old", path)
    mod = importlib.util.module_from_spec(spec)
    src = open(path).read().split('_SOURCE = r"""')[1].split('"""')[0]
    lib = cpu_build.build("cpu_linear_old", src)
    lib.linear_f32.argtypes = cpu_linear._library().linear_f32.argtypes
    lib.linear_f32.restype = None
    del mod
    return lib


def use(lib) -> None:
    cpu_linear._library = lambda: lib


@torch.inference_mode()
def head_times(llm, libs: dict, rows: list[int], reps: int) -> dict:
    model, runner = llm.engine.runner.model, llm.engine.runner
    assert llm.engine.kv.reset_prefix_cache()
    ctx, bs = 300, llm.engine.kv.block_size
    table = list(range(-(-(ctx + 16) // bs)))
    meta = runner.attn.build_metadata(AttentionBatch(
        query_lens=[ctx], start_positions=[0], block_tables=[table], num_decodes=0,
        block_size=bs, device=runner.device))
    model(torch.randint(100, 1000, (ctx,)), torch.arange(ctx), runner.kv_caches, runner.attn,
          meta)
    out = {}
    for m in rows:
        meta1 = runner.attn.build_metadata(AttentionBatch(
            query_lens=[m], start_positions=[ctx], block_tables=[table],
            num_decodes=1 if m == 1 else 0, block_size=bs, device=runner.device,
            query_rows=None if m == 1 else [True]))
        for name, lib in libs.items():
            use(lib)
            after, alone = [], []
            for _ in range(reps):
                hidden = model(torch.randint(100, 1000, (m,)), torch.arange(ctx, ctx + m),
                               runner.kv_caches, runner.attn, meta1)
                t0 = time.perf_counter()
                model.compute_logits(hidden)
                after.append(time.perf_counter() - t0)
            for _ in range(reps):
                t0 = time.perf_counter()
                model.compute_logits(hidden)
                alone.append(time.perf_counter() - t0)
            out[f"m{m}_{name}"] = {"after_forward_ms": round(statistics.median(after) * 1e3, 3),
                                   "repeated_ms": round(statistics.median(alone) * 1e3, 3)}
            print(m, name, out[f"m{m}_{name}"], flush=True)
    return out


def engine_rounds(libs: dict, prompts, params, rounds: int) -> dict:
    llms = {m: LLM(load_progress=False, num_threads=2, speculative_config=spec)
            for m, spec in (("none", None),
                            ("eagle", {"method": "eagle", "num_speculative_tokens": 3}))}
    for llm in llms.values():
        llm.chat(prompts[:1], params)
    res: dict = {}
    for _ in range(rounds):
        for name, lib in libs.items():
            use(lib)
            for method, llm in llms.items():
                llm.engine.kv.reset_prefix_cache()
                t0, n = time.perf_counter(), 0
                for p in prompts:
                    n += len(llm.chat([p], params)[0].token_ids)
                res.setdefault(f"{method}_{name}", []).append(
                    round(n / (time.perf_counter() - t0), 2))
                print(method, name, res[f"{method}_{name}"][-1], flush=True)
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("old")
    p.add_argument("--out", required=True)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(2)
    libs = {"before": old_library(args.old), "after": cpu_linear._library()}
    llm = LLM(load_progress=False, num_threads=2)
    result = {"command": "python bench/tune/lm_head_cpu_probe.py " + " ".join(sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d"), "machine": "x86_64, 2 cores",
              "torch": torch.__version__,
              "head": head_times(llm, libs, [1, 2, 4, 5, 8], args.reps)}
    del llm
    prompts = chat_prompts(8, "heldout")
    tok = engine_rounds(libs, prompts, SamplingParams(temperature=0, max_tokens=128),
                        args.rounds)
    result["engine_tok_s"] = tok
    med = {k: statistics.median(v) for k, v in tok.items()}
    result["engine_tok_s_median"] = med
    result["after_over_before"] = {m: round(med[f"{m}_after"] / med[f"{m}_before"], 3)
                                   for m in ("none", "eagle")}
    result["eagle_over_none"] = {n: round(med[f"eagle_{n}"] / med[f"none_{n}"], 3)
                                 for n in ("before", "after")}
    print(json.dumps(result["after_over_before"]), json.dumps(result["eagle_over_none"]))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "lm_head_cpu.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
