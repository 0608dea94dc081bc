"""KV eviction's compaction on the host (issue 25): what the engine does when requests pass
their budget (`Engine._evict`: the policy's choice, `KVCacheManager.compact`'s block and slot
plan, the scores following) and the KV moves the next step makes (`ModelRunner.move_kv`, every
layer's K and V), timed apart, on CPU, with the 1B shape's 16 layers at a small width (the
host work depends on tokens, requests and layers, not on the width).

Each request holds a `--context`-token prompt under H2O with the budget at the prompt length:
every 16 tokens it passes the budget by a block and keeps its first sinks, its newest half and
the highest-scoring rest, so nearly every kept token moves (the worst case, and the h2o_gpu
bench's "h2o_compacting" regime, where this host path cost 11.3 ms a step amortised at batch 64
on the H200). Prefill chunks stagger the requests, so a few compact at each step. Reported per
request compacted: ms in the engine's decision, ms in the moves, slots moved. `--baseline REV`
runs the same measurement on a checkout of REV in the same invocation.

Run: python bench/h2o_compaction.py [--batches 1,64] [--context 4000] [--baseline REV]
     (~3 min on 2 cores)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import tempfile
import time

SHAPE = dict(architectures=["LlamaForCausalLM"], vocab_size=512, hidden_size=128,
             intermediate_size=256, num_hidden_layers=16, num_attention_heads=8,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=8192,
             rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=1,
             eos_token_id=2)


def measure(batches: list[int], context: int, events: int) -> list[dict]:
    """In this process: the compaction events' host times, for each batch size."""
    import numpy as np
    import torch

    from mxserve import LLM, SamplingParams

    torch.set_num_threads(1)
    model_dir = tempfile.mkdtemp()
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(SHAPE, f)
    rows = []
    max_len = context + 16 * (events + 2)
    for b in batches:
        llm = LLM(model=model_dir, load_format="dummy", dtype="float32", load_progress=False,
                  max_model_len=max_len, max_num_seqs=b, max_num_batched_tokens=8192,
                  num_kv_blocks=b * (-(-max_len // 16)) + 16, kv_eviction="h2o",
                  kv_budget=context, num_threads=1, enable_prefix_caching=False)
        engine = llm.engine
        timed, moved = _instrument(engine)
        rng = np.random.default_rng(1)
        for _ in range(b):
            engine.add_request(rng.integers(10, 500, context).tolist(),
                               SamplingParams(temperature=0, ignore_eos=True,
                                              max_tokens=max_len - context))
        per_event = []
        while len(per_event) < events:
            for part in timed.values():
                part.clear()
            moved.clear()
            before = engine.evictor.num_evicted_tokens
            engine.step()
            if engine.evictor.num_evicted_tokens > before:  # this step's _evict compacted
                decided, requests = sum(timed["evict"]), len(timed["compactions"])
                engine.step()  # its moves go with the next step
                per_event.append(dict(evict_s=decided, move_s=sum(timed["move"]),
                                      slots=sum(moved), calls=len(timed["move"]),
                                      requests=requests))
        llm.shutdown()
        requests = sum(e["requests"] for e in per_event)
        evict_ms = sum(e["evict_s"] for e in per_event) * 1e3 / requests
        move_ms = sum(e["move_s"] for e in per_event) * 1e3 / requests
        rows.append(dict(batch=b, events=len(per_event), requests_compacted=requests,
                         decide_ms=round(evict_ms, 3), move_ms=round(move_ms, 3),
                         total_ms=round(evict_ms + move_ms, 3),
                         slots_moved=round(sum(e["slots"] for e in per_event) / requests),
                         move_calls_per_event=round(sum(e["calls"] for e in per_event)
                                                    / len(per_event), 2)))
        print(rows[-1], flush=True)
    shutil.rmtree(model_dir, ignore_errors=True)
    return rows


def _instrument(engine) -> tuple[dict, list]:
    """Wrap the engine's eviction decision and the runner's KV moves with timers: (seconds of
    each call by part, slots each move call moved)."""
    timed, moved = {"evict": [], "move": [], "compactions": []}, []
    evict, move, compact = engine._evict, engine.runner.move_kv, engine.kv.compact

    def counted_compact(request_id, keep):
        timed["compactions"].append(request_id)
        return compact(request_id, keep)

    def timed_evict():
        t0 = time.perf_counter()
        evict()
        timed["evict"].append(time.perf_counter() - t0)

    def timed_move(src, dst):
        t0 = time.perf_counter()
        move(src, dst)
        timed["move"].append(time.perf_counter() - t0)
        moved.append(len(src))

    engine._evict, engine.runner.move_kv = timed_evict, timed_move
    engine.kv.compact = counted_compact
    return timed, moved


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,64")
    p.add_argument("--context", type=int, default=4000)
    p.add_argument("--events", type=int, default=6, help="steps with compactions timed")
    p.add_argument("--baseline", default=None, help="a git revision to time the same way")
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default="bench/results/h2o_compaction.json")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.inner:  # run_inner's child process (this checkout or the baseline's)
        print(json.dumps(measure(batches, args.context, args.events)))
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from lib.revision import head_commit, run_inner, write_result

    inner = ["--batches", args.batches, "--context", str(args.context), "--events",
             str(args.events)]

    result = dict(benchmark="h2o_compaction", device=platform.processor() or
                  platform.machine(), cpus=os.cpu_count(),
                  date=datetime.datetime.now(datetime.UTC).isoformat(), commit=head_commit(),
                  command="python " + " ".join(sys.argv), context=args.context,
                  rows=run_inner(__file__, inner))
    if args.baseline:
        result["baseline"] = dict(revision=args.baseline,
                                  rows=run_inner(__file__, inner, args.baseline))
    lines = [f"# h2o_compaction ({result['device']}, {result['cpus']} cores, "
             f"{result['date'][:10]}, {result['commit']})", "",
             f"`{result['command']}`: {args.context}-token requests under H2O, the budget at "
             "the prompt, a compaction every 16 tokens a request; 16 layers (the 1B shape's), "
             "width 128, CPU, one thread. Per request compacted, over all the events timed; "
             "move calls: the runner's KV move calls per compacting step.", "",
             "| batch | tree | requests compacted | decide ms | moves ms | total ms | slots moved |"
             " move calls |", "|---|---|---|---|---|---|---|---|"]
    trees = [("this", result["rows"])]
    if args.baseline:
        trees.append((args.baseline, result["baseline"]["rows"]))
    for b in batches:
        for name, rows in trees:
            r = next(x for x in rows if x["batch"] == b)
            lines.append(f"| {b} | {name} | {r['requests_compacted']} | {r['decide_ms']} | "
                         f"{r['move_ms']} | {r['total_ms']} | {r['slots_moved']} | "
                         f"{r['move_calls_per_event']} |")
    if args.baseline:
        result["speedup_total"] = {
            f"b{b}": round(next(x for x in result["baseline"]["rows"] if x["batch"] == b)
                           ["total_ms"] / next(x for x in result["rows"] if x["batch"] == b)
                           ["total_ms"], 2) for b in batches}
        lines += ["", f"Baseline total / this total: {result['speedup_total']}"]
    write_result(args.out, result, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
