"""H2O's cost on the GPU (issue 25): a decode step with attention-mass accumulation vs without,
on the H200, 1B-shaped dummy bf16 weights (llama-3.2-1b: 16 layers, 32 query / 8 KV heads of
64, block 16), 4k context, batch 1 and 64, CUDA graphs on both sides. One run, side by side:

- bound: bytes a decode step must read (weights + K/V) and what the mass adds, both ways: a
  second pass over K (+ K's bytes again) or folded into the decode kernel (a fp32 score per
  position and query head written and read back, plus the mass row read and written a layer),
  over the copy bandwidth measured here: the ratio no implementation of that design beats.
- kernel: the decode attention of all 16 layers (each its own cache, so nothing is served
  from L2 that a real step would read from memory), in one CUDA graph, median of its replays:
  no mass; mass folded into the kernel (the shipped path), its stored p in float32 and in
  float16 (paged_attention.SCORES_DTYPE); mass by the second pass over K
  (`_launch(fold_mass=False)`, what decode used before). Each mass variant is first checked
  against the torch reference (max |mass - ref|).
- engine: `LLM` per variant, requests of a `--context`-token random prompt decoding: plain;
  kv_eviction="h2o" with a budget past the context (scores accumulate every step, nothing is
  compacted while timed: the scoring alone), with float32 and float16 p; "h2o" with the
  budget at the prompt length (a compaction every 16 tokens, i.e. every 16 steps: its
  amortised cost is the mean step over a whole number of rounds minus the non-compacting
  median). Per batch: `engine.step()` wall time over `--steps` decode steps (async scheduling,
  the CUDA default; median and mean) and the device time of the last step's decode graph
  replayed with its inputs (median of 50).

Run on the GPU machine:  python bench/h2o_gpu.py --out $OUT     (~2 min; writes h2o_gpu.json, .md)
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))

from gpu_timing import header, replay_ms  # noqa: E402
from revision import write_result  # noqa: E402

from mxserve import LLM, SamplingParams  # noqa: E402
from mxserve.kernels import paged_attention  # noqa: E402
from mxserve.kernels.paged_attention import (  # noqa: E402
    _decode_splits,
    _launch,
    paged_decode_attention,
    paged_decode_attention_torch,
)
from mxserve.worker.model.dummy import DUMMY_MODELS  # noqa: E402

SHAPE = "llama-3.2-1b"
TARGET = 1.10  # decode step with scores / without


def copy_tbps() -> float:
    src = torch.randn(2**29, device="cuda").to(torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(20):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return 2 * 2 * src.numel() / (statistics.median(times[5:]) * 1e-3) / 1e12


def bound(context: int, batches: list[int], tbps: float) -> dict:
    cfg = DUMMY_MODELS[SHAPE]
    layers, hq = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    hkv = cfg["num_key_value_heads"]
    d, hidden, inter, vocab = cfg["head_dim"], cfg["hidden_size"], cfg["intermediate_size"], \
        cfg["vocab_size"]
    weights = 2 * (layers * (hidden * (hq + 2 * hkv) * d + hq * d * hidden + 3 * hidden * inter)
                   + vocab * hidden)
    rows = []
    for b in batches:
        kv = b * context * layers * 2 * hkv * d * 2  # K and V, bf16
        second = b * context * layers * hkv * d * 2  # K again
        folded = b * context * layers * (hq * 4 * 2 + 4 * 2)  # scores w + r, mass row r + w
        base = weights + kv
        rows.append({"batch": b, "weight_bytes": weights, "kv_bytes": kv,
                     "second_pass_extra_bytes": second, "folded_extra_bytes": folded,
                     "floor_ms": round(base / tbps / 1e9, 4),
                     "second_pass_ratio_bound": round((base + second) / base, 4),
                     "folded_ratio_bound": round((base + folded) / base, 4)})
    return {"copy_TBps": round(tbps, 3), "context": context, "rows": rows}


def kernel_section(context: int, width: int, batches: list[int]) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for b in batches:
        rows.append(_kernel_row(b, context, width, gen))
        print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    return rows


def _kernel_row(b: int, context: int, width: int, gen) -> dict:
    cfg = DUMMY_MODELS[SHAPE]
    layers, hq, hkv, d, bs = cfg["num_hidden_layers"], cfg["num_attention_heads"], \
        cfg["num_key_value_heads"], cfg["head_dim"], 16
    nblk = b * -(-width // bs)
    caches = [(torch.randn(nblk, bs, hkv, d, generator=gen, device="cuda").bfloat16(),
               torch.randn(nblk, bs, hkv, d, generator=gen, device="cuda").bfloat16())
              for _ in range(layers)]
    tables = torch.randperm(nblk, generator=gen, device="cuda").to(torch.int32).view(b, -1)
    lens = torch.full((b,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(b, hq, d, generator=gen, device="cuda").bfloat16()
    out = torch.empty_like(q)
    mass = torch.zeros(b, width, device="cuda")
    splits = _decode_splits(b, hkv, width, q.device)

    def attend(kc, vc, variant):
        if variant == "none":
            paged_decode_attention(q, kc, vc, tables, lens, out=out, max_seq_len=width)
        elif variant.startswith("folded"):
            with scores_dtype(torch.float16 if variant == "folded_fp16" else torch.float32):
                paged_decode_attention(q, kc, vc, tables, lens, out=out, max_seq_len=width,
                                       return_attn_mass=True, mass=mass)
        else:
            _launch(q, kc, vc, (tables, lens, lens, lens), out, d ** -0.5, width,
                    is_decode=True, num_splits=splits, max_query_len=1, mass=mass,
                    fold_mass=False)

    def step(variant):
        if variant != "none":
            mass.zero_()
        for kc, vc in caches:
            attend(kc, vc, variant)

    row = {"batch": b, "num_splits": splits}
    _, want = paged_decode_attention_torch(q, *caches[0], tables, lens, return_attn_mass=True,
                                           max_seq_len=width)
    for variant in ("folded", "folded_fp16", "second_pass"):
        mass.zero_()
        attend(*caches[0], variant)
        row[f"{variant}_max_abs_err"] = float((mass - want).abs().max())
        row[f"{variant}_max_rel_err"] = float(((mass - want).abs() / want.clamp_min(1e-3)).max())
    for variant in ("none", "folded", "folded_fp16", "second_pass"):
        row[f"{variant}_us"] = round(_graph_median_ms(lambda v=variant: step(v)) * 1e3, 2)
    row["folded_over_none"] = round(row["folded_us"] / row["none_us"], 4)
    row["folded_fp16_over_none"] = round(row["folded_fp16_us"] / row["none_us"], 4)
    row["second_pass_over_none"] = round(row["second_pass_us"] / row["none_us"], 4)
    row["folded_over_second_pass"] = round(row["folded_us"] / row["second_pass_us"], 4)
    return row


class scores_dtype:
    """The folded mass's stored-p dtype (paged_attention.SCORES_DTYPE) inside the block."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def __enter__(self):
        self.saved, paged_attention.SCORES_DTYPE = paged_attention.SCORES_DTYPE, self.dtype

    def __exit__(self, *exc):
        paged_attention.SCORES_DTYPE = self.saved


