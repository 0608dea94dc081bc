"""Speculative decoding on CPU: SmolLM2-135M-Instruct in the default CPU engine (bf16, the
GGUF's 4-bit linears), greedy, no speculation vs ngram vs EAGLE side by side in one run. EAGLE
runs the shipped head (or --head): as configured by default (`eagle`: `lookup_first`, below,
and chains); its own chain (`eagle-chain`: no lookup, no tree, a chain ending before a draft
the head is less than min_draft_confidence sure of), with a fixed k (`eagle-fixed-k`: no
confidence floor, the chain's acceptance at k), over the whole vocabulary; with `lookup_first`
(requests whose latest n-gram occurred before draft by prompt lookup, the rest with the head);
and static trees of depth 3 (`tree`: 7, 12 and 15 nodes, with the floor and without it
("-full": every node drafted), with lookup or without).

Workloads (held out from the head's training: worker/eagle_train.py's "heldout" split, New
Testament verses and other questions): chat prompts, and KJV passages to continue. Each runs at
batch 1 (one request at a time) and batch 8 (8 at once). Reported per method: output tok/s
(output tokens / wall time, after a warm-up; the median of `--rounds` passes, the methods
interleaved within each), the speed-up over no speculation (the median of the passes'
ratios), the acceptance length (tokens a verify step yields: 1 + accepted drafts / verify
steps with drafts), drafts a verify, the acceptance rate, tokens a target step (all steps:
output tokens / (output tokens - accepted drafts)), and whether every output equals no
speculation's (greedy: at batch 1 it must; batch 8 runs batch-dependent bf16 GEMMs).

Targets (issue 23), chat prompts at batch 1: acceptance length >= 2.2 at k = 3 (EAGLE as
configured by default; the head's chain alone, eagle-fixed-k; and depth-3 trees, whose depth
is k); EAGLE >= 1.5x the tok/s of no speculation (as configured by default; and the best EAGLE
configuration).

Run: python bench/spec_decode.py [--prompts 16] [--max-tokens 128] [--k 3] [--rounds 3]
     [--methods all | a,b,...] [--workloads chat,kjv] [--batches 1,8]
     [--out bench/results/spec_decode.json]   (~25 min on 2 cores with the default methods)
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lib.revision import head_commit, write_result  # noqa: E402

from mxserve import LLM, SamplingParams  # noqa: E402
from mxserve.worker.eagle import DEFAULT_HEAD  # noqa: E402
from mxserve.worker.eagle_train import chat_prompts, passage_prompts  # noqa: E402

# Static draft trees of depth 3 (rank paths, worker/draft_tree.py): the 7, 12 and 15 rank paths
# most often on the target's path, teacher-forced on 48 chat prompts of the head's training split
# (the method of spec_tree_probe.md; bench/results/spec_decode.md)
TREE = [[0], [0, 0], [0, 0, 0], [0, 1], [1], [1, 0], [2]]
TREE12 = TREE[:4] + [[0, 0, 1], [0, 1, 0], [1, 0, 0], [2, 0], [3]] + TREE[4:]
TREE15 = TREE12 + [[0, 2], [0, 2, 0], [4]]
DEFAULT_METHODS = ("ngram", "eagle", "eagle-chain", "eagle-fixed-k", "eagle-tree12-full",
                   "eagle-lookup-tree", "eagle-lookup-tree12")


def run(llm: LLM, prompts: list, batch: int, params: SamplingParams) -> dict:
    """Generate for the prompts `batch` at a time; outputs, seconds, speculation totals."""
    outs, start = [], time.perf_counter()
    for i in range(0, len(prompts), batch):
        group = prompts[i:i + batch]
        outs += llm.chat(group, params) if isinstance(group[0], list) else \
            llm.generate(group, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    drafts = sum(o.num_drafts for o in outs)
    accepted = sum(o.num_accepted_tokens for o in outs)
    drafted = sum(o.num_draft_tokens for o in outs)
    # every target step yields one token plus the drafts it accepts: steps = tokens - accepted
    return dict(token_ids=[o.token_ids for o in outs], seconds=seconds, tokens=tokens,
                tok_s=tokens / seconds,
                acceptance_length=(1 + accepted / drafts) if drafts else None,
                acceptance_rate=accepted / drafted if drafted else None,
                tokens_per_step=tokens / (tokens - accepted),
                drafts_per_verify=drafted / drafts if drafts else None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=16, help="prompts per workload")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--head", default=None, help="EAGLE head directory (default: the shipped)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3, help="interleaved passes (medians)")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help="comma-separated subset of the methods (none always runs)")
    p.add_argument("--workloads", default="chat,kjv", help="comma-separated: chat, kjv")
    p.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    p.add_argument("--out", default="bench/results/spec_decode.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    make = {"chat": chat_prompts, "kjv": passage_prompts}
    workloads = {w: make[w](args.prompts, "heldout") for w in args.workloads.split(",")}
    batches = [int(b) for b in args.batches.split(",")]
    head = args.head or DEFAULT_HEAD
    default = {"method": "eagle", "num_speculative_tokens": args.k, "model": head}
    chain = {**default, "lookup_first": False}  # the head's own chain: no prompt lookup
    methods = {"none": None,
               "ngram": {"method": "ngram", "num_speculative_tokens": args.k},
               "eagle": default,  # as configured by default: lookup_first, chains
               "eagle-chain": chain,  # the confidence floor: chains may end before k
               "eagle-fixed-k": {**chain, "min_draft_confidence": 0.0},  # always k drafts
               "eagle-full-vocab": {**chain, "model": _full_vocab_copy(head)},
               "eagle-lookup-fixed-k": {**chain, "lookup_first": True,
                                        "min_draft_confidence": 0.0},
               "eagle-tree": {**chain, "tree": TREE},  # the floor prunes unlikely branches
               "eagle-tree-full": {**chain, "tree": TREE, "min_draft_confidence": 0.0},
               "eagle-tree12": {**chain, "tree": TREE12},
               "eagle-tree12-full": {**chain, "tree": TREE12, "min_draft_confidence": 0.0},
               "eagle-tree15": {**chain, "tree": TREE15},
               "eagle-tree15-full": {**chain, "tree": TREE15, "min_draft_confidence": 0.0},
               "eagle-lookup-tree": {**chain, "lookup_first": True, "tree": TREE},
               "eagle-lookup-tree12": {**chain, "lookup_first": True, "tree": TREE12},
               "eagle-lookup-tree15": {**chain, "lookup_first": True, "tree": TREE15}}
    if args.k != 3:  # the trees are of depth 3
        methods = {m: spec for m, spec in methods.items() if "tree" not in (spec or {})}
    if args.methods != "all":
        methods = {m: methods[m] for m in ["none", *args.methods.split(",")] if m in methods}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    llms = {}
    for method, spec in methods.items():
        llms[method] = LLM(load_progress=False, num_threads=args.threads,
                           speculative_config=spec)
        run(llms[method], next(iter(workloads.values()))[:2], 2, params)  # warm-up: kernels, caches
    # Rounds: every method once per round, one after another on each (workload, batch), so a
    # slow spell of the box falls on all methods of a round alike; a speed-up is the median
    # of its per-round ratios.
    runs: dict[tuple, list[dict]] = {}
    for _ in range(args.rounds):
        for workload, prompts in workloads.items():
            for batch in batches:
                for method, llm in llms.items():
                    llm.engine.kv.reset_prefix_cache()
                    runs.setdefault((method, workload, batch), []).append(
                        run(llm, prompts, batch, params))
    for llm in llms.values():
        llm.shutdown()
    rows, results = [], []
    for (method, workload, batch), rs in runs.items():
        base = runs[("none", workload, batch)]
        r = dict(rs[0], tok_s=statistics.median(x["tok_s"] for x in rs),
                 tok_s_rounds=[round(x["tok_s"], 1) for x in rs])
        r["speedup"] = round(statistics.median(x["tok_s"] / b["tok_s"]
                                               for x, b in zip(rs, base)), 3)
        r["same_output"] = all(x["token_ids"] == b["token_ids"] for x, b in zip(rs, base))
        results.append(dict(method=method, workload=workload, batch=batch, **r))
    for r in results:
        rows.append(f"| {r['workload']} | {r['batch']} | {r['method']} | {r['tok_s']:.1f} | "
                    f"{r['speedup']}x | {_fmt(r['acceptance_length'])} | "
                    f"{_fmt(r['drafts_per_verify'])} | {_fmt(r['acceptance_rate'])} | "
                    f"{r['tokens_per_step']:.2f} | {r['same_output']} |")
    for r in results:
        del r["token_ids"]
    def chat_b1(method: str) -> dict:
        return next((r for r in results if r["method"] == method and r["workload"] == "chat"
                     and r["batch"] == 1), {})

    targets_met = {
        "chat_acceptance_length_2.2_at_k3": args.k == 3
        and (chat_b1("eagle").get("acceptance_length") or 0) >= 2.2,
        "chat_acceptance_length_2.2_at_k3_chain": args.k == 3
        and (chat_b1("eagle-fixed-k").get("acceptance_length") or 0) >= 2.2,
        "chat_acceptance_length_2.2_at_depth3_tree": args.k == 3 and max(
            (chat_b1(m).get("acceptance_length") or 0) for m in methods if "tree" in m) >= 2.2,
        "eagle_1.5x_tok_s_at_batch1": chat_b1("eagle").get("speedup", 0) >= 1.5,
        "best_eagle_1.5x_tok_s_at_batch1": max(
            (r["speedup"] for r in results if r["method"].startswith("eagle")
             and r["workload"] == "chat" and r["batch"] == 1), default=0) >= 1.5,
        # batch 1: the engine's int4 GEMMs of up to 16 rows (AMX; else 8), the attention
        # kernel's rows and the float32 LM head are row-exact; batch 8's verify steps (up to
        # 32 rows) run oneDNN's bf16 GEMMs, whose results depend on the row count (as in any
        # engine without batch-invariant kernels)
        "greedy_outputs_equal_at_batch1": all(r["same_output"] for r in results
                                              if r["batch"] == 1)}
    command = "python " + " ".join(sys.argv)
    result = dict(benchmark="spec_decode", device=platform.processor() or platform.machine(),
                  cpus=os.cpu_count(), date=datetime.datetime.now(datetime.UTC).isoformat(),
                  commit=head_commit(), versions=dict(torch=torch.__version__,
                                                      python=platform.python_version()),
                  command=command,
                  model="SmolLM2-135M-Instruct (Q4_1 GGUF: bf16 activations, int4 linears)",
                  prompts=args.prompts, max_tokens=args.max_tokens, k=args.k,
                  rounds=args.rounds, runs=results,
                  targets_met=targets_met)
    md = (f"# spec_decode ({result['device']}, {result['cpus']} cores, {result['date'][:10]}, "
          f"{result['commit']})\n\n`{command}`: SmolLM2-135M-Instruct greedy, {args.prompts} "
          f"held-out prompts a workload, {args.max_tokens} tokens each, k = {args.k}; tok/s: "
          f"median of {args.rounds} interleaved rounds, vs none: median of the rounds' "
          "ratios.\n\n"
          "| workload | batch | method | tok/s | vs none | acceptance length | drafts a verify | "
          "acceptance rate | tokens a target step | same output |\n"
          "|---|---|---|---|---|---|---|---|---|---|\n"
          + "\n".join(rows) + f"\n\nTargets: {targets_met}\n")
    write_result(args.out, result, md)
    print(md)


def _full_vocab_copy(head: str) -> str:
    """The head in a temporary directory with draft_vocab_size 0: drafts over the whole
    vocabulary (the same weights), for the draft vocabulary's cost and acceptance."""
    path = tempfile.mkdtemp(prefix="head-full-vocab-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    shutil.copy(os.path.join(head, "model.safetensors"), path)
    with open(os.path.join(head, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**config, "draft_vocab_size": 0}, f)
    return path


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.2f}"


if __name__ == "__main__":
    main()
