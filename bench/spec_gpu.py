"""Speculative decoding on the GPU (H200): a verify step of k + 1 tokens a request vs a plain
decode step at batch 1, 8 and 32, and the EAGLE head's draft step, on the Llama-3.2-1B-shaped
dummy model (`load_format="dummy"`, bf16), 256-token token-id prompts, greedy, EOS ignored.

Each step number is the wall time of `engine.step()` with all of a batch's requests decoding,
the median of --steps steady steps (after --warmup-steps), all sections in one run:

- decode: speculation off, async scheduling on (the CUDA default) and off (speculation turns
  it off); decode steps replay the captured CUDA graphs. decode_eager: the same with
  `enforce_eager=True`, the eager baseline of a verify step.
- verify: speculation on, every request verifying k drafts every step. Random weights make a
  trained drafter useless, so the drafts come from an oracle: each request's own greedy tokens
  from the decode section's run of the same prompts. With --accept all (the default) every
  draft is kept: spec_verify's greedy rule is swapped for one that does the same device work
  (the argmax of every row, read back) and keeps them all, the regime where speculation pays
  and where the bookkeeping and EAGLE's catch-up cost most. With --accept rule the engine's
  rule decides: in bf16 the random model's logits have near-ties everywhere, and the verify's
  rounding (other kernels than the decode graph's) flips its argmax within a few tokens, so
  few drafts are kept (in float32 all are). The oracle uses no device: the step is schedule +
  the target's forward of k + 1 tokens a request (a replay of the verify CUDA graphs,
  cuda_graphs.VerifyGraphs) + the rule + bookkeeping. verify_eager: the same with
  `enforce_eager=True`.
- eagle: an EAGLE head with random weights (eagle_train.init_head) runs its whole draft step
  every step (a catch-up pass over the positions the step kept, k - 1 chained positions, k LM
  heads: worker/eagle.py), then its drafts are replaced by the oracle's, so the verify is the
  one above. Its draft step (engine._draft) is timed alone: it starts with the device idle and
  ends reading the last draft back.

Per row also: host time in each part of the step (schedule / execute / sample, which holds the
accept rule / complete / draft; mean a step); the device time of a step's kernels and copies,
summed (torch.profiler, async off: the floor a CUDA graph of an eager step would approach;
kernels that overlap, as a decode graph's programmatic dependent launches do, count in full);
the decode and verify graphs replayed alone with the last step's inputs (CUDA events); drafts
and kept drafts a request a verify; the CUDA graph replays (decode or verify) in the measured
steps. The EAGLE head always runs eagerly.

Target (the speculative decoding issue): a verify step <= 1.15x a decode step at batch 1,
against the decode step as users run it (async on); the ratio against async off is beside it.

Run on the GPU machine:  python bench/spec_gpu.py --out DIR   (DIR/spec_gpu.json, .md; ~1 min)
Smoke test on a CPU:     python bench/spec_gpu.py --quick --out DIR   (a tiny shape, float32)
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import datetime
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))

from engine_gpu_common import GREEDY, REPO, free, pct  # noqa: E402
from gpu_timing import replay_ms  # noqa: E402
from revision import head_commit  # noqa: E402

from mxserve import LLM, SamplingParams  # noqa: E402

TARGET = 1.15  # verify step / decode step at batch 1
TARGETS = {"verify_le_1.15x_decode_batch1": "verify step / decode step with async scheduling "
           "on (the default a user runs), batch 1, <= 1.15",
           "verify_le_1.15x_decode_batch1_vs_async_off": "the same against async off"}
# The --quick shape: a tiny Llama, written to a temporary config directory.
TINY = dict(architectures=["LlamaForCausalLM"], vocab_size=512, hidden_size=64,
            intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
            rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=1,
            eos_token_id=2)


class OracleDrafter:
    """Drafts each request's reference tokens (its greedy output in a plain run), always n of
    them (padded past the reference's end)."""

    needs_hidden, num_lookahead_tokens = False, 0

    def release(self, request):
        pass

    def __init__(self, reference: dict[str, list[int]]) -> None:
        self.reference = reference

    def propose(self, plan, hidden, num_drafts) -> None:
        for r, n in num_drafts.items():
            drafts = self.reference[r.request_id][r.num_output_tokens:][:n]
            r.draft_token_ids = drafts + [10] * (n - len(drafts))


class ReplacedDrafts:
    """A drafter that runs its whole draft step, its drafts then replaced by the oracle's."""

    def __init__(self, inner, oracle: OracleDrafter) -> None:
        self.inner, self.oracle = inner, oracle
        self.needs_hidden = inner.needs_hidden
        self.num_lookahead_tokens = inner.num_lookahead_tokens
        self.release = inner.release

    def propose(self, plan, hidden, num_drafts) -> None:
        self.inner.propose(plan, hidden, num_drafts)
        self.oracle.propose(plan, hidden, num_drafts)


@contextlib.contextmanager
def keep_all_drafts(enabled: bool):
    """spec_verify's greedy rule swapped for one that keeps every draft, reading the same
    argmax (the outputs are then the drafts, not the target's tokens: for timing only)."""
    from mxserve.worker import spec_verify

    def keep_all(top: list[int], drafts: list[int]) -> list[int]:
        return drafts + [top[len(drafts)]]  # top: the step's one argmax read-back, as the rule

    saved = spec_verify._greedy
    if enabled:
        spec_verify._greedy = keep_all
    try:
        yield
    finally:
        spec_verify._greedy = saved


class StepProbe:
    """Wraps an engine's parts (instance attributes shadowing its methods, removed by close):
    each call's host wall time."""

    PARTS = (("schedule", "scheduler", "schedule"), ("execute", "runner", "execute"),
             ("sample", None, "_sample"), ("complete", None, "_complete"),
             ("draft", None, "_draft"))

    def __init__(self, engine) -> None:
        self.engine = engine
        self.step_ms: list[float] = []
        self.parts: dict[str, list[float]] = {}
        self.wrapped = []
        for key, owner, name in self.PARTS:
            obj = engine if owner is None else getattr(engine, owner)
            setattr(obj, name, self._timed(key, getattr(obj, name)))
            self.wrapped.append((obj, name))

    def _timed(self, key: str, fn):
        times = self.parts.setdefault(key, [])

        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            times.append((time.perf_counter() - t0) * 1e3)
            return out
        return wrapper

    def step(self) -> None:
        t0 = time.perf_counter()
        self.engine.step()
        self.step_ms.append((time.perf_counter() - t0) * 1e3)

    def close(self) -> dict:
        for obj, name in self.wrapped:
            delattr(obj, name)  # the class's method again
        n = len(self.step_ms)
        out = {"step_ms": round(statistics.median(self.step_ms), 4),
               "step_ms_p90": pct(self.step_ms, 90), "num_steps": n,
               "parts_ms_mean": {k: round(sum(v) / n, 4) for k, v in self.parts.items() if v}}
        if self.parts["draft"]:
            out["draft_ms"] = round(statistics.median(self.parts["draft"]), 4)
        return out


def replays(engine) -> int:
    """CUDA graph replays so far, decode and verify."""
    return sum(g.num_replays for g in (engine.runner.graphs, engine.runner.verify_graphs)
               if g is not None)


def measure(engine, num_steps: int) -> dict:
    """Step timings over num_steps steps, graph replays and speculation counts among them."""
    before_replays = replays(engine)
    before = spec_counts(engine)
    probe = StepProbe(engine)
    try:
        for _ in range(num_steps):
            probe.step()
    finally:
        out = probe.close()
    out["graph_replays"] = replays(engine) - before_replays
    after = spec_counts(engine)
    verifies = after[0] - before[0]
    if verifies:
        out["drafts_per_verify"] = round((after[1] - before[1]) / verifies, 3)
        out["kept_per_verify"] = round((after[2] - before[2]) / verifies, 3)
        out["tokens_per_step"] = round(1 + out["kept_per_verify"], 3)
    return out


def spec_counts(engine) -> tuple[int, int, int]:
    """(verify steps, drafts verified, drafts kept) summed over the running requests."""
    rs = engine.scheduler.running
    return (sum(r.num_drafts for r in rs), sum(r.num_draft_tokens for r in rs),
            sum(r.num_accepted_tokens for r in rs))


def kernel_profile(engine, num_steps: int) -> dict:
    """Device time of the kernels num_steps steps launch (torch.profiler), a step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(num_steps):
            engine.step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    top = sorted(events, key=lambda e: -e.device_time_total)[:12]
    return {"kernel_ms": round(sum(e.device_time_total for e in events) / num_steps / 1e3, 4),
            "kernels_per_step": round(sum(e.count for e in events) / num_steps, 1),
            # (a PDL-launched kernel's time includes its wait for the one before)
            "top_kernels_ms": {e.key[:80]: [round(e.device_time_total / num_steps / 1e3, 4),
                                            round(e.count / num_steps, 1)] for e in top}}


def make_engine(args, **options):
    t0 = time.perf_counter()
    if args.gemv_max_rows is not None:  # e.g. k + 1: a verify's projections on the GEMV too
        options.setdefault("gemv", {"max_rows": args.gemv_max_rows})
    llm = LLM(model=args.shape, load_format="dummy", dtype=args.dtype, load_progress=False,
              device=args.device, max_model_len=args.max_model_len,
              max_num_seqs=max(args.batches), kv_cache_memory_gb=args.kv_gb, **options)
    if llm.engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    gc.collect()
    gc.freeze()  # as a Serve worker does (cluster/worker.py); free() unfreezes
    return llm.engine, round(time.perf_counter() - t0, 2)


def add_batch(args, engine, batch: int) -> list:
    """`batch` requests of --prompt-len random ids (the same for a batch size in every
    section), ids b{batch}-{i}, long enough for every measured step to carry k drafts; the
    engine stepped through their prefills."""
    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(batch)
    params = SamplingParams(max_tokens=args.max_tokens, **GREEDY)
    requests = [engine.make_request(rng.integers(10, vocab - 10, args.prompt_len).tolist(),
                                    params, f"b{batch}-{i}") for i in range(batch)]
    for r in requests:
        engine.add(r)
    while engine.scheduler.waiting or any(r.num_output_tokens < 1 for r in requests):
        engine.step()
    return requests


def decode_section(args, state: dict, eager: bool = False) -> dict:
    """Decode steps with async scheduling off, then on. With graphs (not `eager`) the requests
    then run to their end: their tokens are the oracle's reference."""
    engine, load_s = make_engine(args, enforce_eager=eager)
    res = {"load_s": load_s, "cuda_graphs": engine.runner.graphs is not None, "rows": []}
    for batch in args.batches:
        requests, row = add_batch(args, engine, batch), {"batch": batch}
        for mode in (False, True):
            engine.async_scheduling = mode
            for _ in range(args.warmup_steps):
                engine.step()
            row["async" if mode else "sync"] = measure(engine, args.steps)
            if not mode and args.profile_steps and engine.runner.device.type == "cuda":
                row["sync"].update(kernel_profile(engine, args.profile_steps))
            graphs = engine.runner.graphs
            if not mode and graphs is not None and graphs.last_size is not None:
                # the graph the last step replayed, with its inputs (engine_gpu's decode sweep)
                row["sync"]["graph_replay_ms"] = replay_ms(graphs.graphs[graphs.last_size].graph,
                                                           20)
        if eager:
            for r in requests:
                engine.abort(r.request_id)
        else:
            while engine.has_unfinished_requests():
                engine.step()
            state["reference"].update({r.request_id: r.output_token_ids for r in requests})
        res["rows"].append(row)
        print(f"  batch {batch}: async {row['async']['step_ms']} ms, "
              f"sync {row['sync']['step_ms']} ms", flush=True)
    del engine
    free()
    return res


def spec_section(args, state: dict, method: str, eager: bool = False) -> dict:
    """Speculative steps, each request verifying k of the oracle's drafts, drafted by the oracle
    alone ("ngram": that config, its drafter replaced) or after the EAGLE head's own draft
    step ("eagle"); with the verify CUDA graphs, or none (`eager`)."""
    if not state["reference"]:
        raise RuntimeError("no reference tokens: the decode section did not run")
    spec = {"method": method, "num_speculative_tokens": args.k}
    with tempfile.TemporaryDirectory() as head_dir:
        if method == "eagle":
            # a random head is unsure of everything: no confidence floor, so its step runs
            # the whole chain of k passes a trained head would; no prompt lookup (the head's
            # round is what is timed)
            spec.update(model=head_dir, min_draft_confidence=0.0, lookup_first=False)
            write_random_head(args, head_dir)
        engine, load_s = make_engine(args, speculative_config=spec, enforce_eager=eager)
    oracle = OracleDrafter(state["reference"])
    engine.drafter = oracle if method == "ngram" else ReplacedDrafts(engine.drafter, oracle)
    res = {"load_s": load_s, "async_scheduling": engine.async_scheduling, "accept": args.accept,
           "rows": []}
    for batch in args.batches:
        with keep_all_drafts(args.accept == "all"):
            requests = add_batch(args, engine, batch)
            for _ in range(args.warmup_steps):
                engine.step()
            row = {"batch": batch, **measure(engine, args.steps)}
            graphs = engine.runner.verify_graphs
            if graphs is not None and graphs.last_size is not None:
                row["graph_replay_ms"] = replay_ms(graphs.graphs[graphs.last_size].graph, 20)
            if args.profile_steps and engine.runner.device.type == "cuda":
                row.update(kernel_profile(engine, args.profile_steps))
        for r in requests:
            engine.abort(r.request_id)
        res["rows"].append(row)
        print(f"  batch {batch}: step {row['step_ms']} ms, draft {row['draft_ms']} ms, "
              f"tokens a step {row.get('tokens_per_step')}", flush=True)
    del engine
    free()
    return res


def write_random_head(args, path: str) -> None:
    """An EAGLE head of the model's shape (or of args.model's checkpoint, where a bench has
    one) with random weights, saved where load_head reads."""
    from mxserve.worker.eagle import save_head
    from mxserve.worker.eagle_train import init_head
    from mxserve.worker.model.dummy import open_dummy
    from mxserve.worker.model.loader import open_checkpoint

    model = getattr(args, "model", None)
    config = open_checkpoint(model).config if model else \
        open_dummy(args.shape, torch.device("cpu"), torch.float32).config
    head = init_head(config, seed=1, device=args.device)
    vocab = getattr(args, "draft_vocab", 0)
    if vocab:  # the ids a real head's ranking would put first: any N cost the same
        head.draft_vocab_ranking = torch.arange(config.vocab_size)
        head.draft_vocab_size = vocab
    save_head(head, path, config.model_id, dtype=getattr(torch, args.dtype))


def summary(sections: dict) -> tuple[list[dict], dict]:
    """A row a batch size over the sections with the ratios, and the targets met."""
    by_batch: dict[int, dict] = {}

    def rows(name: str) -> list:
        return (sections.get(name) or {}).get("rows", [])

    for r in rows("decode"):
        by_batch.setdefault(r["batch"], {}).update(
            decode_async_ms=r["async"]["step_ms"], decode_sync_ms=r["sync"]["step_ms"],
            decode_replay_ms=r["sync"].get("graph_replay_ms"),
            decode_kernel_ms=r["sync"].get("kernel_ms"),
            decode_graph_replays_per_step=round(r["sync"]["graph_replays"] / r["sync"]
                                                ["num_steps"], 2))
    for r in rows("decode_eager"):
        by_batch.setdefault(r["batch"], {})["decode_eager_sync_ms"] = r["sync"]["step_ms"]
    for name in ("verify", "verify_eager", "eagle"):
        for r in rows(name):
            by_batch.setdefault(r["batch"], {}).update({
                f"{name}_step_ms": r["step_ms"], f"{name}_draft_ms": r["draft_ms"],
                f"{name}_kernel_ms": r.get("kernel_ms"),
                f"{name}_replay_ms": r.get("graph_replay_ms"),
                f"{name}_tokens_per_step": r.get("tokens_per_step"),
                f"{name}_graph_replays_per_step": round(r["graph_replays"] / r["num_steps"], 2)})
    for s in by_batch.values():
        for name in ("verify", "eagle"):
            for base in ("decode_async_ms", "decode_sync_ms", "decode_eager_sync_ms"):
                if s.get(f"{name}_step_ms") and s.get(base):
                    key = f"{name}_vs_{base.removesuffix('_ms')}"
                    s[key] = round(s[f"{name}_step_ms"] / s[base], 3)
        for base in ("decode_kernel_ms", "decode_replay_ms"):
            if s.get("verify_kernel_ms") and s.get(base):
                key = f"verify_kernels_vs_{base.removesuffix('_ms')}"
                s[key] = round(s["verify_kernel_ms"] / s[base], 3)
        if s.get("verify_replay_ms") and s.get("decode_replay_ms"):
            s["verify_replay_vs_decode_replay"] = round(s["verify_replay_ms"]
                                                        / s["decode_replay_ms"], 3)
        if s.get("verify_step_ms") and s.get("verify_eager_step_ms"):
            s["verify_eager_vs_verify"] = round(s["verify_eager_step_ms"] / s["verify_step_ms"],
                                                3)
        if s.get("verify_kernel_ms") and s.get("eagle_kernel_ms"):  # the head's, by difference
            s["eagle_draft_kernel_ms"] = round(s["eagle_kernel_ms"] - s["verify_kernel_ms"], 4)
    one, met = by_batch.get(1, {}), {}
    if "verify_vs_decode_async" in one:
        met["verify_le_1.15x_decode_batch1"] = one["verify_vs_decode_async"] <= TARGET
    if "verify_vs_decode_sync" in one:
        met["verify_le_1.15x_decode_batch1_vs_async_off"] = one["verify_vs_decode_sync"] <= TARGET
    return [{"batch": b, **s} for b, s in sorted(by_batch.items())], met


def markdown(d: dict) -> str:
    s, rows, c = d["sections"], d["summary"], d["config"]
    lines = [f"# spec_gpu ({d['device']}, {d['date']})", "",
             f"`{d['command']}`; torch {d['versions']['torch']}, triton "
             f"{d['versions']['triton']}. Shape {c['shape']}, dummy weights, {c['dtype']}, "
             f"{c['prompt_len']}-token prompts, greedy, k = {c['k']}, drafts kept: "
             f"{'all (forced)' if c['accept'] == 'all' else 'by the engine rule'}; each step "
             f"the median of {c['steps']}, in ms.", "",
             "| batch | decode, async | decode, sync | decode, eager sync | verify | "
             "verify / decode async | verify / decode sync | verify, eager | tokens a verify | "
             "EAGLE step | EAGLE draft | EAGLE step / decode async |", "|" + "---|" * 12]
    lines += [_cells(r, ("decode_async_ms", "decode_sync_ms", "decode_eager_sync_ms",
                         "verify_step_ms", "verify_vs_decode_async", "verify_vs_decode_sync",
                         "verify_eager_step_ms", "verify_tokens_per_step", "eagle_step_ms",
                         "eagle_draft_ms", "eagle_vs_decode_async")) for r in rows]
    lines += ["", "Device time (ms): the decode and verify graphs replayed alone (CUDA "
              "events), and a step's kernels and copies summed (torch.profiler, async off; "
              "overlapping kernels count in full); the EAGLE head's by difference from the "
              "verify's.", "",
              "| batch | decode replay | verify replay | verify replay / decode replay | decode "
              "kernels | verify kernels | verify kernels / decode kernels | EAGLE head kernels "
              "| graph replays a step: decode / verify / EAGLE |", "|" + "---|" * 9]
    lines += [_cells(r, ("decode_replay_ms", "verify_replay_ms",
                         "verify_replay_vs_decode_replay", "decode_kernel_ms",
                         "verify_kernel_ms", "verify_kernels_vs_decode_kernel",
                         "eagle_draft_kernel_ms"))
              + f" {r.get('decode_graph_replays_per_step')} / "
              f"{r.get('verify_graph_replays_per_step')} / "
              f"{r.get('eagle_graph_replays_per_step')} |" for r in rows]
    lines += ["", f"Verify steps: {d['verify_graphs']}", ""]
    for name in ("decode", "verify", "verify_eager", "eagle"):
        for r in (s.get(name) or {}).get("rows", []):
            parts = (r.get("async") or r)["parts_ms_mean"]
            lines.append(f"- {name} b{r['batch']}, host ms in each part, mean a step "
                         f"({'async' if 'async' in r else 'sync'}): "
                         + ", ".join(f"{k} {v}" for k, v in parts.items()))
    lines += ["", "Targets: " + "; ".join(f"{k} ({TARGETS[k]}): {v}"
                                        for k, v in d["targets_met"].items())]
    if d["errors"]:
        lines += ["", "Sections that failed or were skipped: " + ", ".join(d["errors"])]
    return "\n".join(lines) + "\n"


def _cells(row: dict, keys: tuple[str, ...]) -> str:
    return f"| {row['batch']} | " + " | ".join(str(row.get(k, "-")) for k in keys) + " |"


class Report:
    """Sections run one by one, the JSON and markdown rewritten as each ends (a failing one
    records its error)."""

    def __init__(self, args) -> None:
        self.args, self.t0 = args, time.perf_counter()
        self.data = {**environment(args), "targets": TARGETS, "verify_graphs": (
            "verify steps of k + 1 tokens a request replay the verify CUDA graphs "
            "(cuda_graphs.VerifyGraphs; verify_eager: enforce_eager), and the EAGLE "
            "head always does"), "sections": {}, "errors": {}}

    def run(self, name: str, fn, *a, **kw) -> None:
        if time.perf_counter() - self.t0 > self.args.deadline_s:
            self.data["errors"][name] = "skipped: past --deadline-s"
            return
        print(f"[{time.perf_counter() - self.t0:6.1f}s] {name} ...", flush=True)
        try:
            self.data["sections"][name] = fn(*a, **kw)
        except Exception:
            self.data["errors"][name] = traceback.format_exc()[-3000:]
            print(self.data["errors"][name], flush=True)
        self.write()

    def write(self) -> None:
        self.data["elapsed_s"] = round(time.perf_counter() - self.t0, 1)
        self.data["summary"], self.data["targets_met"] = summary(self.data["sections"])
        os.makedirs(self.args.out, exist_ok=True)
        with open(os.path.join(self.args.out, "spec_gpu.json"), "w") as f:
            json.dump(self.data, f, indent=1)
        with open(os.path.join(self.args.out, "spec_gpu.md"), "w") as f:
            f.write(markdown(self.data))


def environment(args) -> dict:
    """Device, date, versions, the command and the run's settings."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = args.device.startswith("cuda")
    keys = ("shape", "dtype", "device", "k", "batches", "steps", "warmup_steps", "prompt_len",
            "max_tokens", "max_model_len", "kv_gb", "accept", "profile_steps", "draft_vocab")
    return {"bench": "spec_gpu",
            "device": torch.cuda.get_device_name() if cuda
            else platform.processor() or platform.machine(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "triton": triton_version, "cuda": torch.version.cuda,
                         "git_head_where_run": head_commit() or None},
            "command": " ".join(["python", "bench/spec_gpu.py", *sys.argv[1:]]),
            "config": {k: getattr(args, k) for k in keys}}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results"))
    p.add_argument("--shape", default=None, help="a DUMMY_MODELS name or a config.json dir "
                   "(default llama-3.2-1b; --quick: a tiny one)")
    p.add_argument("--device", default=None, help="default cuda (--quick: cpu)")
    p.add_argument("--dtype", default=None, help="default bfloat16 (cpu: float32)")
    p.add_argument("--quick", action="store_true", help="tiny shape and counts: a smoke test")
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--draft-vocab", type=int, default=0,
                   help="the random head drafts from this many ids, as a head trained with a "
                        "draft vocabulary does (0: the whole vocabulary)")
    p.add_argument("--batches", default=None, help="default 1,8,32 (--quick: 1,4)")
    p.add_argument("--steps", type=int, default=40, help="measured steps a batch and mode")
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--kv-gb", type=float, default=4.0)
    p.add_argument("--accept", choices=("all", "rule"), default="all",
                   help="verify keeps every draft, or the engine's rule decides")
    p.add_argument("--profile-steps", type=int, default=5,
                   help="speculative steps profiled for their kernels' time (0: none; CUDA)")
    p.add_argument("--sections", default="decode,decode_eager,verify,verify_eager,eagle",
                   help="verify and eagle need decode (their drafts' reference)")
    p.add_argument("--deadline-s", type=float, default=240)
    p.add_argument("--gemv-max-rows", type=int, default=None,
                   help="EngineConfig.gemv max_rows (default the engine's, 1)")
    args = p.parse_args()
    args.batches = [int(b) for b in (args.batches or ("1,4" if args.quick else "1,8,32"))
                    .split(",")]
    if args.quick:
        args.__dict__.update(steps=min(args.steps, 8), warmup_steps=min(args.warmup_steps, 2),
                             prompt_len=min(args.prompt_len, 32), max_model_len=512, kv_gb=0.05)
        args.device = args.device or "cpu"
        if args.shape is None:
            args.shape = tempfile.mkdtemp(prefix="spec_gpu_shape_")
            atexit.register(shutil.rmtree, args.shape, True)
            with open(os.path.join(args.shape, "config.json"), "w") as f:
                json.dump(TINY, f)
    args.shape = args.shape or "llama-3.2-1b"
    args.device = args.device or "cuda"
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    # What the spec runs need (the first token, then up to k + 1 a step, and k drafts past the
    # last) and the decode runs (a token a step, in two modes), so no request ends mid-run.
    steps = args.warmup_steps + args.steps + args.profile_steps + 1
    args.max_tokens = max(1 + (steps + 1) * (args.k + 1), 4 + 2 * steps)
    return args


def main() -> None:
    args = parse_args()
    report, state = Report(args), {"reference": {}}
    sections = args.sections.split(",")
    if "decode" in sections:
        report.run("decode", decode_section, args, state)
    if "decode_eager" in sections:
        report.run("decode_eager", decode_section, args, state, eager=True)
    if "verify" in sections:
        report.run("verify", spec_section, args, state, "ngram")
    if "verify_eager" in sections:
        report.run("verify_eager", spec_section, args, state, "ngram", eager=True)
    if "eagle" in sections:
        report.run("eagle", spec_section, args, state, "eagle")
    report.write()
    print(markdown(report.data))


if __name__ == "__main__":
    main()
