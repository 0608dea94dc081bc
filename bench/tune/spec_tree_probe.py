"""Probe (issue 23): would a static draft tree lift SmolLM2's chat acceptance past 2.2, and at
what verify cost on this CPU? Greedy only.

1. Acceptance, exactly, without building trees into the engine: under greedy verification a
   tree keeps the longest root path that spells the target's own continuation. So for every
   answer position the shipped head drafts (teacher-forced on the target's greedy answer, as
   `head_forward_steps` does: step s continues the chain of the true tokens) we record the rank
   of the true next token in the head's top list at each depth (draft vocabulary, as the engine
   drafts). A static tree is a prefix-closed set of rank paths ((0,), (1,), (0, 0), ...); its
   verify at t keeps the longest prefix of t's rank path in the tree. Each workload is then
   walked as the engine walks it (t advances by the tokens a verify yields).
2. Trees: the chain of k = 3; for N nodes, the N rank paths most often on the target's path in
   the other half of the prompts (chosen on one half, scored on the other, and the reverse).
3. Cost (this CPU, the default engine: bf16, the GGUF's 4-bit linears, 2 threads): the target
   over n verify rows (decode rows, as a chain's verify runs) + their logits, at a context of
   300, vs n = 1; the packed head over m single-position rows + its draft-vocabulary argmax.

Run: python bench/tune/spec_tree_probe.py --out /tmp/spec_tree   (~2 min on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter

import torch

from mxserve import LLM
from mxserve.worker.attention import AttentionBatch
from mxserve.worker.draft_spans import Span
from mxserve.worker.eagle import DEFAULT_HEAD, _run, load_head
from mxserve.worker.eagle_train import (
    chat_prompts,
    generate_samples,
    head_forward_steps,
    passage_prompts,
    target_features,
)

DEPTH = 4
TOP = 8  # ranks past this count as "not in the list"


@torch.inference_mode()
def rank_paths(head, embed, samples, features) -> list[list[tuple]]:
    """Per sample, per verify point t (x_0..x_t known, t >= the first answer token): the ranks
    of x_{t+1}, x_{t+2}, ... in the head's drafts at depth 1, 2, ... (TOP: not in the top)."""
    ids = head.draft_vocab_ranking[:head.draft_vocab_size] if head.draft_vocab_size else None
    weight = embed if ids is None else embed[ids]
    out = []
    for s, f in zip(samples, features):
        n = len(s.token_ids)
        tok = torch.tensor(s.token_ids + [0, 0])
        outs = head_forward_steps(head, embed, tok[None, 1:n + 1], f[None].float(), DEPTH)
        ranks = []  # ranks[d - 1][p]: rank of x_{p+2} under step d's output at p
        for g in outs:
            logits = g[0] @ weight.T  # [n, V']
            order = logits.topk(TOP, -1).indices
            order = order if ids is None else ids[order]
            want = tok[2:n + 2, None]
            hit = (order == want)
            r = torch.where(hit.any(-1), hit.float().argmax(-1), torch.full((n,), TOP))
            ranks.append(r.tolist())
        paths = []
        for t in range(s.num_prompt_tokens, n - 1):
            path = []
            for d in range(1, DEPTH + 1):
                p = t - 2 + d
                if p + 2 >= n:
                    break
                path.append(ranks[d - 1][p])
            paths.append(tuple(path))
        out.append(paths)
    return out


def kept(path: tuple, tree: set) -> int:
    d = 0
    while d < len(path) and path[:d + 1] in tree:
        d += 1
    return d


def walk(paths_per_sample, tree: set) -> dict:
    """Acceptance length walking each answer as the engine does, and per position."""
    tokens = verifies = 0
    for paths in paths_per_sample:
        t = 0
        while t < len(paths):
            a = kept(paths[t], tree)
            tokens += a + 1
            verifies += 1
            t += a + 1
    every = [kept(p, tree) + 1 for ps in paths_per_sample for p in ps]
    return {"acceptance_length": round(tokens / verifies, 4),
            "per_position": round(statistics.mean(every), 4)}


def best_tree(paths_per_sample, nodes: int, depth: int = DEPTH) -> set:
    count = Counter(p[:d] for ps in paths_per_sample for p in ps
                    for d in range(1, min(len(p), depth) + 1) if all(r < TOP for r in p[:d]))
    tree: set = set()
    for prefix, _ in sorted(count.items(), key=lambda kv: (-kv[1], len(kv[0]), kv[0])):
        if len(tree) == nodes:
            break
        if len(prefix) == 1 or prefix[:-1] in tree:
            tree.add(prefix)
    return tree


def chain(k: int) -> set:
    return {(0,) * d for d in range(1, k + 1)}


