"""Probe (H200): what parts of the 1B batch-1 decode step cost on the device, and two changes.

1. Greedy argmax over 128256 logits: torch.argmax vs kernels/sampling_ops.argmax_rows at several
   batch sizes (CUDA graph of 20 calls, per call).
2. Decode attention's minimum split (paged_attention.MIN_SPLIT_TOKENS) for the CUDA graphs: the
   1B model (dummy bf16, max_model_len 4096) built with each value; its batch-1 graph replay and
   engine step (as bench/engine_gpu.py's batch-1 section, 128-token prompt, 128 tokens).
3. bf16 GEMV at M = 1 on the 1B decoder shapes: F.linear vs x @ W.t().

    python bench/decode_step_probe.py --out DIR     (DIR/decode_step_probe.json)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(REPO))

from gpu_timing import graph_us, header, replay_ms  # noqa: E402

from mxserve import LLM, SamplingParams  # noqa: E402
from mxserve.kernels import paged_attention  # noqa: E402
from mxserve.kernels.sampling_ops import argmax_rows  # noqa: E402


def argmax_section() -> list[dict]:
    rows = []
    for batch in (1, 8, 64, 512):
        logits = torch.randn(batch, 128256, device="cuda")
        assert torch.equal(argmax_rows(logits), logits.argmax(-1))
        rows.append({"batch": batch, "torch_us": graph_us([lambda x=logits: x.argmax(-1)] * 20),
                     "triton_us": graph_us([lambda x=logits: argmax_rows(x)] * 20)})
    return rows


def engine_batch1(min_split: int) -> dict:
    paged_attention.MIN_SPLIT_TOKENS = min_split
    llm = LLM(model="llama-3.2-1b", load_format="dummy", dtype="bfloat16", load_progress=False,
              max_num_seqs=8, kv_cache_memory_gb=2.0, max_model_len=4096)
    engine = llm.engine
    greedy = SamplingParams(temperature=0, ignore_eos=True, max_tokens=128)
    out = {}
    for _ in range(2):  # warm-up, then measured
        engine.add_request([(1000 + i) % 128000 for i in range(128)], greedy)
        times = []
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        out["engine_step_ms_p50"] = round(statistics.median(times[2:]) * 1e3, 4)
    graph = engine.runner.graphs.graphs[1].graph
    out["graph_replay_ms_p50"] = replay_ms(graph, 100)
    out["min_split_tokens"] = min_split
    del llm, engine, graph
    torch.cuda.empty_cache()
    return out


def gemv_section() -> list[dict]:
    rows = []
    for n, k in ((3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)):
        # 8 weights (> L2 together) cycled through the graph's 16 calls
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(8)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        rows.append({"n": n, "k": k,
                     "linear_us": graph_us([lambda w=w, x=x: F.linear(x, w) for w in ws * 2]),
                     "matmul_us": graph_us([lambda w=w, x=x: x @ w.t() for w in ws * 2])})
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    args = p.parse_args()
    res = header("decode_step_probe")
    res["argmax"] = argmax_section()
    print(json.dumps(res["argmax"]))
    res["gemv"] = gemv_section()
    print(json.dumps(res["gemv"]))
    res["min_split"] = [engine_batch1(m) for m in (256, 64, 32)]
    print(json.dumps(res["min_split"]))
    with open(os.path.join(args.out, "decode_step_probe.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
