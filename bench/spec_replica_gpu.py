"""The draft replica on the GPU (issue 24): the Llama-3.2-1B-shaped dummy target (random bf16
weights, CUDA graphs) and a random EAGLE head of its shape, greedy, at batch 1 and 8, side by
side in one run:

- none:              no speculation;
- local:             the head in the engine's process;
- replica:           the head in a draft server process (`DraftService` on loopback, as
                     `mxserve draft-server` runs it), strictly alternating (run_ahead off);
- replica-run-ahead: the same with run-ahead (the default).

Acceptance is forced, and the result says so: random weights accept nothing, so every drafter
runs its real head (its cost is real: the head's passes on the GPU, the channel, run-ahead's
work) and its drafts are then replaced by the target's own greedy tokens from a plain run (the
reference; in the server, `OracleDraftServer`), and the verify keeps every draft
(spec_gpu.keep_all_drafts: the outputs are then the drafts, which is why outputs are not
compared). Every speculative step carries k drafts and keeps them all: the best case for the
channel's cost relative to a step. Run-ahead's guess (the reference's next token) is right
wherever the target's argmax agrees with its plain run.

Targets (issue 24, for the replica with run-ahead at batch 1): >= 0.9x local's tok/s and >= 1.3x
none's.

Run on the GPU machine:  python bench/spec_replica_gpu.py --out $OUT   (~3 min)
Try it on a CPU with a small checkpoint:  python bench/spec_replica_gpu.py --model DIR
                             --device cpu --dtype float32 --out /tmp/x
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))

from gpu_timing import header  # noqa: E402
from revision import write_result  # noqa: E402
from spec_gpu import keep_all_drafts, write_random_head  # noqa: E402
from spec_replica import replica_stats, run  # noqa: E402

from mxserve import LLM, SamplingParams  # noqa: E402
from mxserve.worker.draft_server import DraftServer, _Ahead  # noqa: E402

KEY = 16  # a sequence is known here by its first KEY tokens (random prompts: unique)


class OracleDraftServer(DraftServer):
    """A DraftServer whose drafts, after its head has drafted, are the reference's tokens at
    the same positions (and run-ahead's guess and drafts too)."""

    def __init__(self, config, references: list[list[int]], num_blocks: int = 4096) -> None:
        super().__init__(config, num_blocks)
        self.references = {tuple(seq[:KEY]): seq for seq in references}

    def _reference(self, key: str) -> list[int] | None:
        state = self._states.get(key)
        return None if state is None else self.references.get(tuple(state.tokens[:KEY]))

    def draft(self, rounds, features, model_id=""):
        drafts = super().draft(rounds, features, model_id)
        for r, d in zip(rounds, drafts):
            seq = self._reference(r.key)
            if seq is None or not d:
                continue
            at = r.start + r.kept + 1  # the first draft's position
            d[:] = (seq[at:at + len(d)] + [10] * len(d))[:len(d)]
            self._states[r.key].drafts = list(d)
        return drafts

    def run_ahead(self, stop=None) -> None:
        before = {key: self._states[key].ahead for key in self._last_keys
                  if key in self._states}
        super().run_ahead(stop)
        for key, old in before.items():
            state = self._states.get(key)
            seq = self._reference(key)
            if state is None or seq is None or state.ahead is None or state.ahead is old:
                continue
            guess = state.next_start + len(state.drafts) + 1  # the bonus token's position
            drafts = (seq[guess + 1:guess + 1 + self.k] + [10] * self.k)[:len(
                state.ahead.drafts)]
            state.ahead = _Ahead(state.drafts + [seq[guess] if guess < len(seq) else 10],
                                 drafts, state.ahead.end)


class PromptOracle:
    """The local drafter's drafts replaced by the reference's (after the head has drafted)."""

    def __init__(self, inner, references: list[list[int]]) -> None:
        self.inner = inner
        self.needs_hidden = inner.needs_hidden
        self.num_lookahead_tokens = inner.num_lookahead_tokens
        self.release = inner.release
        self.references = {tuple(seq[:KEY]): seq for seq in references}

    def propose(self, plan, hidden, num_drafts) -> None:
        self.inner.propose(plan, hidden, num_drafts)
        for r, n in num_drafts.items():
            seq = self.references[tuple(r.prompt_token_ids[:KEY])]
            at = r.num_tokens  # the position after the last token the request has
            r.draft_token_ids = (seq[at:at + n] + [10] * n)[:n]


def serve(args) -> None:
    """The draft server process: an OracleDraftServer on loopback; prints its address."""
    from mxserve.worker.config import EngineConfig
    from mxserve.worker.draft_channel import DraftService

    with open(args.serve) as f:
        references = json.load(f)
    spec = {"method": "eagle", "model": args.head, "num_speculative_tokens": args.k,
            "min_draft_confidence": 0.0, "run_ahead": bool(args.run_ahead),
            "lookup_first": False}  # the head's rounds, wherever it runs
    config = EngineConfig(**_model(args), dtype=args.dtype, device=args.device,
                          max_model_len=args.max_model_len, speculative_config=spec)
    service = DraftService(OracleDraftServer(config, references), "127.0.0.1", 0)
    print(f"draft server listening on {service.address}", flush=True)
    sys.stdin.read()  # until the bench closes it
    service.close()


def start_server(args, refs: str, head: str, run_ahead: bool) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, os.path.abspath(__file__), "--serve", refs, "--head", head,
           "--run-ahead", str(int(run_ahead)), "--shape", args.shape, "--dtype", args.dtype,
           "--device", args.device, "--k", str(args.k), "--max-model-len",
           str(args.max_model_len)] + (["--model", args.model] if args.model else [])
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.startswith("draft server listening on "):
        raise RuntimeError(f"the draft server did not start: {line!r}")
    return proc, line.split()[-1]


