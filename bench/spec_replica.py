"""The EAGLE head in a draft replica vs in the worker, on CPU: SmolLM2-135M-Instruct and its
shipped head in the default CPU engine (bf16, int4 linears), greedy, held-out chat prompts at
batch 1 and 8, side by side in one run:

- none:              no speculation;
- local:             the head in the engine's process (draft_placement "local");
- replica:           the head in a separate `mxserve draft-server` process on loopback
                     (draft_placement "replica", worker/draft_channel.py), drafting strictly
                     after each step (run_ahead off);
- replica-run-ahead: the same with run-ahead (the default): between rounds the replica drafts
                     each request's next round as if every draft is kept and its guess at the
                     target's next token is right, and answers such a round at once.

Every method runs the target on --threads threads; the replica process gets its own
--draft-threads (default 1), so on a 2-core machine the two processes do not share a core (run-
ahead works while the target verifies). Reported: output tok/s, the ratio to none and to local,
acceptance length, outputs equal to none's (greedy at batch 1: they must be), run-ahead's rounds
prepared and answered from, and the channel: the replica rounds' round trip (drafting included)
and an empty message's round trip (framing, socket, the replica's batching thread) beside a Ray
Serve handle call's to a trivial method (the per-round cost the channel replaces).

Targets (issue 24, for the replica with run-ahead): >= 0.9x local's tok/s at batch 1 and >= 1.3x
none's.

The methods take turns over `--rounds` passes (every engine stays loaded); tok/s is the median
of the passes, a ratio the median of the passes' ratios.

Run: python bench/spec_replica.py [--prompts 8] [--max-tokens 128] [--rounds 3]  (~6 min)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lib.revision import head_commit, write_result  # noqa: E402

from mxserve import LLM, SamplingParams  # noqa: E402
from mxserve.worker.eagle import DEFAULT_HEAD  # noqa: E402
from mxserve.worker.eagle_train import chat_prompts  # noqa: E402


def run(llm: LLM, prompts: list, batch: int, params: SamplingParams, chat: bool = True) -> dict:
    """Output tok/s and acceptance over the prompts in batches (chat conversations, or token
    ids / text with chat False)."""
    outs, start = [], time.perf_counter()
    for i in range(0, len(prompts), batch):
        outs += (llm.chat if chat else llm.generate)(prompts[i:i + batch], params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    drafts = sum(o.num_drafts for o in outs)
    accepted = sum(o.num_accepted_tokens for o in outs)
    return dict(token_ids=[o.token_ids for o in outs], seconds=round(seconds, 3), tokens=tokens,
                tok_s=round(tokens / seconds, 2),
                acceptance_length=round(1 + accepted / drafts, 3) if drafts else None)


def start_draft_server(spec: dict, threads: int) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.Popen([sys.executable, "-m", "mxserve.cluster.cli", "draft-server",
                             "--speculative-config", json.dumps(spec)],  # the engines' dtype
                            stdout=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    if not line.startswith("draft server listening on "):
        raise RuntimeError(f"the draft server did not start: {line!r}")
    return proc, line.split()[-1]


def replica_stats(address: str) -> dict:
    import socket

    from mxserve.worker.draft_channel import recv_frame, send_frame

    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as sock:
        send_frame(sock, {"stats": True})
        return recv_frame(sock)[0]["stats"]


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q / 100 * len(values)))], 4)


def empty_round_trips(address: str, n: int) -> list[float]:
    """Round trips (ms) of n release-only messages to the replica."""
    import socket

    from mxserve.worker.draft_channel import recv_frame, send_frame

    host, port = address.rsplit(":", 1)
    times = []
    with socket.create_connection((host, int(port))) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(n):
            t0 = time.perf_counter()
            send_frame(sock, {"rounds": [], "release": []})
            recv_frame(sock)
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def serve_handle_round_trips(n: int) -> list[float]:
    """Round trips (ms) of n Ray Serve handle calls to a method that returns at once."""
    import ray
    from ray import serve

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=512 * 2**20,
             log_to_driver=False)
    try:
        @serve.deployment(ray_actor_options={"num_cpus": 0.5})
        class Echo:
            def ping(self) -> int:
                return 0

        handle = serve.run(Echo.bind(), name="echo", route_prefix=None)
        for _ in range(50):
            handle.ping.remote().result()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            handle.ping.remote().result()
            times.append((time.perf_counter() - t0) * 1e3)
        return times
    finally:
        serve.shutdown()
        ray.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="the target engine's")
    p.add_argument("--draft-threads", type=int, default=1, help="the replica process's")
    p.add_argument("--pings", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3, help="interleaved passes (medians)")
    p.add_argument("--out", default="bench/results/spec_replica.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    prompts = chat_prompts(args.prompts, "heldout")
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    spec = {"method": "eagle", "num_speculative_tokens": args.k, "model": DEFAULT_HEAD,
            "lookup_first": False}  # the head's rounds, local or in a replica
    proc, address = start_draft_server({**spec, "run_ahead": False}, args.draft_threads)
    proc_ahead, address_ahead = start_draft_server(spec, args.draft_threads)
    results, channel = [], {}
    try:
        replica = {**spec, "draft_placement": "replica", "draft_timeout_s": 5.0}
        methods = {"none": None, "local": spec,
                   "replica": {**replica, "draft_address": address},
                   "replica-run-ahead": {**replica, "draft_address": address_ahead}}
        llms = {}
        for method, s in methods.items():
            llms[method] = LLM(load_progress=False, num_threads=args.threads,
                               speculative_config=s)
            run(llms[method], prompts[:2], 2, params)  # warm-up
        # Rounds: every method once per round on each batch size, one after another, so a
        # slow spell of the box falls on all of a round's methods alike; ratios are the
        # medians of the rounds' ratios.
        runs: dict[tuple, list[dict]] = {}
        for _ in range(args.rounds):
            for batch in (1, 8):
                for method, llm in llms.items():
                    llm.engine.kv.reset_prefix_cache()
                    runs.setdefault((method, batch), []).append(
                        run(llm, prompts, batch, params))
        for method, batch in runs:
            rs = runs[(method, batch)]
            r = dict(rs[0], tok_s=round(statistics.median(x["tok_s"] for x in rs), 2),
                     tok_s_rounds=[x["tok_s"] for x in rs])
            for m in ("none", "local"):
                r[f"vs_{m}"] = round(statistics.median(
                    x["tok_s"] / b["tok_s"] for x, b in zip(rs, runs[(m, batch)])), 3)
            r["same_output"] = all(x["token_ids"] == b["token_ids"]
                                   for x, b in zip(rs, runs[("none", batch)]))
            results.append(dict(method=method, batch=batch, **r))
        d = llms["replica"].engine.drafter
        channel["replica_rounds"] = d.num_rounds
        channel["replica_failures"] = d.num_failures
        channel["replica_round_trip_ms_p50"] = round(d.round_trip_p50_ms, 4)
        channel["replica_round_trip_ms_p99"] = pct(d.round_trip_ms, 99)
        d = llms["replica-run-ahead"].engine.drafter
        channel["run_ahead_round_trip_ms_p50"] = round(d.round_trip_p50_ms, 4)
        channel["run_ahead_round_trip_ms_p99"] = pct(d.round_trip_ms, 99)
        for llm in llms.values():
            llm.shutdown()
        stats = replica_stats(address_ahead)
        channel["run_ahead_rounds_prepared"] = stats["num_ahead"]
        channel["run_ahead_rounds_answered"] = stats["num_ahead_hits"]
        channel["run_ahead_rounds_all"] = stats["num_rounds"]
        empty = empty_round_trips(address, args.pings)
    finally:
        for p in (proc, proc_ahead):
            p.kill()
            p.wait()
    handle = serve_handle_round_trips(min(args.pings, 1000))
    channel.update(empty_message_ms_p50=round(statistics.median(empty), 4),
                   empty_message_ms_p99=pct(empty, 99),
                   serve_handle_call_ms_p50=round(statistics.median(handle), 4),
                   serve_handle_call_ms_p99=pct(handle, 99))
    channel["serve_handle_vs_channel_p50"] = round(channel["serve_handle_call_ms_p50"]
                                                   / channel["empty_message_ms_p50"], 1)
    rows = []
    for r in results:
        rows.append(f"| {r['batch']} | {r['method']} | {r['tok_s']} | {r['vs_none']}x | "
                    f"{r['vs_local']}x | {r['acceptance_length'] or '-'} | {r['same_output']} |")
    for r in results:
        del r["token_ids"]
    ahead1 = next(r for r in results if r["method"] == "replica-run-ahead" and r["batch"] == 1)
    targets_met = {"replica_run_ahead_ge_0.9x_local_batch1": ahead1["vs_local"] >= 0.9,
                   "replica_run_ahead_ge_1.3x_none_batch1": ahead1["vs_none"] >= 1.3,
                   "greedy_outputs_equal_at_batch1": all(r["same_output"] for r in results
                                                         if r["batch"] == 1)}
    command = "python " + " ".join(sys.argv)
    result = dict(benchmark="spec_replica", device=platform.processor() or platform.machine(),
                  cpus=os.cpu_count(), date=datetime.datetime.now(datetime.UTC).isoformat(),
                  commit=head_commit(), versions=dict(torch=torch.__version__,
                                                      python=platform.python_version()),
                  command=command,
                  model="SmolLM2-135M-Instruct (Q4_1 GGUF, the default CPU engine: bf16, int4)",
                  prompts=args.prompts, max_tokens=args.max_tokens, k=args.k,
                  threads=args.threads, draft_threads=args.draft_threads,
                  rounds=args.rounds, runs=results,
                  channel=channel, targets_met=targets_met)
    md = (f"# spec_replica ({result['device']}, {result['cpus']} cores, {result['date'][:10]}, "
          f"{result['commit']})\n\n`{command}`: SmolLM2-135M-Instruct greedy with its shipped "
          f"EAGLE head, {args.prompts} held-out chat prompts, {args.max_tokens} tokens each, "
          f"k = {args.k}; the target on {args.threads} thread(s), the replica process on "
          f"{args.draft_threads}; replica = strictly alternating (run_ahead off); tok/s: median "
          f"of {args.rounds} interleaved rounds, ratios: medians of the rounds' ratios.\n\n"
          "| batch | method | tok/s | vs none | vs local | acceptance length | same output |\n"
          "|---|---|---|---|---|---|---|\n" + "\n".join(rows)
          + "\n\nChannel (ms): replica rounds p50 "
          f"{channel['replica_round_trip_ms_p50']} / p99 {channel['replica_round_trip_ms_p99']}"
          f" (drafting included); an empty message p50 {channel['empty_message_ms_p50']} / p99 "
          f"{channel['empty_message_ms_p99']}; a Serve handle call p50 "
          f"{channel['serve_handle_call_ms_p50']} / p99 {channel['serve_handle_call_ms_p99']} "
          f"({channel['serve_handle_vs_channel_p50']}x). With run-ahead: rounds p50 "
          f"{channel['run_ahead_round_trip_ms_p50']} / p99 "
          f"{channel['run_ahead_round_trip_ms_p99']}; the replica prepared "
          f"{channel['run_ahead_rounds_prepared']} rounds ahead and answered "
          f"{channel['run_ahead_rounds_answered']} of its {channel['run_ahead_rounds_all']} "
          f"rounds from them.\n\nTargets: {targets_met}\n")
    write_result(args.out, result, md)
    print(md)


if __name__ == "__main__":
    main()
