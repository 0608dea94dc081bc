"""Where a batch-1 decode step's GPU time goes: the kernels of its replayed CUDA graph (H200).

For each shape (dummy weights) and weight format: one greedy request decoded to steady state,
then the batch-1 graph replayed with the last step's inputs: its median time (CUDA events), and
under torch.profiler (CUPTI reports the kernels inside a graph replay) each kernel's device time
a step, launches a step, and their sum; the gap between the sum and the replay time is launch
latency and idle time between kernels. Writes JSON (device, date, versions, command, rows) and
prints a table per case.

    python bench/graph_profile.py --out $OUT/graph_profile.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))

from gpu_timing import header, replay_ms  # noqa: E402

from mxserve import LLM, SamplingParams  # noqa: E402

REPLAYS = 20


def profile_case(shape: str, quant: str | None) -> dict:
    llm = LLM(model=shape, load_format="dummy", dtype="bfloat16", load_progress=False,
              max_num_seqs=8, kv_cache_memory_gb=2.0, max_model_len=4096, quantization=quant)
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    engine.add_request([(1000 + i) % vocab for i in range(128)],
                       SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.last_size == 1
    graph = graphs.graphs[1].graph
    replay = replay_ms(graph, 200)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            graph.replay()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = collections.defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name].append(e.device_time if hasattr(e, "device_time") else e.cuda_time)
    rows = sorted(({"kernel": name[:90], "us_per_step": round(sum(t) / REPLAYS, 2),
                    "launches_per_step": len(t) / REPLAYS,
                    "us_per_launch": round(sum(t) / len(t), 2)}
                   for name, t in kernels.items()), key=lambda r: -r["us_per_step"])
    total = sum(r["us_per_step"] for r in rows)
    del llm, engine, graphs, graph
    torch.cuda.empty_cache()
    return {"shape": shape, "quantization": quant, "graph_replay_ms_p50": replay,
            "kernel_us_per_step": round(total, 1),
            "launches_per_step": sum(r["launches_per_step"] for r in rows), "kernels": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/graph_profile.json")
    ap.add_argument("--cases", default="llama-3.2-1b:bf16,llama-3.2-1b:mxfp4,llama-3-8b:mxfp4")
    args = ap.parse_args()
    result = {**header("graph_profile"), "command": " ".join(sys.argv), "rows": []}
    for case in args.cases.split(","):
        shape, fmt = case.split(":")
        r = profile_case(shape, None if fmt == "bf16" else fmt)
        result["rows"].append(r)
        print(f"\n{shape} {fmt}: graph replay {r['graph_replay_ms_p50']} ms, kernels "
              f"{r['kernel_us_per_step']} us in {r['launches_per_step']} launches a step")
        print("| kernel | us a step | launches | us a launch |\n|---|---|---|---|")
        for k in r["kernels"][:14]:
            print(f"| {k['kernel']} | {k['us_per_step']} | {k['launches_per_step']} | "
                  f"{k['us_per_launch']} |")
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
