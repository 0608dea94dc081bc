"""Host (Python) time of one decode step at large batches, by phase, on CPU.

On the H200 a batch-512 decode step of the 1B model took 10.4 ms of engine time around a 4.0 ms
graph replay (bench/results/engine_gpu.json, decode sweep): the rest is host work that the GPU
waits for. This measures the device-independent part of it, per step and per request:

- schedule: `Scheduler.schedule()` (block allocation, the step plan);
- inputs: `DecodeGraphs._copy_inputs` (token ids, positions, slots, sequence lengths and block
  tables of a CUDA-graph replay, built in numpy; here the "device" buffers are CPU tensors);
- sample: the sampler's host side on greedy requests (its argmax over a tiny vocabulary);
- update: `Engine._complete` (append tokens, stop checks, block hashes, step outputs; `_update`
  before async scheduling);
- deliver: `AsyncEngine` handing the step's outputs to the requests' streams, on an event loop
  running in another thread (as in a Serve replica), engine-thread side (nothing takes them:
  a revision that wakes a stream only when a message is due wakes each once here).

Then the cyclic garbage collector's pauses over `--gc-steps` steps at the largest batch, timed
with `gc.callbacks`: with the heap as the engine leaves it, and frozen (`gc.freeze()`) before
the requests arrive, as a Serve replica's Worker does (cluster/worker.py). Each variant runs in
a fresh process.

A tiny dummy Llama (vocab 256, one layer) runs the forward on CPU, so the model costs nothing that
matters; its time is not counted. Every request has a 64 + 256-token prompt (so ~20 blocks of
table) and decodes greedily with ignore_eos. `--baseline REV` runs the same measurement from a git
worktree of REV in a subprocess, one after the other on the same machine, and reports the
ratios.

    python bench/host_overhead.py --baseline 66d55f3 --out bench/results/host_overhead.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))
from revision import head_commit, run_inner, write_result  # noqa: E402

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
PHASES = ("schedule", "inputs", "sample", "update", "deliver")


def decoding_engine(batch: int, steps: int, prompt_len: int, freeze: bool):
    """The tiny model's engine (1 torch thread) with `batch` requests past their prefill, each
    with room for `steps` more tokens. freeze: gc.freeze() before the requests arrive."""
    import gc

    import torch

    from mxserve import LLM, SamplingParams

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as model_dir:
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump({**TINY, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}, f)
        llm = LLM(model=model_dir, load_format="dummy", device="cpu", dtype="float32",
                  load_progress=False, max_num_seqs=batch, max_num_batched_tokens=8192)
    engine = llm.engine
    if freeze:
        gc.collect()
        gc.freeze()
    params = SamplingParams(temperature=0, max_tokens=steps + 64, ignore_eos=True)
    for i in range(batch):
        engine.add_request([(i * 7 + j) % 250 + 1 for j in range(prompt_len)], params)
    while any(r.is_prefill for r in engine.requests.values()) or engine.scheduler.waiting:
        engine.step()
    return engine


def measure(batch: int, steps: int, prompt_len: int) -> dict:
    """Mean microseconds a decode step spends in each phase at `batch` running requests (the
    garbage collector off)."""
    import gc

    import torch

    from mxserve.worker.async_engine import AsyncEngine
    from mxserve.worker.cuda_graphs import DecodeGraphs

    engine = decoding_engine(batch, steps, prompt_len, freeze=False)
    async_engine = AsyncEngine(engine)  # its thread is not started: this loop drives the engine
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    stream_of = getattr(sys.modules[AsyncEngine.__module__], "_Stream", None)
    for rid in engine.requests:  # (no consumer takes: the engine thread's side alone)
        async_engine._streams[rid] = stream_of(loop) if stream_of else (loop, asyncio.Queue())
    deliver_all = getattr(async_engine, "_deliver_all", None)
    graphs = DecodeGraphs(engine.runner, engine.max_model_len)
    size = next(s for s in graphs.sizes if s >= batch)
    totals = dict.fromkeys(PHASES, 0.0)
    forward, execute = [0.0], engine.runner.execute

    def timed_execute(plan):
        t = time.perf_counter()
        out = execute(plan)
        forward[0] += time.perf_counter() - t
        return out

    engine.runner.execute = timed_execute
    gc.collect()
    gc.disable()  # the collector's pauses are measured apart (measure_gc)
    for step in range(steps + 5):
        t0 = time.perf_counter()
        plan = engine.scheduler.schedule()
        t1 = time.perf_counter()
        graphs._copy_inputs(plan, size)
        t2 = time.perf_counter()
        if hasattr(engine, "_run_model"):  # run the model, sample, complete
            result = engine._run_model(plan, None)  # the tiny forward: not counted
            t3 = time.perf_counter()
            launched = engine._sample(plan, result)
            t4 = time.perf_counter()
            outputs = engine._complete(launched)
        elif hasattr(engine, "_launch"):  # (a revision with run + sample in one call)
            forward[0] = 0.0
            launched = engine._launch(plan, None)
            t4 = time.perf_counter()
            t3 = t2 + forward[0]  # the tiny forward: not counted
            outputs = engine._complete(launched)
        else:  # a revision before async scheduling
            result = engine.runner.execute(plan)  # the tiny forward: not counted
            requests = [s.request for s in plan.scheduled if s.samples]
            t3 = time.perf_counter()
            with torch.inference_mode():
                sampled = engine.sampler(result.logits, requests)
            t4 = time.perf_counter()
            outputs = engine._update(plan, sampled.token_ids, sampled.logprobs)
        t5 = time.perf_counter()
        if deliver_all is not None:
            deliver_all(outputs)
        else:  # a revision that handed them over one by one
            for out in outputs:
                async_engine._deliver(out.request_id, out)
        t6 = time.perf_counter()
        assert plan.num_decodes == len(plan.scheduled) == batch
        if step >= 5:  # warm-up steps first
            for name, a, b in zip(PHASES, (t0, t1, t3, t4, t5), (t1, t2, t4, t5, t6)):
                totals[name] += b - a
    gc.enable()
    loop.call_soon_threadsafe(loop.stop)
    per_step = {k: v / steps * 1e6 for k, v in totals.items()}
    return {"batch": batch, "steps": steps,
            "us_per_step": {k: round(v, 1) for k, v in per_step.items()},
            "us_per_step_total": round(sum(per_step.values()), 1),
            "us_per_request": {k: round(v / batch, 3) for k, v in per_step.items()}}


def measure_gc(batch: int, steps: int, prompt_len: int, freeze: bool) -> dict:
    """Collector pauses (count, total and longest, per generation) over `steps` decode steps."""
    import gc

    engine = decoding_engine(batch, steps, prompt_len, freeze)
    pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
    started = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses[info["generation"]].append(time.perf_counter() - started[0])

    step_times = []
    gc.callbacks.append(on_gc)
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            step_times.append(time.perf_counter() - t0)
    finally:
        gc.callbacks.remove(on_gc)
    step_times.sort()
    return {"batch": batch, "steps": steps, "frozen": freeze,
            "frozen_objects": gc.get_freeze_count(), "tracked_objects": len(gc.get_objects()),
            "step_ms": {"p50": round(step_times[len(step_times) // 2] * 1e3, 2),
                        "p99": round(step_times[int(len(step_times) * 0.99)] * 1e3, 2),
                        "max": round(step_times[-1] * 1e3, 2)},
            "gc_pauses": {f"gen{g}": {"count": len(p), "total_ms": round(sum(p) * 1e3, 2),
                                      "max_ms": round(max(p, default=0.0) * 1e3, 2)}
                          for g, p in pauses.items()}}


def _best(runs: list[list[dict]]) -> list[dict]:
    """Per batch, each phase's minimum over the runs (the total: their sum)."""
    rows = []
    for per_batch in zip(*runs):
        row = dict(per_batch[0])
        row["us_per_step"] = {k: min(r["us_per_step"][k] for r in per_batch) for k in PHASES}
        row["us_per_step_total"] = round(sum(row["us_per_step"].values()), 1)
        row["us_per_request"] = {k: round(v / row["batch"], 3)
                                 for k, v in row["us_per_step"].items()}
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="64,256,512")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--prompt-len", type=int, default=320)
    ap.add_argument("--baseline", help="a git revision to measure the same way, for ratios")
    ap.add_argument("--out", default="/tmp/host_overhead.json")
    ap.add_argument("--gc-steps", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=3, help="alternating rounds, best kept")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--gc", choices=["on", "off"], help=argparse.SUPPRESS)  # with --inner
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.inner:  # a subprocess (revision.run_inner): one JSON line
        print(json.dumps(measure_gc(max(batches), args.gc_steps, args.prompt_len, args.gc == "on")
                         if args.gc else
                         [measure(b, args.steps, args.prompt_len) for b in batches]))
        return
    inner = ["--batches", args.batches, "--steps", str(args.steps), "--prompt-len",
             str(args.prompt_len)]
    # Both sides in fresh subprocesses, alternating, each phase's best of --repeats: measured
    # in this process, or first, a side ran up to 1.5x slower (HEAD against itself: 0.65x)
    runs, base_runs = [], []
    for _ in range(args.repeats):
        runs.append(run_inner(__file__, inner))
        if args.baseline:
            base_runs.append(run_inner(__file__, inner, args.baseline))
    rows = _best(runs)
    base = _best(base_runs) if args.baseline else None
    gc_rows = [run_inner(__file__, ["--gc", on, "--batches", args.batches, "--gc-steps",
                                    str(args.gc_steps), "--prompt-len", str(args.prompt_len)])
               for on in ("off", "on")]
    commit = head_commit()
    result = {"bench": "host_overhead", "device": f"CPU ({platform.processor() or 'x86_64'}, "
              "1 torch thread)", "date": datetime.date.today().isoformat(),
              "versions": {"python": platform.python_version()}, "commit": commit,
              "command": "python bench/host_overhead.py " + " ".join(sys.argv[1:]),
              "loadavg": os.getloadavg(), "rows": rows, "baseline": args.baseline,
              "baseline_rows": base, "gc": gc_rows}
    lines = ["| batch | phase | this (us/step) | baseline (us/step) | baseline / this |",
             "|---|---|---|---|---|"]
    for i, row in enumerate(rows):
        for phase in (*PHASES, "total"):
            ours = row["us_per_step_total"] if phase == "total" else row["us_per_step"][phase]
            cells = [str(row["batch"]), phase, f"{ours:.0f}"]
            if base:
                theirs = base[i]["us_per_step_total"] if phase == "total" \
                    else base[i]["us_per_step"][phase]
                cells += [f"{theirs:.0f}", f"{theirs / ours:.2f}x"]
            else:
                cells += ["-", "-"]
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Collector pauses over {args.gc_steps} decode steps at batch {max(batches)} "
              "(engine.step() includes the tiny CPU forward):", "",
              "| heap | full (gen 2) collections | longest full | all pauses | step p50 / p99 / "
              "max ms |", "|---|---|---|---|---|"]
    for g in gc_rows:
        gen2, ms = g["gc_pauses"]["gen2"], g["step_ms"]
        total = sum(p["total_ms"] for p in g["gc_pauses"].values())
        lines.append(f"| {'frozen at start' if g['frozen'] else 'as is'} | {gen2['count']} | "
                     f"{gen2['max_ms']:.1f} ms | {total:.0f} ms | {ms['p50']} / {ms['p99']} / "
                     f"{ms['max']} |")
    write_result(args.out, result,
                 f"# host_overhead ({result['device']}, {result['date']}, commit {commit}, "
                 f"baseline {args.baseline})\n\n`{result['command']}`\n\n"
                 + "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