@torch.inference_mode()
def verify_cost(llm, ctx: int, rows: list[int], reps: int) -> dict:
    engine, runner = llm.engine, llm.engine.runner
    bs = engine.kv.block_size
    assert engine.kv.reset_prefix_cache()
    table = list(range(-(-(ctx + max(rows)) // bs)))
    meta = runner.attn.build_metadata(AttentionBatch(
        query_lens=[ctx], start_positions=[0], block_tables=[table], num_decodes=0,
        block_size=bs, device=runner.device))
    runner.model(torch.randint(100, 1000, (ctx,)), torch.arange(ctx), runner.kv_caches,
                 runner.attn, meta)
    out = {}
    for n in rows:
        meta = runner.attn.build_metadata(AttentionBatch(
            query_lens=[n], start_positions=[ctx], block_tables=[table],
            num_decodes=1 if n == 1 else 0, block_size=bs, device=runner.device,
            query_rows=None if n == 1 else [True]))
        ids, pos = torch.randint(100, 1000, (n,)), torch.arange(ctx, ctx + n)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            hidden = runner.model(ids, pos, runner.kv_caches, runner.attn, meta)
            runner.model.compute_logits(hidden).argmax(-1).tolist()
            times.append(time.perf_counter() - t0)
        out[n] = round(statistics.median(times) * 1e3, 3)
    return out


@torch.inference_mode()
def draft_cost(llm, ctx: int, rows: list[int], reps: int) -> dict:
    engine, runner = llm.engine, llm.engine.runner
    drafter = engine.drafter
    head = drafter.head
    bs = engine.kv.block_size
    assert engine.kv.reset_prefix_cache()
    table = list(range(-(-(ctx + 8) // bs)))
    hidden = head.config.hidden_size
    _run(head, drafter.kv_cache, drafter.attn, bs, [Span(0, ctx, table, 0)],
         list(range(100, 100 + ctx)), torch.randn(ctx, hidden).to(runner.dtype))
    out = {}
    for m in rows:
        spans = [Span(ctx, 1, table, 0)] * m
        feats = torch.randn(m, hidden).to(runner.dtype)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            g = _run(head, drafter.kv_cache, drafter.attn, bs, spans, [500] * m, feats)
            head.draft_tokens(g)[0].tolist()
            times.append(time.perf_counter() - t0)
        out[m] = round(statistics.median(times) * 1e3, 3)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=30)
    args = p.parse_args()
    torch.set_num_threads(2)
    llm = LLM(load_progress=False, num_threads=2, speculative_config={
        "method": "eagle", "num_speculative_tokens": 3})
    target = llm.engine.model_config
    lm_head = llm.engine.runner.model.lm_head
    embed = (lm_head.embedding.weight if lm_head.tied else lm_head.weight).detach().float()
    head = load_head(DEFAULT_HEAD, target, torch.float32, torch.device("cpu"))
    result = {"command": "python bench/tune/spec_tree_probe.py " + " ".join(sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d"), "workloads": {}}
    paths = {}
    for name, prompts in (("chat", chat_prompts(args.prompts, "heldout")),
                          ("kjv", passage_prompts(args.prompts, "heldout"))):
        samples = generate_samples(llm, prompts, args.max_tokens)
        feats = target_features(llm, samples)
        paths[name] = rank_paths(head, embed, samples, feats)
        first = [p[0] for ps in paths[name] for p in ps if p]
        result["workloads"][name] = {
            "answer_tokens": sum(len(ps) for ps in paths[name]),
            "first_draft_top": {k: round(sum(r < k for r in first) / len(first), 4)
                                for k in (1, 2, 3, 4, 8)}}
    for name in paths:
        half = len(paths[name]) // 2
        a, b = paths[name][:half], paths[name][half:]
        rows = {"chain3": {**walk(paths[name], chain(3)), "nodes": 3},
                "chain4": {**walk(paths[name], chain(4)), "nodes": 4}}
        for depth in (3, 4):
            for nodes in (4, 5, 6, 7, 8, 10, 12, 16, 24):
                ta, tb = best_tree(b, nodes, depth), best_tree(a, nodes, depth)  # other half's
                wa, wb = walk(a, ta), walk(b, tb)
                n_a, n_b = sum(len(p) for p in a), sum(len(p) for p in b)
                rows[f"tree{nodes}_depth{depth}"] = {
                    "nodes": nodes, "depth": depth,
                    "acceptance_length": round((wa["acceptance_length"] * n_a
                                                + wb["acceptance_length"] * n_b)
                                               / (n_a + n_b), 4),
                    "levels": [sum(len(t) == d for t in best_tree(paths[name], nodes, depth))
                               for d in range(1, depth + 1)],
                    "tree_from_all": sorted(best_tree(paths[name], nodes, depth))}
        result["workloads"][name]["trees"] = rows
        print(name, json.dumps({k: v["acceptance_length"] for k, v in rows.items()}), flush=True)
    result["verify_ms"] = verify_cost(llm, 300, [1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24], args.reps)
    result["draft_ms"] = draft_cost(llm, 300, [1, 2, 4, 8, 16], args.reps)
    print("verify", result["verify_ms"], "draft", result["draft_ms"], flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "spec_tree_probe.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
