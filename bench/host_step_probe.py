"""Probe (H200): where the host's time goes in a decode step with async scheduling, 1B model
(dummy bf16), at batch 1 and 512: each part of Engine.step() (scheduler.schedule,
DecodeGraphs._copy_inputs, the graph replay call, the in-flight token fill, sampler.sample,
SampledTokens.result's wait, Engine._complete) timed on the host with perf_counter, mean ms a
step over 40 steps.

    python bench/host_step_probe.py --out DIR     (DIR/host_step_probe.json)
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(REPO))

from gpu_timing import header, timed  # noqa: E402

from mxserve import LLM, SamplingParams  # noqa: E402
from mxserve.worker import cuda_graphs, runner, sampler  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    args = p.parse_args()
    llm = LLM(model="llama-3.2-1b", load_format="dummy", dtype="bfloat16", load_progress=False,
              max_num_seqs=512, kv_cache_memory_gb=16.0, max_model_len=4096,
              max_num_batched_tokens=8192)
    gc.collect()
    gc.freeze()  # as a Serve worker does: no full collections of the model's objects
    engine = llm.engine
    graphs = engine.runner.graphs
    totals: dict[str, float] = collections.defaultdict(float)
    engine.scheduler.schedule = timed(totals, "schedule", engine.scheduler.schedule)
    graphs._copy_inputs = timed(totals, "copy_inputs", graphs._copy_inputs)
    for g in graphs.graphs.values():
        g.graph.replay = timed(totals, "replay_call", g.graph.replay)
    cuda_graphs.fill_inflight_tokens = timed(totals, "fill_inflight",
                                             runner.fill_inflight_tokens)
    engine.sampler.sample = timed(totals, "sample", engine.sampler.sample)
    sampler.SampledTokens.result = timed(totals, "result_wait", sampler.SampledTokens.result)
    engine._complete = timed(totals, "complete_incl_wait", engine._complete)
    engine.step = timed(totals, "step", engine.step)
    rows = []
    for batch in (1, 512):
        for i in range(batch):
            engine.add_request([(17 * i + j) % 120000 + 10 for j in range(256)],
                               SamplingParams(temperature=0, ignore_eos=True, max_tokens=80))
        while engine.scheduler.waiting or any(r.num_output_tokens < 4
                                              for r in engine.requests.values()):
            engine.step()
        totals.clear()
        for _ in range(40):
            engine.step()
        row = {"batch": batch, "ms_per_step": {k: round(v / 40 * 1e3, 3)
                                              for k, v in totals.items()}}
        # The same input copy with the device idle: its host cost alone.
        plan = engine.scheduler.schedule()
        size = next(x for x in graphs.sizes if x >= len(plan.scheduled))
        idle = []
        for _ in range(20):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            graphs._copy_inputs(plan, size)
            idle.append(time.perf_counter() - t0)
        row["copy_inputs_device_idle_ms"] = round(sorted(idle)[10] * 1e3, 3)
        rows.append(row)
        print(json.dumps(rows[-1]), flush=True)
        for rid in list(engine.requests):
            engine.abort(rid)
        while engine.has_unfinished_requests():
            engine.step()
    res = {**header("host_step_probe"), "rows": rows}
    with open(os.path.join(args.out, "host_step_probe.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
