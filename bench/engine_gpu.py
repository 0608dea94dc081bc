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
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback

import numpy as np
import torch
from gpu_timing import replay_ms, timed

from mxserve import LLM, SamplingParams
from mxserve.worker.model.dummy import DUMMY_MODELS, DummySource

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = {"batch1_vs_roofline_max": 1.5, "mxfp4_vs_bf16_batch1_min": 2.5,
           "mix_vs_hf_min": 20.0, "prefix_on_vs_off_min": 3.0}
GREEDY = dict(temperature=0.0, ignore_eos=True)
TOP_P = dict(temperature=0.7, top_p=0.9, ignore_eos=True)


# ---- small helpers ---------------------------------------------------------------------------
def pct(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)), 3)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free() -> None:
    """Give the memory of engines the caller has dropped back to the device."""
    gc.unfreeze()  # make_llm froze the heap; let the dropped engines go
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def make_llm(args, shape: str, **options) -> tuple[LLM, float]:
    t0 = time.perf_counter()
    llm = LLM(model=shape, load_format="dummy", dtype="bfloat16", load_progress=False,
              device=args.device, max_model_len=args.max_model_len, **options)
    sync()
    gc.collect()
    gc.freeze()  # as a Serve worker does (cluster/worker.py): no full collections of the model
    return llm, round(time.perf_counter() - t0, 2)


def hf_config_dict(shape: str) -> dict:
    if shape in DUMMY_MODELS:
        return DUMMY_MODELS[shape]
    with open(os.path.join(shape, "config.json")) as f:
        return json.load(f)


def step_bytes(llm, bits: float, head_bits: float = 16) -> int:
    """Weight bytes one decode step reads: decoder linears at `bits` a weight (+ an E8M0 scale
    per 32 when MX) and the LM head at `head_bits` (bf16 unless `quantize_lm_head`); norms and
    the embedding row are negligible."""
    cfg = llm.engine.model_config
    per_layer = cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * cfg.hidden_size \
        + 3 * cfg.hidden_size * cfg.intermediate_size
    linears = per_layer * cfg.num_hidden_layers
    return int((linears * bits + cfg.vocab_size * cfg.hidden_size * head_bits) / 8)


# ---- sections --------------------------------------------------------------------------------
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
    res = {"load_s": load_s, "graph_capture_s": _capture_s(llm)}
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


def _capture_s(llm) -> float | None:
    graphs = llm.engine.runner.graphs
    return None if graphs is None else round(graphs.capture_seconds, 2)


