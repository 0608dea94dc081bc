"""Probe (H200): does prefetching the next weights into L2 on a side stream speed up the 1B
batch-1 decode step?

At batch 1 the step's GEMVs reach 1.3-3.8 TB/s (the small ones are latency-bound) and the
kernels between them (norms, RoPE, attention, SiLU) leave DRAM idle: ~1.15 ms a step against a
0.58 ms weight-read roofline. A side stream that reads the next weights into L2 while the current
kernels run keeps DRAM busy; the GEMVs then read L2.

1. micro: one GEMV after an L2 flush and a 20 us gap (torch.cuda._sleep), with and without a
   prefetch of its weight issued before the gap, for each prefetch kernel: per-thread
   `prefetch.global.L2` of 128-byte lines (plain, evict_last) and `cp.async.bulk.prefetch.L2`
   of 16 KB / 64 KB chunks.
2. engine: the 1B dummy bf16 model's batch-1 CUDA graph re-captured with each policy (which
   weights are prefetched when) and kernel; graph replay p50, engine step p50, and the greedy
   tokens (must equal the no-prefetch run's).

    python bench/l2_prefetch_probe.py --out DIR     (DIR/l2_prefetch_probe.json)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(REPO))

from gpu_timing import drain, graph_total_us, header, replay_times_ms  # noqa: E402

from mxserve import LLM, SamplingParams  # noqa: E402


@triton.jit
def _lines_kernel(ptr, n_bytes, BLOCK: tl.constexpr, EVICT_LAST: tl.constexpr):
    offs = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64) * 128
    p = ptr + tl.minimum(offs, n_bytes - 1)
    if EVICT_LAST:
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l",
                                  [p], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l",
                                  [p], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _bulk_kernel(ptr, n_bytes, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    start = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64) * CHUNK
    size = tl.minimum(tl.maximum(n_bytes - start, 0), CHUNK).to(tl.int32)
    p = ptr + tl.minimum(start, n_bytes - 16)
    tl.inline_asm_elementwise(
        "{ .reg .pred q; setp.gt.s32 q, $2, 0; @q cp.async.bulk.prefetch.L2.global [$1], $2; "
        "mov.u32 $0, 0; }", "=r,l,r", [p, size], dtype=tl.int32, is_pure=False, pack=1)


def prefetcher(kind: str):
    """fn(t: uint8 tensor) issuing the prefetch of its bytes on the current stream."""
    if kind.startswith("lines"):
        evict_last = kind.endswith("last")

        def fn(t):
            n = t.numel()
            _lines_kernel[(triton.cdiv(n, 128 * 1024),)](t, n, BLOCK=1024, EVICT_LAST=evict_last,
                                                        num_warps=4)
        return fn
    chunk = int(kind.removeprefix("bulk")) * 1024

    def fn(t):
        n = t.numel()
        _bulk_kernel[(triton.cdiv(n, chunk * 32),)](t, n, CHUNK=chunk, BLOCK=32, num_warps=1)
    return fn


KINDS = ["lines", "lines_last", "bulk16", "bulk64"]


def micro_section() -> list[dict]:
    scratch = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    rows = []
    for n, k in ((3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        wb = w.view(-1).view(torch.uint8)
        flush = scratch.zero_
        gap = lambda: torch.cuda._sleep(40000)  # noqa: E731  ~20 us at 1.98 GHz
        gemv = lambda x=x, w=w: F.linear(x, w)  # noqa: E731
        base = graph_total_us([flush, gap])
        row = {"n": n, "k": k, "mb": round(wb.numel() / 2**20, 1),
               "cold_us": round(graph_total_us([flush, gap, gemv]) - base, 2),
               "hot_us": round(graph_total_us([gemv] * 20) / 20, 2)}
        for kind in KINDS:
            pf = (lambda f, t: lambda: f(t))(prefetcher(kind), wb)
            t_issue = graph_total_us([flush, pf, gap]) - base
            t_all = graph_total_us([flush, pf, gap, gemv]) - base
            row[kind] = {"issue_us": round(t_issue, 2), "gemv_us": round(t_all - t_issue, 2)}
            # the prefetch alone, no gap: how fast it pulls the bytes (a dependent read after)
            t_pf = graph_total_us([flush, pf, gemv]) - graph_total_us([flush])
            row[kind]["pf_then_gemv_us"] = round(t_pf, 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


class Prefetch:
    """Wraps the model's linears: at each linear's launch the side stream (after the main stream
    reaches that point) prefetches the weight bytes from a cursor up to `ahead` bytes past the end
    of this linear's weight, in consumption order; joined after the LM head."""

    def __init__(self, model, kind: str, ahead: int, after: bool) -> None:
        self.side = torch.cuda.Stream()
        self.fn = prefetcher(kind)
        mods = []
        for layer in model.layers:
            mods += [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                     layer.mlp.down_proj]
        head = model.lm_head
        mods.append(head)
        weights = [m.weight for m in mods[:-1]]
        weights.append(head.embedding.weight if head.tied else head.weight)
        flat = [w.detach().reshape(-1).view(torch.uint8) for w in weights]
        ends, pos = [], 0
        for t in flat:
            pos += t.numel()
            ends.append(pos)
        starts = [e - t.numel() for e, t in zip(ends, flat)]
        self.plans = []
        cursor = 0
        for end in ends:
            lo, hi = max(cursor, end), end + ahead
            plan = []
            for j, t in enumerate(flat):  # the pieces of [lo, hi) in each weight
                a, b = max(lo, starts[j]), min(hi, ends[j])
                if a < b:
                    a16 = (a - starts[j]) // 16 * 16
                    plan.append(t[a16:b - starts[j]])
            cursor = max(cursor, hi)
            self.plans.append(plan)
        self.originals = []
        for i, m in enumerate(mods):
            self.originals.append((m, m.forward))
            m.forward = self._wrap(m.forward, i, i == len(mods) - 1, after)

    def _wrap(self, orig, i, last, after):
        def fwd(*args, **kwargs):
            if not after:
                self._issue(i)
            out = orig(*args, **kwargs)
            if after:
                self._issue(i)
            if last:
                torch.cuda.current_stream().wait_stream(self.side)
            return out
        return fwd

    def _issue(self, i):
        if not self.plans[i]:
            return
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            for t in self.plans[i]:
                self.fn(t)

    def remove(self):
        for m, f in self.originals:
            m.forward = f