def _graph_median_ms(fn, reps: int = 100) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return replay_ms(graph, reps)


def _max_len(args) -> int:
    """Prompt + the tokens a request decodes: while the batch's later prompts prefill (8192
    tokens a step), the timed steps and a margin."""
    return args.context + -(-max(args.batches) * args.context // 8192) + args.steps + 32


def engine_section(args, name: str, options: dict) -> list[dict]:
    with scores_dtype(torch.float16 if name.endswith("_fp16") else torch.float32):
        return _engine_rows(args, name, options)


def _engine_rows(args, name: str, options: dict) -> list[dict]:
    llm = LLM(model=SHAPE, load_format="dummy", dtype="bfloat16", load_progress=False,
              max_model_len=_max_len(args), max_num_seqs=max(args.batches),
              max_num_batched_tokens=8192, kv_cache_memory_gb=args.kv_gb, **options)
    engine, rng, rows = llm.engine, np.random.default_rng(1), []
    vocab = engine.model_config.vocab_size
    for b in args.batches:
        ids = [engine.add_request(rng.integers(10, vocab - 10, args.context).tolist(),
                                  SamplingParams(temperature=0, ignore_eos=True,
                                                 max_tokens=_max_len(args) - args.context))
               for _ in range(b)]
        while engine.scheduler.waiting or any(engine.requests[i].num_output_tokens < 3
                                              for i in ids):
            engine.step()
        evicted = engine.evictor.num_evicted_tokens if engine.evictor else 0
        torch.cuda.synchronize()
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            engine.step()
            times.append((time.perf_counter() - t0) * 1e3)
        graphs = engine.runner.graphs
        row = {"variant": name, "batch": b, "steps": len(times),
               "engine_step_ms_p50": round(statistics.median(times), 4),
               "engine_step_ms_mean": round(statistics.mean(times), 4),
               "graph_replays": graphs.num_replays,
               "held_tokens": engine.requests[ids[0]].num_computed_tokens
               - engine.requests[ids[0]].num_evicted,
               "evicted_while_timed": (engine.evictor.num_evicted_tokens - evicted)
               if engine.evictor else 0}
        if graphs.last_size is not None:
            row["graph_size"] = graphs.last_size
            row["graph_replay_ms_p50"] = replay_ms(graphs.graphs[graphs.last_size].graph, 50)
        print(row, flush=True)
        rows.append(row)
        for i in ids:
            engine.abort(i)
        engine.step()
    del llm, engine
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def summarise(result: dict) -> None:
    by = {(r["variant"], r["batch"]): r for r in result["engine"]}
    bound_row = {r["batch"]: r for r in result["bound"]["rows"]}
    ratios, targets = {}, {}
    for b in result["batches"]:
        plain, h2o, comp = by["plain", b], by["h2o", b], by["h2o_compacting", b]
        fp16 = by["h2o_fp16", b]
        ratios[f"b{b}"] = {
            "step_p50_h2o_fp16_over_plain": round(fp16["engine_step_ms_p50"]
                                                  / plain["engine_step_ms_p50"], 4),
            "replay_h2o_fp16_over_plain": round(fp16["graph_replay_ms_p50"]
                                                / plain["graph_replay_ms_p50"], 4),
            "step_p50_h2o_over_plain": round(h2o["engine_step_ms_p50"]
                                             / plain["engine_step_ms_p50"], 4),
            "replay_h2o_over_plain": round(h2o["graph_replay_ms_p50"]
                                           / plain["graph_replay_ms_p50"], 4),
            "compaction_amortised_ms_per_step": round(comp["engine_step_ms_mean"]
                                                      - h2o["engine_step_ms_p50"], 4),
            "step_mean_compacting_over_plain": round(comp["engine_step_ms_mean"]
                                                     / plain["engine_step_ms_mean"], 4),
            # what scoring added to the replayed step vs what its bytes alone must cost
            "replay_extra_ms": round(h2o["graph_replay_ms_p50"] - plain["graph_replay_ms_p50"],
                                     4),
            "folded_extra_floor_ms": round(bound_row[b]["folded_extra_bytes"]
                                           / result["bound"]["copy_TBps"] / 1e9, 4),
            "best_ratio_at_floor_extra": round((plain["graph_replay_ms_p50"]
                                                + bound_row[b]["folded_extra_bytes"]
                                                / result["bound"]["copy_TBps"] / 1e9)
                                               / plain["graph_replay_ms_p50"], 4)}
        targets[f"decode_step_with_scores_le_1.10x_b{b}"] = \
            ratios[f"b{b}"]["step_p50_h2o_over_plain"] <= TARGET
    result["ratios"], result["targets_met"] = ratios, targets


def markdown(result: dict) -> str:
    lines = [f"# h2o_gpu ({result['device']}, {result['date']})", "",
             f"`{result['command']}`; torch {result['versions']['torch']}, triton "
             f"{result['versions']['triton']}. 1B-shaped dummy bf16 model, {result['context']}"
             f"-token context, CUDA graphs on every side.", "",
             f"Bound (copy {result['bound']['copy_TBps']} TB/s): "
             + "; ".join(f"b{r['batch']}: floor {r['floor_ms']} ms, second pass <= "
                         f"{r['second_pass_ratio_bound']}x, folded <= {r['folded_ratio_bound']}x"
                         for r in result["bound"]["rows"]), "",
             "| kernel (16 layers of decode attention) | no mass us | folded us | folded fp16 us "
             "| second pass us | folded / none | folded fp16 / none | second pass / none "
             "| max abs err folded / fp16 / second |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["kernel"]:
        lines.append(f"| b{r['batch']} ({r['num_splits']} splits) | {r['none_us']} | "
                     f"{r['folded_us']} | {r['folded_fp16_us']} | {r['second_pass_us']} | "
                     f"{r['folded_over_none']} | {r['folded_fp16_over_none']} | "
                     f"{r['second_pass_over_none']} | {r['folded_max_abs_err']:.2g} / "
                     f"{r['folded_fp16_max_abs_err']:.2g} / {r['second_pass_max_abs_err']:.2g} |")
    lines += ["", "| engine | step ms p50 | step ms mean | graph replay ms | evicted while timed |",
              "|---|---|---|---|---|"]
    for r in result["engine"]:
        lines.append(f"| {r['variant']} b{r['batch']} | {r['engine_step_ms_p50']} | "
                     f"{r['engine_step_ms_mean']} | {r.get('graph_replay_ms_p50')} | "
                     f"{r['evicted_while_timed']} |")
    lines += ["", "| ratio | " + " | ".join(result["ratios"]) + " |",
              "|---|" + "---|" * len(result["ratios"])]
    for key in next(iter(result["ratios"].values())):
        lines.append(f"| {key} | " + " | ".join(str(v[key]) for v in result["ratios"].values())
                     + " |")
    lines += ["", "Targets: " + ", ".join(f"{k}: {v}" for k, v in result["targets_met"].items()),
              ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--context", type=int, default=4000)
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--steps", type=int, default=96)  # six compaction rounds of 16
    parser.add_argument("--kv-gb", type=float, default=12.0)
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    import triton

    result = header("h2o_gpu")
    result["versions"]["triton"] = triton.__version__
    result["command"] = "python bench/h2o_gpu.py " + " ".join(sys.argv[1:])
    result.update(context=args.context, batches=args.batches, steps=args.steps)
    result["bound"] = bound(args.context, args.batches, copy_tbps())
    print(result["bound"], flush=True)
    width = _max_len(args)  # the engine's decode graphs' mass width
    result["kernel"] = kernel_section(args.context, width, args.batches)
    result["engine"] = []
    for name, options in (("plain", {}),
                          ("h2o", dict(kv_eviction="h2o", kv_budget=2 * width)),
                          ("h2o_fp16", dict(kv_eviction="h2o", kv_budget=2 * width)),
                          ("h2o_compacting", dict(kv_eviction="h2o", kv_budget=args.context))):
        result["engine"] += engine_section(args, name, options)
    summarise(result)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "h2o_gpu.json")
    md = markdown(result)
    write_result(path, result, md)
    print(md)


if __name__ == "__main__":
    main()