def _model(args) -> dict:
    """The target: --model's checkpoint, else dummy weights of --shape."""
    return dict(model=args.model) if args.model else dict(model=args.shape, load_format="dummy")


def make_llm(args, spec=None) -> LLM:
    return LLM(**_model(args), dtype=args.dtype, device=args.device, load_progress=False,
               max_model_len=args.max_model_len, max_num_seqs=8, kv_cache_memory_gb=args.kv_gb,
               speculative_config=spec)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama-3.2-1b")
    p.add_argument("--model", default=None, help="a checkpoint instead of --shape's dummy")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--draft-vocab", type=int, default=0,
                   help="the random head drafts from this many ids (0: the whole vocabulary)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved passes (medians)")
    p.add_argument("--kv-gb", type=float, default=4.0)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--out", default="bench/results")
    p.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    p.add_argument("--head", default=None, help=argparse.SUPPRESS)
    p.add_argument("--run-ahead", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        serve(args)
        return
    t0 = time.perf_counter()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    none = make_llm(args)
    vocab = none.engine.model_config.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, vocab - 10, args.prompt_len).tolist()
               for _ in range(args.prompts)]
    references = [p + o.token_ids for p, o in zip(prompts, none.generate(prompts, params))]
    procs, results = [], []
    with tempfile.TemporaryDirectory() as tmp:
        refs, head = os.path.join(tmp, "refs.json"), os.path.join(tmp, "head")
        with open(refs, "w") as f:
            json.dump(references, f)
        write_random_head(args, head)
        try:
            addresses = {}
            for run_ahead in (False, True):
                proc, addresses[run_ahead] = start_server(args, refs, head, run_ahead)
                procs.append(proc)
            spec = {"method": "eagle", "model": head, "num_speculative_tokens": args.k,
                    "min_draft_confidence": 0.0, "lookup_first": False}
            replica = {**spec, "draft_placement": "replica", "draft_timeout_s": 5.0}
            llms = {"none": none, "local": make_llm(args, spec),
                    "replica": make_llm(args, {**replica, "draft_address": addresses[False],
                                               "run_ahead": False}),
                    "replica-run-ahead": make_llm(args, {**replica,
                                                         "draft_address": addresses[True]})}
            local = llms["local"].engine
            local.drafter = PromptOracle(local.drafter, references)
            runs: dict[tuple, list[dict]] = {}
            with keep_all_drafts(True):
                for llm in llms.values():
                    run(llm, prompts[:2], 2, params, chat=False)  # warm-up
                for _ in range(args.rounds):
                    for batch in (1, 8):
                        for method, llm in llms.items():
                            llm.engine.kv.reset_prefix_cache()
                            runs.setdefault((method, batch), []).append(
                                run(llm, prompts, batch, params, chat=False))
            for (method, batch), rs in runs.items():
                row = dict(method=method, batch=batch,
                           tok_s=round(statistics.median(r["tok_s"] for r in rs), 2),
                           tok_s_rounds=[r["tok_s"] for r in rs],
                           acceptance_length=rs[0]["acceptance_length"])
                for base in ("none", "local"):
                    row[f"vs_{base}"] = round(statistics.median(
                        r["tok_s"] / b["tok_s"] for r, b in zip(rs, runs[(base, batch)])), 3)
                results.append(row)
            channel = {}
            for method in ("replica", "replica-run-ahead"):
                d = llms[method].engine.drafter
                channel[method] = dict(rounds=d.num_rounds, failures=d.num_failures,
                                       round_trip_ms_p50=round(d.round_trip_p50_ms, 4))
            for llm in llms.values():
                llm.shutdown()
            for method, run_ahead in (("replica", False), ("replica-run-ahead", True)):
                stats = replica_stats(addresses[run_ahead])
                channel[method].update(rounds_prepared_ahead=stats["num_ahead"],
                                       rounds_answered_ahead=stats["num_ahead_hits"])
        finally:
            for proc in procs:
                proc.stdin.close()
                proc.wait(timeout=30)
    ahead1 = next(r for r in results if r["method"] == "replica-run-ahead" and r["batch"] == 1)
    targets_met = {"replica_run_ahead_ge_0.9x_local_batch1": ahead1["vs_local"] >= 0.9,
                   "replica_run_ahead_ge_1.3x_none_batch1": ahead1["vs_none"] >= 1.3}
    result = {**header("spec_replica_gpu"),
              "command": "python bench/spec_replica_gpu.py " + " ".join(sys.argv[1:]),
              "model": f"{args.model or args.shape + ' dummy weights'} ({args.dtype}), a random "
                       "EAGLE head" + (f" drafting from {args.draft_vocab} ids" if args.draft_vocab
                                       else ""),
              "acceptance": "forced: every draft is the target's plain greedy token and the "
                            "verify keeps all (spec_gpu.keep_all_drafts)",
              "prompts": args.prompts, "prompt_len": args.prompt_len,
              "max_tokens": args.max_tokens, "k": args.k, "rounds": args.rounds,
              "runs": results, "channel": channel, "targets_met": targets_met,
              "seconds": round(time.perf_counter() - t0, 1)}
    rows = "\n".join(f"| {r['batch']} | {r['method']} | {r['tok_s']} | {r['vs_none']}x | "
                     f"{r['vs_local']}x | {r['acceptance_length'] or '-'} |" for r in results)
    md = (f"# spec_replica_gpu ({result['device']}, {result['date']})\n\n`{result['command']}`: "
          f"{result['model']}, {args.prompts} random prompts of {args.prompt_len} tokens, "
          f"{args.max_tokens} tokens each, k = {args.k}; acceptance {result['acceptance']}. "
          f"tok/s: median of {args.rounds} interleaved rounds, ratios: medians of the rounds' "
          "ratios.\n\n| batch | method | tok/s | vs none | vs local | acceptance length |\n"
          f"|---|---|---|---|---|---|\n{rows}\n\nChannel: {channel}\n\n"
          f"Targets: {targets_met}\n")
    os.makedirs(args.out, exist_ok=True)
    write_result(os.path.join(args.out, "spec_replica_gpu.json"), result, md)
    print(md)


if __name__ == "__main__":
    main()