POLICIES = [  # (name, kind, ahead MB, after)
    ("none", None, 0, False),
    ("lines_a16", "lines", 16, False),
    ("lines_a32", "lines", 32, False),
    ("lines_a32_after", "lines", 32, True),
    ("lines_last_a24", "lines_last", 24, False),
    ("bulk64_a16", "bulk64", 16, False),
    ("bulk64_a32", "bulk64", 32, False),
    ("bulk16_a32", "bulk16", 32, False),
    ("bulk64_a48", "bulk64", 48, False),
]


def engine_section() -> list[dict]:
    llm = LLM(model="llama-3.2-1b", load_format="dummy", dtype="bfloat16", load_progress=False,
              max_num_seqs=8, kv_cache_memory_gb=2.0, max_model_len=4096)
    engine, runner = llm.engine, llm.engine.runner
    model = runner.model
    greedy = SamplingParams(temperature=0, ignore_eos=True, max_tokens=128)
    rows, ref_tokens = [], None
    for name, kind, ahead, after in POLICIES:
        pf = Prefetch(model, kind, ahead << 20, after) if kind else None
        runner.graphs = None
        torch.cuda.empty_cache()
        runner.capture_cuda_graphs(4096)
        out = {"policy": name}
        for _ in range(2):  # warm-up, then measured
            engine.add_request([(1000 + i) % 128000 for i in range(128)], greedy)
            times, tokens = drain(engine)
            out["engine_step_ms_p50"] = round(statistics.median(times[2:]), 4)
        graph = runner.graphs.graphs[1].graph
        reps = replay_times_ms(graph, 200)
        out["graph_replay_ms_p50"] = round(statistics.median(reps), 4)
        out["graph_replay_ms_min"] = round(min(reps), 4)
        if ref_tokens is None:
            ref_tokens = tokens
        out["tokens_equal"] = tokens == ref_tokens
        out["num_tokens"] = len(tokens)
        rows.append(out)
        print(json.dumps(out), flush=True)
        if pf:
            pf.remove()
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--sections", default="micro,engine")
    args = p.parse_args()
    res = header("l2_prefetch_probe")
    res["l2_bytes"] = torch.cuda.get_device_properties(0).L2_cache_size
    if "micro" in args.sections:
        res["micro"] = micro_section()
    if "engine" in args.sections:
        res["engine"] = engine_section()
    with open(os.path.join(args.out, "l2_prefetch_probe.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