def make_mix(n: int, vocab: int, max_len: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """ShareGPT-like lengths: prompt median 220, output median 150 (lognormal, sigma 0.9), clipped
    to 16..2048 and 8..1024 (or max_len/2 and max_len/4 when shorter: --quick)."""
    rng = np.random.default_rng(seed)
    ins = np.clip(rng.lognormal(np.log(220), 0.9, n), 16, min(2048, max_len // 2)).astype(int)
    outs = np.clip(rng.lognormal(np.log(150), 0.9, n), 8, min(1024, max_len // 4)).astype(int)
    prompts = [rng.integers(10, vocab - 10, k).tolist() for k in ins]
    return prompts, outs.tolist()


def run_mix(llm, prompts: list[list[int]], out_lens: list[int]) -> dict:
    """All requests at t=0; per-request TTFT/TPOT, pool occupancy every step."""
    engine = llm.engine
    requests = [engine.make_request(p, SamplingParams(max_tokens=k, **GREEDY))
                for p, k in zip(prompts, out_lens)]
    for r in requests:
        engine.add(r)
    ids = [r.request_id for r in requests]
    first, done, occupancy, fills, num_steps = {}, {}, [], [], 0
    phases, restore = time_phases(engine)
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter() - t0
        num_steps += 1
        for o in outputs:
            first.setdefault(o.request_id, now)
            if o.finished:
                done[o.request_id] = now
        stats = engine.stats()
        occupancy.append((stats.num_kv_blocks_used / engine.kv.num_blocks, stats.num_waiting))
        if num_steps % 16 == 0:
            fills.append(kv_fill(engine))
    wall = time.perf_counter() - t0
    restore()
    num_out = sum(out_lens)
    ttft = [first[i] * 1e3 for i in ids]
    tpot = [(done[i] - first[i]) * 1e3 / (k - 1) for i, k in zip(ids, out_lens) if k > 1]
    return {"num_requests": len(ids), "wall_s": round(wall, 3), "num_steps": num_steps,
            "output_tokens": num_out, "prompt_tokens": sum(map(len, prompts)),
            "output_tok_s": round(num_out / wall, 1),
            "total_tok_s": round((num_out + sum(map(len, prompts))) / wall, 1),
            "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99),
            "tpot_ms_p50": pct(tpot, 50), "tpot_ms_p99": pct(tpot, 99),
            "num_preemptions": sum(r.num_preemptions for r in requests),
            "kv_pool_blocks": engine.kv.num_blocks,
            "kv_occupancy_peak": round(max(o for o, _ in occupancy), 4),
            "kv_occupancy_mean_while_queued": _mean([o for o, w in occupancy if w > 0]),
            "kv_occupancy_mean": _mean([o for o, _ in occupancy]),
            "kv_fill_mean": _mean(fills), "graph_replays": _replays(llm),
            "phase_s": {k: round(v, 3) for k, v in phases.items()}}


def time_phases(engine) -> tuple[dict, object]:
    """Wall time spent in each part of engine.step(): schedule, execute (input copies and kernel
    launches; asynchronous), sample (launches too), complete (waits for the GPU, then appends
    tokens, checks stops, makes outputs). Returns (totals, restore)."""
    totals = {"schedule": 0.0, "execute": 0.0, "sample": 0.0, "complete": 0.0}
    targets = {"schedule": (engine.scheduler, "schedule"), "execute": (engine.runner, "execute"),
               "sample": (engine.sampler, "sample"), "complete": (engine, "_complete")}
    saved = {key: getattr(obj, name) for key, (obj, name) in targets.items()}
    for key, (obj, name) in targets.items():
        setattr(obj, name, timed(totals, key, saved[key]))

    def restore() -> None:
        for key, (obj, name) in targets.items():
            setattr(obj, name, saved[key])
    return totals, restore


def _mean(values: list[float]) -> float | None:
    return round(statistics.mean(values), 4) if values else None


def _replays(llm) -> int | None:
    graphs = llm.engine.runner.graphs
    return None if graphs is None else graphs.num_replays


def kv_fill(engine) -> float:
    """Tokens in the running requests' KV / slots of the distinct blocks they hold."""
    bs, fill = engine.kv.block_size, {}
    for r in engine.scheduler.running:
        for i, block in enumerate(engine.kv.get_block_ids(r.request_id)):
            fill[block] = max(fill.get(block, 0), min(bs, max(0, r.num_computed_tokens - i * bs)))
    return sum(fill.values()) / (len(fill) * bs) if fill else 0.0


def mix_section(args, shape: str) -> tuple[dict, LLM]:
    llm, load_s = make_llm(args, shape, max_num_seqs=args.max_num_seqs,
                           max_num_batched_tokens=args.max_batched_tokens,
                           kv_cache_memory_gb=args.kv_gb)
    vocab = llm.engine.model_config.vocab_size
    warm_p, warm_o = make_mix(min(64, args.num_requests), vocab, args.max_model_len, seed=1)
    run_mix(llm, warm_p, [min(k, 32) for k in warm_o])  # compiles, first-touch allocations
    prompts, outs = make_mix(args.num_requests, vocab, args.max_model_len)
    # The synchronous run gets the same lengths with every id shifted: its prompts leave no
    # prefix-cache hits for the measured run (a first version of this section reused them, and
    # the second run skipped most of its prefill).
    shifted = [[10 + (t - 9) % (vocab - 20) for t in p] for p in prompts]
    llm.engine.async_scheduling = False
    sync = run_mix(llm, shifted, outs)
    llm.engine.async_scheduling = True
    res = run_mix(llm, prompts, outs)
    res["sync"] = {k: sync[k] for k in ("wall_s", "output_tok_s", "ttft_ms_p50", "ttft_ms_p99",
                                        "tpot_ms_p50", "tpot_ms_p99", "phase_s")}
    res["async_vs_sync_tok_s"] = round(res["output_tok_s"] / sync["output_tok_s"], 3)
    res.update(load_s=load_s, graph_capture_s=_capture_s(llm),
               config=dict(max_num_seqs=args.max_num_seqs, kv_cache_memory_gb=args.kv_gb,
                           max_num_batched_tokens=args.max_batched_tokens,
                           max_model_len=args.max_model_len))
    return res, llm


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


def load_hf(args, shape: str):
    import transformers

    cfg = transformers.LlamaConfig(**hf_config_dict(shape))
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(args.device):
            model = transformers.LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    return model, cfg


def hf_section(args, shape: str, llm) -> dict:
    """HF generate at several batch sizes on our weights; greedy agreement on 4 prompts."""
    model, _ = load_hf(args, shape)
    state = model.state_dict()
    ours = llm.engine.runner
    source = DummySource(llm.engine.model_config, ours.device, torch.bfloat16, llm.config.seed)
    with torch.no_grad():
        for name, t in source.tensors():
            state[name].copy_(t)
    gen = torch.Generator().manual_seed(2)
    vocab = llm.engine.model_config.vocab_size
    res, new = {"batches": []}, args.hf_new_tokens

    def prompts(batch: int, prompt_len: int) -> torch.Tensor:
        return torch.randint(10, vocab - 10, (batch, prompt_len), generator=gen).to(args.device)

    hf_generate(model, prompts(2, 16), 4)  # warm-up
    for batch in args.hf_batches:
        ids = prompts(batch, args.hf_prompt_len)
        sync()
        t0 = time.perf_counter()
        hf_generate(model, ids, new)
        sync()
        wall = time.perf_counter() - t0
        res["batches"].append({"batch": batch, "wall_s": round(wall, 3),
                               "tok_s": round(batch * new / wall, 1)})
    best = max(res["batches"], key=lambda r: r["tok_s"])
    res.update(best_batch=best["batch"], best_tok_s=best["tok_s"], prompt_len=args.hf_prompt_len,
               new_tokens=new)
    checks = [prompts(1, n) for n in (7, 40, 99, 160)]
    hf_out = [hf_generate(model, ids, 32)[0].tolist() for ids in checks]
    our_out = [o.token_ids for o in llm.generate([ids[0].tolist() for ids in checks],
                                                 SamplingParams(max_tokens=32, **GREEDY))]
    res["greedy_matching_prefix"] = [common_prefix(a, b) for a, b in zip(our_out, hf_out)]
    del model, state
    free()
    return res


def hf_generate(model, ids: torch.Tensor, n: int) -> torch.Tensor:
    """Exactly n greedy new tokens for each row of ids [B, L] -> [B, n]."""
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
    return out[:, ids.shape[1]:]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_conversations(llm, system: list[int], users: list[list[list[int]]],
                      out_len: int) -> tuple[float, list[list[int]], int]:
    histories = [list(system) for _ in users]
    outputs, cached = [], 0
    t0 = time.perf_counter()
    for turn in range(len(users[0])):
        prompts = [h + u[turn] for h, u in zip(histories, users)]
        results = llm.generate(prompts, SamplingParams(max_tokens=out_len, **GREEDY))
        for h, p, r in zip(histories, prompts, results):
            h[:] = p + r.token_ids
        outputs += [r.token_ids for r in results]
        cached += sum(r.num_cached_tokens for r in results)
    return time.perf_counter() - t0, outputs, cached


def prefix_section(args, shape: str, llm_on) -> dict:
    vocab = llm_on.engine.model_config.vocab_size
    rng = np.random.default_rng(3)
    system = rng.integers(10, vocab - 10, args.system_len).tolist()
    users = [[rng.integers(10, vocab - 10, int(np.clip(rng.lognormal(np.log(64), 0.5), 16, 256)))
              .tolist() for _ in range(args.turns)] for _ in range(args.conversations)]
    res = {"system_len": args.system_len, "conversations": args.conversations,
           "turns": args.turns, "output_len": args.turn_out}
    wall_on, out_on, cached_on = run_conversations(llm_on, system, users, args.turn_out)
    free()
    llm_off, _ = make_llm(args, shape, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_batched_tokens,
                          kv_cache_memory_gb=args.kv_gb, enable_prefix_caching=False)
    run_conversations(llm_off, system[:64], [u[:1] for u in users[:8]], 8)  # warm-up
    wall_off, out_off, cached_off = run_conversations(llm_off, system, users, args.turn_out)
    del llm_off
    free()
    num_out = len(out_on) * args.turn_out
    res.update(on_wall_s=round(wall_on, 3), off_wall_s=round(wall_off, 3),
               on_output_tok_s=round(num_out / wall_on, 1),
               off_output_tok_s=round(num_out / wall_off, 1),
               on_cached_prompt_tokens=cached_on, off_cached_prompt_tokens=cached_off,
               speedup=round(wall_off / wall_on, 2),
               identical_outputs=sum(a == b for a, b in zip(out_on, out_off)),
               num_outputs=len(out_on),
               mean_matching_prefix=round(statistics.mean(
                   common_prefix(a, b) for a, b in zip(out_on, out_off)), 2))
    return res


def prefix_fp32_check(args, shape: str) -> dict:
    """Same outputs with prefix caching on and off, in float32 (bf16 runs of random weights part
    at near-ties of the logits, see the JSON): a smaller multi-turn run."""
    outs = {}
    for caching in (True, False):
        llm = LLM(model=shape, load_format="dummy", dtype="float32", load_progress=False,
                  device=args.device, max_model_len=args.max_model_len, max_num_seqs=16,
                  kv_cache_memory_gb=4.0, enable_prefix_caching=caching)
        vocab = llm.engine.model_config.vocab_size
        system = np.random.default_rng(4).integers(10, vocab - 10, args.system_len // 4).tolist()
        users = [[np.random.default_rng(10 * c + t).integers(10, vocab - 10, 24).tolist()
                  for t in range(2)] for c in range(16)]
        _, outs[caching], cached = run_conversations(llm, system, users, 32)
        outs[f"cached_{caching}"] = cached
        del llm
        free()
    return {"conversations": 16, "turns": 2, "output_len": 32, "system_len": args.system_len // 4,
            "cached_prompt_tokens_on": outs["cached_True"],
            "identical_outputs": sum(a == b for a, b in zip(outs[True], outs[False])),
            "num_outputs": len(outs[True])}


# ---- driver ----------------------------------------------------------------------------------
def environment(args) -> dict:
    import transformers
    import triton

    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor()
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return {"device": dev, "date": now,
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "triton": triton.__version__, "transformers": transformers.__version__,
                         "cuda": torch.version.cuda, "git_head_where_run": commit},
            "command": " ".join(["python", "bench/engine_gpu.py", *sys.argv[1:]])}


class Report:
    def __init__(self, args) -> None:
        self.args, self.t0 = args, time.perf_counter()
        self.data = {**environment(args), "targets": TARGETS, "sections": {}, "errors": {}}

    def run(self, name: str, fn, *a):
        if time.perf_counter() - self.t0 > self.args.deadline_s:
            self.data["errors"][name] = "skipped: past --deadline-s"
            return None
        print(f"[{time.perf_counter() - self.t0:7.1f}s] {name} ...", flush=True)
        try:
            out = fn(*a)
        except Exception:
            self.data["errors"][name] = traceback.format_exc()[-3000:]
            print(self.data["errors"][name], flush=True)
            return None
        result = out[0] if isinstance(out, tuple) else out
        self.data["sections"][name] = result
        print(json.dumps(result)[:600], flush=True)
        self.write()
        return out

    def write(self) -> None:
        self.data["elapsed_s"] = round(time.perf_counter() - self.t0, 1)
        self.data["summary"] = summary(self.data["sections"])
        os.makedirs(self.args.out, exist_ok=True)
        with open(os.path.join(self.args.out, "engine_gpu.json"), "w") as f:
            json.dump(self.data, f, indent=1)
        with open(os.path.join(self.args.out, "engine_gpu.md"), "w") as f:
            f.write(markdown(self.data))


def summary(s: dict) -> dict:
    out = {}
    for shape in ("1b", "8b"):
        bf, mx = s.get(f"{shape}_bf16_batch1"), s.get(f"{shape}_mxfp4_batch1")
        if bf:
            out[f"{shape}_bf16_step_vs_roofline"] = bf.get("engine_step_vs_roofline")
            out[f"{shape}_bf16_graph_replay_vs_roofline"] = bf.get("graph_replay_vs_roofline")
        if bf and mx:
            out[f"{shape}_mxfp4_speedup_vs_bf16_step"] = round(
                bf["engine_step_ms_p50"] / mx["engine_step_ms_p50"], 3)
        head = s.get(f"{shape}_mxfp4_head_batch1")
        if bf and head:  # quantize_lm_head
            out[f"{shape}_mxfp4_head_speedup_vs_bf16_step"] = round(
                bf["engine_step_ms_p50"] / head["engine_step_ms_p50"], 3)
    if s.get("1b_mix") and s.get("1b_hf"):
        out["1b_mix_vs_hf_best"] = round(s["1b_mix"]["output_tok_s"] / s["1b_hf"]["best_tok_s"], 2)
    if s.get("1b_prefix"):
        out["1b_prefix_on_vs_off"] = s["1b_prefix"]["speedup"]
    met = {"batch1_vs_roofline": ("1b_bf16_step_vs_roofline", "<=", "batch1_vs_roofline_max"),
           "mxfp4_vs_bf16_batch1": ("1b_mxfp4_speedup_vs_bf16_step", ">=",
                                    "mxfp4_vs_bf16_batch1_min"),
           "mix_vs_hf": ("1b_mix_vs_hf_best", ">=", "mix_vs_hf_min"),
           "prefix_on_vs_off": ("1b_prefix_on_vs_off", ">=", "prefix_on_vs_off_min")}
    out["targets_met"] = {k: (out[v] <= TARGETS[t] if op == "<=" else out[v] >= TARGETS[t])
                          for k, (v, op, t) in met.items() if out.get(v) is not None}
    return out


def markdown(d: dict) -> str:
    s, summ = d["sections"], d["summary"]
    lines = [f"# engine_gpu ({d['device']}, {d['date']})", "", f"`{d['command']}`; torch "
             f"{d['versions']['torch']}, triton {d['versions']['triton']}, transformers "
             f"{d['versions']['transformers']}. Dummy weights (N(0, 0.02)), bf16 activations.", ""]
    if "copy_bandwidth" in s:
        lines.append(f"Copy bandwidth: {s['copy_bandwidth']['tb_per_s']} TB/s (1 GiB d2d, r+w).")
    lines += ["", "| batch-1 decode | roofline ms | graph replay ms | engine step ms | "
              "sync engine step ms | eager step ms | step / roofline |",
              "|---|---|---|---|---|---|---|"]
    for key in ("1b_bf16_batch1", "1b_mxfp4_batch1", "1b_mxfp4_head_batch1", "8b_bf16_batch1",
                "8b_mxfp4_batch1", "8b_mxfp4_head_batch1"):
        r = s.get(key)
        if r:
            lines.append(f"| {key} | {r['roofline_ms']} | {r.get('graph_replay_ms_p50')} | "
                         f"{r['engine_step_ms_p50']} | {r.get('sync_engine_step_ms_p50')} | "
                         f"{r.get('eager_step_ms_p50')} | {r.get('engine_step_vs_roofline')} |")
    for key in ("1b_mix", "8b_mix"):
        if not s.get(key):
            continue
        m = s[key]
        lines += ["", (
            f"Mix ({key[:2].upper()} bf16, {m['num_requests']} requests at once, "
            f"{m['output_tokens']} output tokens): {m['output_tok_s']} output tok/s "
            f"({m['total_tok_s']} incl. prompts); TTFT p50/p99 {m['ttft_ms_p50']}/"
            f"{m['ttft_ms_p99']} ms; TPOT p50/p99 {m['tpot_ms_p50']}/{m['tpot_ms_p99']} ms; "
            f"KV pool occupancy peak {m['kv_occupancy_peak']}, mean while requests queued "
            f"{m['kv_occupancy_mean_while_queued']}; block fill {m['kv_fill_mean']}; "
            f"preemptions {m['num_preemptions']}.")]
        lines += [f"Time in engine.step() parts over the mix (s): {m.get('phase_s')} (execute "
                  "and sample launch asynchronously; complete waits for the GPU)."]
        if m.get("sync"):
            lines += [f"Async scheduling off, same requests: {m['sync']['output_tok_s']} output "
                      f"tok/s (async: {m['async_vs_sync_tok_s']}x), TPOT p50/p99 "
                      f"{m['sync']['tpot_ms_p50']}/{m['sync']['tpot_ms_p99']} ms."]
    for key, what in (("1b_decode_sweep", "greedy"),
                      ("1b_decode_sweep_eager_sampler",
                       "greedy, the argmax kernels launched one by one"),
                      ("1b_decode_sweep_top_p", "temperature 0.7, top_p 0.9"),
                      ("1b_decode_sweep_top_p_eager_sampler",
                       "temperature 0.7, top_p 0.9, the sampler's kernels launched one by one"),
                      ("1b_decode_sweep_top_p_host",
                       "temperature 0.7, top_p 0.9, cutoff checked from the host")):
        if not s.get(key):
            continue
        lines += ["", f"Decode sweep ({what}):", "", "| decode batch | engine step ms, async | "
                  "sync | graph replay ms (padded size) | async: schedule / execute / sample / "
                  "complete ms (mean) |", "|---|---|---|---|---|"]
        lines += [f"| {r['batch']} | {r['engine_step_ms_p50']} | "
                  f"{r.get('sync_engine_step_ms_p50')} | {r.get('graph_replay_ms_p50')} "
                  f"({r.get('graph_size')}) | "
                  f"{' / '.join(str(v) for v in r.get('phase_ms_mean', {}).values())} |"
                  for r in s[key]["rows"]]
    if s.get("1b_hf"):
        h = s["1b_hf"]
        rows = ", ".join(f"b{r['batch']}: {r['tok_s']}" for r in h["batches"])
        lines += ["", f"HF generate (same weights, {h['prompt_len']}-token prompts, "
                  f"{h['new_tokens']} new): {rows} tok/s; greedy matching prefix vs ours (of 32): "
                  f"{h['greedy_matching_prefix']}."]
        if s.get("1b_mix"):
            ratios = ", ".join(f"b{r['batch']}: {s['1b_mix']['output_tok_s'] / r['tok_s']:.1f}x"
                               for r in h["batches"])
            lines.append(f"Our mix output tok/s over HF's at each batch size: {ratios}.")
    if s.get("1b_prefix"):
        p = s["1b_prefix"]
        lines += ["", f"Prefix caching ({p['system_len']}-token system prompt, "
                  f"{p['conversations']} conversations x {p['turns']} turns): on "
                  f"{p['on_wall_s']} s, off {p['off_wall_s']} s -> {p['speedup']}x; identical "
                  f"outputs {p['identical_outputs']}/{p['num_outputs']} (bf16; mean matching "
                  f"prefix {p.get('mean_matching_prefix')} of {p['output_len']} tokens)."]
    if s.get("1b_prefix_fp32"):
        f = s["1b_prefix_fp32"]
        lines += [f"Same in float32 ({f['conversations']} conversations x {f['turns']} turns, "
                  f"{f['system_len']}-token system prompt): identical outputs "
                  f"{f['identical_outputs']}/{f['num_outputs']}."]
    lines += ["", "| ratio | value | target | met |", "|---|---|---|---|"]
    names = {"batch1_vs_roofline": ("1b_bf16_step_vs_roofline", "<= 1.5"),
             "mxfp4_vs_bf16_batch1": ("1b_mxfp4_speedup_vs_bf16_step", ">= 2.5"),
             "mix_vs_hf": ("1b_mix_vs_hf_best", ">= 20"),
             "prefix_on_vs_off": ("1b_prefix_on_vs_off", ">= 3")}
    for k, (v, target) in names.items():
        lines.append(f"| {v} | {summ.get(v)} | {target} | {summ['targets_met'].get(k)} |")
    if d["errors"]:
        lines += ["", "Sections that failed or were skipped: " + ", ".join(d["errors"])]
    return "\n".join(lines) + "\n"


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
