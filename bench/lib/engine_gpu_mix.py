"""bench/engine_gpu.py's mix section: ShareGPT-like request lengths all at t=0, throughput,
TTFT and time per output token, KV occupancy; and the per-phase timing of engine.step()."""

from __future__ import annotations

import time

import numpy as np
from engine_gpu_common import GREEDY, capture_s, graph_replays, make_llm, mean_or_none, pct
from gpu_timing import timed

from mxserve import LLM, SamplingParams


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
            "kv_occupancy_mean_while_queued": mean_or_none([o for o, w in occupancy if w > 0]),
            "kv_occupancy_mean": mean_or_none([o for o, _ in occupancy]),
            "kv_fill_mean": mean_or_none(fills), "graph_replays": graph_replays(llm),
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
    res.update(load_s=load_s, graph_capture_s=capture_s(llm),
               config=dict(max_num_seqs=args.max_num_seqs, kv_cache_memory_gb=args.kv_gb,
                           max_num_batched_tokens=args.max_batched_tokens,
                           max_model_len=args.max_model_len))
    return res, llm
