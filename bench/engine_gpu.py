"""GPU engine benchmark (H200): mxserve on dummy Llama-shaped weights vs the roofline and vs HF.

Every model is `load_format="dummy"` (worker/model/dummy.py): random N(0, 0.02) weights of the
Llama-3.2-1B shape (2048 hidden, 16 layers, 32/8 heads, 8192 MLP, 128256 vocab, tied LM head) and,
with `--shapes ... llama-3-8b`, of Llama-3-8B; token-id prompts, greedy, EOS ignored. Sections, in
order, each written to the JSON as soon as it ends (a failing one records its error):

- copy bandwidth: a 1 GiB device-to-device copy, bytes read + written / median time.
- batch-1 decode (bf16, then MXFP4): one request, 128-token prompt, 256 tokens. "graph replay" is
  the GPU time of the captured batch-1 decode graph replayed with the last step's real inputs (CUDA
  events, median of 200); "engine step" is the wall time of `engine.step()` for decode steps
  (schedule + inputs + replay + sampling + bookkeeping; median), with async scheduling (the
  default on CUDA: the host's work for a step overlaps the device's for the next) and without it
  (`async_scheduling=False`, the same engine, in the same run); "eager step" the same with
  `enforce_eager=True`. Roofline = bytes of weights a decode step reads (every decoder linear and
  the LM head; bf16 2 bytes, MXFP4 4.25 bits a weight) / the measured copy bandwidth.
  Section `mxhead` (not in the default list): MXFP4 with `quantize_lm_head`, the LM head MXFP4 too.
- mix (bf16): 512 requests all at t=0, lognormal prompt (median 220, sigma 0.9, 16..2048) and
  output (median 150, sigma 0.9, 8..1024) lengths: output tok/s over the whole run, TTFT and time
  per output token p50/p99 (per request: (finish - first token) / (outputs - 1)), preemptions, KV
  pool occupancy (blocks held / pool, every step) and fill (tokens in held blocks / their slots).
  Before it, the same lengths with other token ids (no prefix hits for the measured run) with
  async scheduling off, on the same engine, for the ratio.
- HF: transformers `LlamaForCausalLM` (sdpa, bf16) with the same weights (the same DummySource
  stream copied into its state dict), `generate` greedy with min_new_tokens = max_new_tokens = 64
  on 256-token prompts at several batch sizes (no padding: the most favourable case for HF); its
  best tok/s is the baseline for the mix. The same weights check: greedy tokens of HF vs ours on 4
  prompts (bf16, so they may part after a near-tie).
- decode sweep (bf16): steady decode steps at batch 1 .. 512 (256-token prompts): engine step
  wall time with async scheduling on and off (then again at a few batch sizes with temperature
  0.7 and top_p 0.9, then with the sampler's kernels launched one by one instead of its CUDA
  graph, then top_p with its cutoff checked from the host, which waits for the GPU),
  and the GPU time of the graph replayed
  with that step's inputs (host overhead = the difference). The mix also records the wall time
  inside each part of engine.step().
- prefix caching (bf16): a shared 2048-token system prompt, 64 conversations x 4 turns, each turn
  a lognormal (median 64) user message + 64 output tokens appended to the history; a turn's 64
  requests are submitted together once the previous turn has finished. Run with prefix caching on
  (a fresh engine) and off; throughput = output tokens / wall time; outputs compared token by token.
  Random bf16 weights give logits with near-ties, where any rounding difference (a cached KV
  computed in another batch) flips a greedy token; so the same comparison also runs in float32
  on a smaller workload (16 conversations x 2 turns, a 512-token system prompt).

Run on the GPU machine:  python bench/engine_gpu.py --out DIR     (writes DIR/engine_gpu.json, .md)
Smoke test on a CPU:     python bench/engine_gpu.py --shapes /path/to/config_dir --quick --out DIR
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))

from engine_gpu_common import (  # noqa: E402
    GREEDY,
    REPO,
    TOP_P,
    capture_s,
    free,
    make_llm,
    pct,
    step_bytes,
    sync,
)
from engine_gpu_hf import hf_section, prefix_fp32_check, prefix_section  # noqa: E402
from engine_gpu_mix import mix_section, time_phases  # noqa: E402
from engine_gpu_report import Report, markdown  # noqa: E402
from gpu_timing import replay_ms  # noqa: E402

from mxserve import SamplingParams  # noqa: E402


def copy_bandwidth(args) -> dict:
    n = (2**30 if not args.quick else 2**24) // 2
    src = torch.randn(n, device=args.device).to(torch.bfloat16)
    dst = torch.empty_like(src)
    times = []
    for i in range(25):
        sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        if i >= 5:
            times.append(time.perf_counter() - t0)
    assert torch.equal(dst, src)
    t = statistics.median(times)
    return {"bytes": 2 * src.numel() * 2, "median_s": t, "tb_per_s": round(4 * n / t / 1e12, 3)}


def decode_batch1(args, llm, num_tokens: int, async_scheduling: bool = True) -> dict:
    """Engine decode step times of one request, then graph replays with its last inputs."""
    engine = llm.engine
    engine.async_scheduling = async_scheduling
    vocab = engine.model_config.vocab_size
    prompt = [(1000 + i) % vocab for i in range(128)]
    engine.add_request(prompt, SamplingParams(max_tokens=num_tokens, **GREEDY))
    times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    out = {"engine_step_ms_p50": round(statistics.median(times[2:]) * 1e3, 4),
           "engine_step_ms_p90": pct([t * 1e3 for t in times[2:]], 90),
           "num_steps": len(times), "prefill_step_ms": round(times[0] * 1e3, 3)}
    graphs = engine.runner.graphs
    if graphs is not None and graphs.last_size == 1:  # the last step's graph, as it ran
        out["graph_replay_ms_p50"] = replay_ms(graphs.graphs[1].graph, 200)
    return out


def batch1_section(args, shape: str, bw: float, quant: str | None, head: bool = False) -> dict:
    """head: `quantize_lm_head` (the LM head in `quant` too)."""
    llm, load_s = make_llm(args, shape, quantization=quant, max_num_seqs=8,
                           kv_cache_memory_gb=2.0, quantize_lm_head=head)
    res = {"load_s": load_s, "graph_capture_s": capture_s(llm)}
    decode_batch1(args, llm, 16)  # warm-up
    sync = decode_batch1(args, llm, args.batch1_tokens, async_scheduling=False)
    res.update(decode_batch1(args, llm, args.batch1_tokens))
    res["sync_engine_step_ms_p50"] = sync["engine_step_ms_p50"]
    res["async_vs_sync_step"] = round(sync["engine_step_ms_p50"] / res["engine_step_ms_p50"], 3)
    bits = 16 if quant is None else 4.25
    res["weight_bytes_per_step"] = step_bytes(llm, bits, bits if head else 16)
    res["roofline_ms"] = round(res["weight_bytes_per_step"] / (bw * 1e12) * 1e3, 4)
    for key in ("graph_replay_ms_p50", "engine_step_ms_p50"):
        if key in res:
            res[key.replace("_ms_p50", "_vs_roofline")] = round(res[key] / res["roofline_ms"], 3)
    del llm
    free()
    eager, _ = make_llm(args, shape, quantization=quant, max_num_seqs=8, kv_cache_memory_gb=2.0,
                        enforce_eager=True, quantize_lm_head=head)
    decode_batch1(args, eager, 16)
    res["eager_step_ms_p50"] = decode_batch1(args, eager, 64)["engine_step_ms_p50"]
    if quant is None and torch.cuda.is_available():
        res["eager_kernels_per_step"] = kernel_profile(eager.engine, 8)
    del eager
    free()
    return res


def kernel_profile(engine, num_steps: int) -> dict:
    """GPU time per eager batch-1 decode step by kernel (torch.profiler): where the step's time
    goes beyond reading the weights. The graph runs the same kernels (attention: more splits)."""
    from torch.profiler import ProfilerActivity, profile

    vocab = engine.model_config.vocab_size
    engine.add_request([(2000 + i) % vocab for i in range(200)],
                       SamplingParams(max_tokens=num_steps + 2, **GREEDY))
    engine.step()  # the prefill
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(num_steps):
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us > 0:
            rows.append({"kernel": e.key[:90], "calls_per_step": e.count / num_steps,
                         "us_per_step": round(us / num_steps, 1)})
    rows.sort(key=lambda r: -r["us_per_step"])
    return {"total_us_per_step": round(sum(r["us_per_step"] for r in rows), 1),
            "num_kernels_per_step": sum(r["calls_per_step"] for r in rows), "top": rows[:20]}


def decode_sweep(args, llm, sampling: dict = GREEDY, batches: list[int] | None = None) -> dict:
    """Steady decode steps at fixed batch sizes (256-token prompts): engine step wall time with
    async scheduling off, then on, its parts (time_phases; "complete" includes waiting for the
    GPU), and the GPU time of that batch's graph replayed with the last step's inputs."""
    engine, rows = llm.engine, []
    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(5)
    for batch in batches or args.sweep_batches:
        ids = [engine.add_request(rng.integers(10, vocab - 10, 256).tolist(),
                                  SamplingParams(max_tokens=96, **sampling)) for _ in range(batch)]
        while engine.scheduler.waiting or any(engine.requests[i].num_output_tokens < 4
                                              for i in ids):
            engine.step()
        row = {"batch": batch}
        for mode in (False, True):  # sync, then async
            engine.async_scheduling = mode
            engine.step()  # into the mode's steady state
            times = []
            phases, restore = time_phases(engine)
            try:
                for _ in range(20):
                    t0 = time.perf_counter()
                    engine.step()
                    times.append((time.perf_counter() - t0) * 1e3)
            finally:
                restore()
            key = "" if mode else "sync_"
            row[f"{key}engine_step_ms_p50"] = round(statistics.median(times), 3)
            row[f"{key}phase_ms_mean"] = {k: round(v / 20 * 1e3, 3) for k, v in phases.items()}
        graphs = engine.runner.graphs
        if graphs is not None and graphs.last_size is not None:
            # the graph the last step replayed, with its inputs: another size would read the
            # shared token buffer in its own layout (positions where slots were: out of range)
            row["graph_size"] = graphs.last_size
            row["graph_replay_ms_p50"] = replay_ms(graphs.graphs[graphs.last_size].graph, 20)
        rows.append(row)
        for i in ids:
            engine.abort(i)
    return {"rows": rows}


def eager_sampler_sweep(args, llm, sampling: dict = GREEDY,
                        batches: list[int] | None = None) -> dict:
    """A decode sweep again with the sampler's kernels launched one by one (its `graphs` off,
    as EngineConfig(sample_graphs=False): no SampleGraph, no ArgmaxGraph), the baseline of
    its graphs."""
    sampler = llm.engine.sampler
    keep, sampler.graphs = sampler.graphs, False
    try:
        return decode_sweep(args, llm, sampling, batches)
    finally:
        sampler.graphs = keep


def top_p_host_sweep(args, llm) -> dict:
    """The top_p sweep again with top_p's cutoff checked from the host (the sampler's
    top_p_on_device off, as EngineConfig(top_p_on_device=False): it waits for the device each
    step), the baseline of the default, decided on the device."""
    sampler = llm.engine.sampler
    keep, sampler.top_p_on_device = sampler.top_p_on_device, False
    try:
        return decode_sweep(args, llm, TOP_P, args.top_p_batches)
    finally:
        sampler.top_p_on_device = keep


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results"))
    p.add_argument("--shapes", default="llama-3.2-1b", help="comma list; first = the 1b role")
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="tiny counts: a smoke test")
    p.add_argument("--sections", default="batch1,mx,mix,sweep,prefix,hf,mix8b")
    p.add_argument("--sweep-batches", default="1,8,32,64,128,256,512")
    p.add_argument("--top-p-batches", default="1,64,256", help="the sweep again, top_p 0.9")
    p.add_argument("--deadline-s", type=float, default=480)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=512)
    p.add_argument("--max-batched-tokens", type=int, default=8192)
    p.add_argument("--kv-gb", type=float, default=16.0)
    p.add_argument("--num-requests", type=int, default=512)
    p.add_argument("--batch1-tokens", type=int, default=256)
    p.add_argument("--hf-batches", default="1,32,64,128,256,512")
    p.add_argument("--hf-prompt-len", type=int, default=256)
    p.add_argument("--hf-new-tokens", type=int, default=64)
    p.add_argument("--system-len", type=int, default=2048)
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--turn-out", type=int, default=64)
    args = p.parse_args()
    args.hf_batches = [int(b) for b in args.hf_batches.split(",")]
    args.sweep_batches = [int(b) for b in args.sweep_batches.split(",")]
    args.top_p_batches = [int(b) for b in args.top_p_batches.split(",")]
    if args.quick:
        args.__dict__.update(max_model_len=1024, max_num_seqs=16, kv_gb=0.05, num_requests=24,
                             batch1_tokens=12, hf_batches=[1, 4], hf_prompt_len=16,
                             hf_new_tokens=4, system_len=64, conversations=4, turns=2, turn_out=4,
                             sweep_batches=[1, 4], top_p_batches=[2])
    return args


def main() -> None:
    args = parse_args()
    report = Report(args)
    sections = args.sections.split(",")
    bw = report.run("copy_bandwidth", copy_bandwidth, args)
    bw = bw["tb_per_s"] if bw else 4.27
    for role, shape in zip(("1b", "8b"), args.shapes.split(",")):
        report.data.setdefault("shapes", {})[role] = shape
        if "batch1" in sections:
            report.run(f"{role}_bf16_batch1", batch1_section, args, shape, bw, None)
        if "mx" in sections:
            report.run(f"{role}_mxfp4_batch1", batch1_section, args, shape, bw, "mxfp4")
        if "mxhead" in sections:
            report.run(f"{role}_mxfp4_head_batch1", batch1_section, args, shape, bw, "mxfp4", True)
        if role != "1b":
            if "mix8b" in sections:
                mixed = report.run(f"{role}_mix", mix_section, args, shape)
                del mixed
                free()
            continue
        mixed = report.run("1b_mix", mix_section, args, shape) if "mix" in sections else None
        llm = mixed[1] if mixed else None
        del mixed
        if llm is not None and "sweep" in sections:
            report.run("1b_decode_sweep", decode_sweep, args, llm)
            report.run("1b_decode_sweep_top_p", decode_sweep, args, llm, TOP_P,
                       args.top_p_batches)
            report.run("1b_decode_sweep_eager_sampler", eager_sampler_sweep, args, llm)
            report.run("1b_decode_sweep_top_p_eager_sampler", eager_sampler_sweep, args, llm,
                       TOP_P, args.top_p_batches)
            report.run("1b_decode_sweep_top_p_host", top_p_host_sweep, args, llm)
        if llm is not None and "prefix" in sections:
            report.run("1b_prefix", prefix_section, args, shape, llm)
            report.run("1b_prefix_fp32", prefix_fp32_check, args, shape)
        if llm is not None and "hf" in sections:
            report.run("1b_hf", hf_section, args, shape, llm)
        del llm
        free()
    report.write()
    print(markdown(report.data))


if __name__ == "__main__":
    main()
