"""What a tensor-parallel group adds to a step on CPU: TP=2 vs TP=1, decode steps of a small
Llama-shaped model with dummy weights, batch 1 and 16, float32.

CPU is no place for tensor-parallel speed (ranks share the machine's cores and gloo's
collectives go through the kernel's loopback); this measures the cost the group adds per step,
and where it goes:
- `step_ms`: median decode step, engine.step() end to end (TP=1 at 1 and at 2 threads: the same
  cores the two ranks of TP=2 use between them, one thread each);
- `plan_us`: rank 0 encoding and sending the plan to the other rank (tp_wire + the socket);
- `all_reduce_us` / `all_reduces`: the model's collectives a step on rank 0 (one per attention
  block and per MLP, one for the embedding), time spent in them (including waiting for the
  other rank to arrive: the compute imbalance shows here too);
- `all_gather_us`: the LM head's logits gathered (the vocabulary is split over the ranks).

Run: python bench/tp_cpu.py [--steps 64] [--out bench/results/tp_cpu.json] (~1 min)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lib.revision import head_commit, write_result  # noqa: E402

CONFIG = dict(architectures=["LlamaForCausalLM"], vocab_size=8192, hidden_size=512,
              intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
              num_key_value_heads=4, max_position_embeddings=2048, rms_norm_eps=1e-5,
              bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)


class Timer:
    """Wraps a callable and sums its wall time and calls."""

    def __init__(self, fn) -> None:
        self.fn, self.seconds, self.calls = fn, 0.0, 0

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t
            self.calls += 1

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0


def measure(model: str, size: int, threads: int, batch: int, steps: int) -> dict:
    from mxserve import LLM, SamplingParams

    llm = LLM(model, load_format="dummy", dtype="float32", tensor_parallel_size=size,
              num_threads=threads, load_progress=False, num_kv_blocks=1024, max_num_seqs=64)
    engine, tp = llm.engine, llm.engine.runner.tp
    timers = {}
    if size > 1:  # the group's costs, on rank 0
        timers["plan"] = engine.runner.followers.send = Timer(engine.runner.followers.send)
        for name, method in (("all_reduce", "all_reduce"), ("all_gather", "all_gather_last_dim")):
            timers[name] = Timer(getattr(tp, method))
            object.__setattr__(tp, method, timers[name])  # the layers share this TPGroup
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        engine.add_request([3 + (i * 31 + j) % 8000 for j in range(32)], params)
    while any(r.is_prefill for r in engine.requests.values()):  # prefill, then decode only
        engine.step()
    engine.step()
    times = []
    for timer in timers.values():
        timer.reset()
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    result = dict(tp=size, threads=threads, batch=batch,
                  step_ms=round(statistics.median(times) * 1e3, 3))
    for name, timer in timers.items():
        result[f"{name}_us"] = round(timer.seconds / steps * 1e6, 1)
        if name == "all_reduce":
            result["all_reduces"] = timer.calls // steps
    llm.shutdown()
    return result


def _reading(runs: list[dict]) -> str:
    """Where the group's extra time goes, a line per batch."""
    lines = []
    for tp2 in (r for r in runs if r["tp"] == 2):
        base = next(r for r in runs if r["batch"] == tp2["batch"] and r["tp"] == 1
                    and r["threads"] == 1)
        extra = tp2["step_ms"] - base["step_ms"]
        collectives = (tp2["all_reduce_us"] + tp2["all_gather_us"]) / 1e3
        each = tp2["all_reduce_us"] / 1e3 / max(1, tp2["all_reduces"])
        lines.append(f"- batch {tp2['batch']}: TP=2 adds {extra:.1f} ms a step; its "
                     f"collectives take {collectives:.1f} ms ({each:.2f} ms an all-reduce), the "
                     f"plan {tp2['plan_us'] / 1e3:.2f} ms.")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--out", default="bench/results/tp_cpu.json")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as model:
        with open(os.path.join(model, "config.json"), "w") as f:
            json.dump(CONFIG, f)
        runs = [measure(model, size, threads, batch, args.steps)
                for batch in (1, 16) for size, threads in ((1, 1), (1, 2), (2, 1))]
    rows = []
    for run in runs:
        base = next(r for r in runs if r["batch"] == run["batch"] and r["tp"] == 1
                    and r["threads"] == 1)
        run["vs_tp1_1thread"] = round(run["step_ms"] / base["step_ms"], 3)
        rows.append(f"| {run['batch']} | TP={run['tp']} x {run['threads']} thread(s) | "
                    f"{run['step_ms']} | {run['vs_tp1_1thread']}x | {run.get('plan_us', '-')} | "
                    f"{run.get('all_reduces', '-')} / {run.get('all_reduce_us', '-')} | "
                    f"{run.get('all_gather_us', '-')} |")
    command = "python " + " ".join(sys.argv)
    result = dict(benchmark="tp_cpu", device=platform.processor() or platform.machine(),
                  cpus=os.cpu_count(), date=datetime.datetime.now(datetime.UTC).isoformat(),
                  commit=head_commit(), versions=dict(torch=torch.__version__,
                                                      python=platform.python_version()),
                  command=command, model=CONFIG, steps=args.steps, runs=runs,
                  targets="none on CPU: issue 22 asks for the per-step cost the group adds",
                  targets_met={})
    md = (f"# tp_cpu ({result['device']}, {result['cpus']} cores, {result['date'][:10]}, "
          f"{result['commit']})\n\n`{command}`: decode steps of a {CONFIG['num_hidden_layers']}"
          f"-layer, hidden {CONFIG['hidden_size']} Llama (dummy weights, float32), median of "
          f"{args.steps}.\n\n| batch | engine | step ms | vs TP=1 x 1 | plan send us | "
          "all-reduces / us | logits all-gather us |\n|---|---|---|---|---|---|---|\n"
          + "\n".join(rows) + "\n\n" + _reading(runs))
    write_result(args.out, result, md)
    print(md)


if __name__ == "__main__":
    main()
