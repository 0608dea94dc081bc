"""The CPU's 4-bit linears: torch's int4 kernel vs kernels/cpu_int4.py's AMX kernel, side by side
in one run.

Layers: SmolLM2-135M's four linear shapes x 30 layers (each its own weight, so the weights stream
from memory as in a forward pass), at 1 to 16 rows; ms for all 120 calls, median of --repeats
(torch's kernel past 8 rows for the curve's sake: layers take oneDNN's bf16 GEMM there).
Engine: SmolLM2-135M-Instruct in the default CPU engine, greedy, held-out chat prompts at batch 1,
no speculation and EAGLE (the shipped head, k = 3), each built once with torch's kernel and once
with AMX's (`cpu_int4.available` patched off for the former); output tok/s, the median of
--rounds interleaved passes, and whether each engine's outputs equal its own no-speculation run.

Run: python bench/cpu_int4.py [--prompts 16] [--rounds 3] [--out bench/results/cpu_int4.json]
     (~8 min on 2 cores)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lib.revision import head_commit, write_result  # noqa: E402

from mxserve import LLM, SamplingParams  # noqa: E402
from mxserve.kernels import cpu_int4  # noqa: E402
from mxserve.worker.eagle import DEFAULT_HEAD  # noqa: E402
from mxserve.worker.eagle_train import chat_prompts  # noqa: E402
from mxserve.worker.model import int4  # noqa: E402

# SmolLM2-135M's linears (N, K): fused qkv, o, fused gate/up, down
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
ROWS = [1, 2, 4, 8, 16]


@contextlib.contextmanager
def torch_kernel():
    """Weights quantized inside take torch's int4 kernel (its layout) instead of AMX's."""
    saved = cpu_int4.available
    cpu_int4.available = lambda: False
    try:
        yield
    finally:
        cpu_int4.available = saved


def layers(repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    dense = [(torch.randn(n, k, generator=g) * 0.05).bfloat16() for _ in range(30)
             for n, k in SHAPES]
    amx = [int4.quantize_int4(w) for w in dense]
    with torch_kernel():
        ref = [int4.quantize_int4(w) for w in dense]
    assert all(w.tiles is not None for w in amx) and all(w.tiles is None for w in ref)
    out = {}
    for rows in ROWS:
        xs = {k: torch.randn(rows, k, generator=g).bfloat16() for k in (576, 1536)}
        for name, weights in (("torch", ref), ("amx", amx)):
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                for w in weights:
                    int4.int4_linear(xs[w.shape[1]], w)
                times.append(time.perf_counter() - start)
            out[f"{name}_{rows}"] = round(statistics.median(times) * 1e3, 3)
        # the same products: both kernels' outputs within a bf16 step of each other
        w_t, w_a = ref[2], amx[2]
        a, b = int4.int4_linear(xs[576], w_t).float(), int4.int4_linear(xs[576], w_a).float()
        assert ((a - b).abs() <= a.abs() * 2**-6 + 1e-3).all(), rows
    return out


def generate(llm: LLM, prompts: list, params: SamplingParams) -> dict:
    start, outs = time.perf_counter(), []
    for p in prompts:
        outs += llm.chat([p], params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    return dict(tok_s=tokens / seconds, token_ids=[o.token_ids for o in outs])


def engine(prompts: int, max_tokens: int, rounds: int, threads: int) -> dict:
    chats = chat_prompts(prompts, "heldout")
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    eagle = {"method": "eagle", "num_speculative_tokens": 3, "model": DEFAULT_HEAD,
             "lookup_first": False}  # the head's chain, as when cpu_int4.md was measured
    llms = {}
    for kernel in ("torch", "amx"):
        for method, spec in (("none", None), ("eagle", eagle)):
            with torch_kernel() if kernel == "torch" else contextlib.nullcontext():
                llms[(kernel, method)] = LLM(load_progress=False, num_threads=threads,
                                             speculative_config=spec)
            generate(llms[(kernel, method)], chats[:2], params)  # warm-up
    runs = {key: [] for key in llms}
    for _ in range(rounds):
        for key, llm in llms.items():
            llm.engine.kv.reset_prefix_cache()
            runs[key].append(generate(llm, chats, params))
    for llm in llms.values():
        llm.shutdown()
    out = {}
    for (kernel, method), rs in runs.items():
        base = runs[(kernel, "none")]
        out[f"{kernel}_{method}"] = dict(
            tok_s=round(statistics.median(r["tok_s"] for r in rs), 1),
            tok_s_rounds=[round(r["tok_s"], 1) for r in rs],
            vs_none=round(statistics.median(r["tok_s"] / b["tok_s"] for r, b in zip(rs, base)), 3),
            vs_torch=round(statistics.median(
                r["tok_s"] / t["tok_s"] for r, t in zip(rs, runs[("torch", method)])), 3),
            same_output_as_none=all(r["token_ids"] == b["token_ids"] for r, b in zip(rs, base)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="bench/results/cpu_int4.json")
    args = p.parse_args()
    if not cpu_int4.available():
        sys.exit("cpu_int4: this CPU has no AMX-BF16 (or the kernel was refused it)")
    torch.set_num_threads(args.threads)
    lay = layers(args.repeats)
    eng = engine(args.prompts, args.max_tokens, args.rounds, args.threads)
    command = "python " + " ".join(sys.argv)
    result = dict(benchmark="cpu_int4", device=platform.processor() or platform.machine(),
                  cpus=os.cpu_count(), date=datetime.datetime.now(datetime.UTC).isoformat(),
                  commit=head_commit(), versions=dict(torch=torch.__version__,
                                                      python=platform.python_version()),
                  command=command, layers_ms=lay, engine=eng,
                  targets_met={"eagle_1.5x_tok_s_at_batch1":
                               eng["amx_eagle"]["vs_none"] >= 1.5})
    md = [f"# cpu_int4 ({result['device']}, {result['cpus']} cores, {result['date'][:10]}, "
          f"{result['commit']})\n", f"`{command}`\n",
          "SmolLM2-135M's linears, 30 layers x 4 shapes, ms for all 120 calls (median of "
          f"{args.repeats}):\n", "| rows | " + " | ".join(map(str, ROWS)) + " |",
          "|---" * (len(ROWS) + 1) + "|"]
    for name in ("torch", "amx"):
        md.append(f"| {name} | " + " | ".join(f"{lay[f'{name}_{r}']:.2f}" for r in ROWS) + " |")
    md += ["", f"Engine, {args.prompts} held-out chat prompts at batch 1, {args.max_tokens} "
           f"tokens, greedy; tok/s median of {args.rounds} interleaved rounds:\n",
           "| int4 kernel | method | tok/s | rounds | vs none | vs torch's kernel | "
           "same output as none |", "|---|---|---|---|---|---|---|"]
    for key, r in eng.items():
        kernel, method = key.split("_")
        md.append(f"| {kernel} | {method} | {r['tok_s']} | {r['tok_s_rounds']} | "
                  f"{r['vs_none']}x | {r['vs_torch']}x | {r['same_output_as_none']} |")
    md.append(f"\nTargets: {result['targets_met']}\n")
    write_result(args.out, result, "\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
