"""Streaming at many concurrent requests through the whole served path, on CPU.

A tiny random Llama (1 layer, word-level tokenizer: tests/conftest.py's checkpoint) steps in
about a millisecond, so the engine produces tokens faster than one message per token can cross
worker -> Ray Serve -> router -> gRPC. This measures what a client gets when the engine is not
the bottleneck: `--concurrency` gRPC streams at once (greedy, `--max-tokens` tokens each,
ignore_eos), on a local Ray with 1 worker replica and 1 router, as `mxserve serve` deploys them.

Reported per run: output tokens/s over all streams, messages a request received, TTFT and the
time per output token (p50/p99). `--baseline REV` runs the same measurement from a git worktree
of REV in a subprocess (its own Ray), one after the other, and reports ratios, REV with
`--baseline-args` (e.g. "--ingress"). `--direct` / `--no-direct` run this checkout with
ServeConfig.streaming.direct on / off (cluster/output_channel.py; default: the config's), and
`--streams-per-token N` with that coalescing. This checkout
goes through Serve's proxies (ServeConfig.ingress "proxy") unless `--ingress`: the router
answers the ports itself ("routers", cluster/router_grpc.py and router_http.py). `--http`
streams over OpenAI's HTTP API (/v1/completions, SSE; aiohttp clients) instead of gRPC.

    python bench/serve_stream.py --baseline 42e0fa9 --out bench/results/serve_stream.json
    python bench/serve_stream.py --direct --baseline HEAD --out ...   # direct vs Serve stream
    python bench/serve_stream.py --direct --ingress --baseline HEAD --out ...
    python bench/serve_stream.py --ingress --baseline REV --baseline-args=--ingress --out ...
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "lib"))
from revision import head_commit, run_inner, write_result  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def measure(concurrency: int, max_tokens: int, rounds: int, direct: bool | None = None,
            ingress: bool = False, http: bool = False,
            streams_per_token: int | None = None) -> dict:
    """Start Ray + the app with the tiny model, run `rounds` waves of `concurrency` streams."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import grpc
    import ray

    import mxserve
    from mxserve.cluster.client import build_request
    from mxserve.cluster.config import Resources, ServeConfig
    from mxserve.cluster.local import SERVE_ENV, deploy, wait_for_grpc
    from mxserve.cluster.redis_server import free_fixed_port
    from mxserve.proto import mxserve_pb2_grpc as pb_grpc

    sys.path.insert(0, str(REPO / "tests"))
    from conftest import make_tiny_checkpoint

    for key, value in SERVE_ENV.items():
        os.environ.setdefault(key, value)
    model = make_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny", num_hidden_layers=1,
                                 max_position_embeddings=4096)
    config = ServeConfig(model=str(model), engine=dict(dtype="float32", num_threads=1,
                                                       max_num_seqs=concurrency),
                         grpc_port=free_fixed_port(), http_port=free_fixed_port(),
                         worker_resources=Resources(num_cpus=1),
                         router_resources=Resources(num_cpus=0.5), proxy_location="HeadOnly",
                         ingress="routers" if ingress else "proxy",
                         streaming={k: v for k, v in (("direct", direct), (
                             "streams_per_token", streams_per_token)) if v is not None})
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=512 * 2**20,
             log_to_driver=False)
    try:
        deploy(config)
        wait_for_grpc(config)
        if http:
            samples = asyncio.run(_load_http(config, concurrency, max_tokens, rounds))
        else:
            samples = asyncio.run(_load(config, build_request, grpc, pb_grpc, concurrency,
                                        max_tokens, rounds))
    finally:
        from ray import serve
        serve.shutdown()
        ray.shutdown()
    wall = sum(w for w, _ in samples)
    reqs = [r for _, rs in samples for r in rs]
    tokens = sum(r["tokens"] for r in reqs)
    assert all(r["tokens"] == max_tokens for r in reqs), "a stream ended short"
    pct = lambda xs, q: sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    tpot = [r["tpot_ms"] for r in reqs]
    ttft = [r["ttft_ms"] for r in reqs]
    return {"mxserve": os.path.dirname(mxserve.__file__), "direct": config.streaming.direct,
            "ingress": ingress,
            "streaming": config.streaming.model_dump(),
            "api": "http" if http else "grpc",
            "concurrency": concurrency,
            "max_tokens": max_tokens, "requests": len(reqs),
            "output_tok_s": round(tokens / wall, 1),
            "messages_per_request": round(statistics.fmean(r["messages"] for r in reqs), 1),
            "ttft_ms": {"p50": round(pct(ttft, .5), 1), "p99": round(pct(ttft, .99), 1)},
            "tpot_ms": {"p50": round(pct(tpot, .5), 2), "p99": round(pct(tpot, .99), 2)}}


def _record(start: float, times: list[float], tokens: int, messages: int) -> dict:
    """One stream's figures: `times` are when its token-bearing messages came."""
    return {"tokens": tokens, "messages": messages, "ttft_ms": (times[0] - start) * 1e3,
            "tpot_ms": (times[-1] - times[0]) / max(1, tokens - 1) * 1e3}


async def _waves(one, concurrency: int, rounds: int) -> list:
    """4 warm-up requests, then `rounds` waves of `concurrency` at once: [(wall s, results)]."""
    await asyncio.gather(*(one(i) for i in range(4)))
    waves = []
    for w in range(rounds):
        t0 = time.perf_counter()
        got = await asyncio.gather(*(one(w * concurrency + i) for i in range(concurrency)))
        waves.append((time.perf_counter() - t0, got))
    return waves


async def _load(config, build_request, grpc, pb_grpc, concurrency, max_tokens, rounds):
    channels = [grpc.aio.insecure_channel(f"localhost:{config.grpc_port}") for _ in range(8)]
    stubs = [pb_grpc.MxServeStub(c) for c in channels]
    metadata = (("application", config.app_name),)

    async def one(i: int) -> dict:
        request = build_request(f"w{5 + i % 200} w{6 + i % 190} w7", temperature=0,
                                max_tokens=max_tokens, ignore_eos=True)
        start, times, tokens, messages = time.perf_counter(), [], 0, 0
        async for r in stubs[i % len(stubs)].Generate(request, metadata=metadata):
            messages += 1
            if r.token_ids:
                times.append(time.perf_counter())
                tokens += len(r.token_ids)
        return _record(start, times, tokens, messages)

    try:
        return await _waves(one, concurrency, rounds)
    finally:
        for c in channels:
            await c.close()


async def _load_http(config, concurrency, max_tokens, rounds):
    """_load over OpenAI's /v1/completions (streamed; usage in the last event)."""
    import aiohttp

    url = f"http://127.0.0.1:{config.http_port}/v1/completions"

    async def one(session, i: int) -> dict:
        body = {"model": config.served_model_name, "prompt": f"w{5 + i % 200} w{6 + i % 190} w7",
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        start, times, tokens, messages = time.perf_counter(), [], 0, 0
        async with session.post(url, json=body) as reply:
            assert reply.status == 200, await reply.text()
            async for line in reply.content:
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                if event.get("choices") and event["choices"][0].get("text"):
                    messages += 1
                    times.append(time.perf_counter())
        return _record(start, times, tokens, messages)

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        return await _waves(lambda i: one(session, i), concurrency, rounds)


def no_regression(ours: dict, base: dict | None, slack: float = 0.1) -> dict | None:
    """Issue 31's CPU target, against the baseline of the same run: no figure worse than it by
    more than `slack` (this box's run-to-run spread)."""
    if base is None:
        return None
    out = {"output_tok_s": ours["output_tok_s"] >= (1 - slack) * base["output_tok_s"]}
    for key in ("ttft_ms", "tpot_ms"):
        for q in ("p50", "p99"):
            out[f"{key[:-3]}_{q}"] = ours[key][q] <= (1 + slack) * base[key][q]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--baseline", help="a git revision measured the same way, for ratios")
    ap.add_argument("--direct", action=argparse.BooleanOptionalAction, default=None,
                    help="this checkout with ServeConfig.streaming.direct on / off (default: "
                         "the config's default; the baseline as is)")
    ap.add_argument("--ingress", action="store_true",
                    help="this checkout with ServeConfig.ingress routers (else proxy)")
    ap.add_argument("--streams-per-token", type=int,
                    help="this checkout with ServeConfig.streaming.streams_per_token N")
    ap.add_argument("--http", action="store_true",
                    help="OpenAI's HTTP API instead of gRPC, for this run and the baseline")
    ap.add_argument("--baseline-args", default="",
                    help="the baseline run's own flags, e.g. '--ingress'")
    ap.add_argument("--out", default="/tmp/serve_stream.json")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.inner:  # a subprocess (revision.run_inner): one JSON line
        print(json.dumps(measure(args.concurrency, args.max_tokens, args.rounds, args.direct,
                                 args.ingress, args.http, args.streams_per_token)))
        return
    inner = ["--concurrency", str(args.concurrency), "--max-tokens", str(args.max_tokens),
             "--rounds", str(args.rounds)] + ["--http"] * args.http
    direct = [] if args.direct is None else ["--direct" if args.direct else "--no-direct"]
    ours = run_inner(__file__, inner + direct + ["--ingress"] * args.ingress
                     + (["--streams-per-token", str(args.streams_per_token)]
                        if args.streams_per_token else []))
    base = (run_inner(__file__, inner + args.baseline_args.split(), args.baseline)
            if args.baseline else None)
    commit = head_commit()
    result = {"bench": "serve_stream", "device": "CPU (2 cores)",
              "date": datetime.date.today().isoformat(),
              "versions": {"python": platform.python_version()}, "commit": commit,
              "command": "python bench/serve_stream.py " + " ".join(sys.argv[1:]),
              "loadavg": os.getloadavg(), "this": ours, "baseline": args.baseline,
              "baseline_result": base, "targets_met": no_regression(ours, base)}
    lines = ["| | this | baseline | this / baseline |", "|---|---|---|---|"]
    for key, label in [("output_tok_s", "output tok/s"),
                       ("messages_per_request", "messages a request")]:
        b = base[key] if base else None
        lines.append(f"| {label} | {ours[key]} | {b} | "
                     f"{round(ours[key] / b, 2) if b else '-'} |")
    for key in ("ttft_ms", "tpot_ms"):
        for q in ("p50", "p99"):
            b = base[key][q] if base else None
            lines.append(f"| {key[:-3]} {q} ms | {ours[key][q]} | {b} | "
                         f"{round(ours[key][q] / b, 2) if b else '-'} |")
    write_result(args.out, result,
                 f"# serve_stream ({result['device']}, {result['date']}, commit {commit}, "
                 f"baseline {args.baseline})\n\n`{result['command']}`: {args.concurrency} "
                 f"concurrent streams of {args.max_tokens} tokens, {args.rounds} waves, tiny "
                 f"model (1 layer), 1 worker + 1 router on local Ray"
                 f"; this run with streaming.direct {ours['direct']}, streams_per_token "
                 f"{ours['streaming']['streams_per_token']}"
                 f"{'; the baseline with ' + args.baseline_args if args.baseline_args else ''}"
                 f"{'; this run through the router port' if args.ingress else ''}"
                 f"{'; OpenAI HTTP API (SSE), both runs' if args.http else ''}.\n\n"
                 + "\n".join(lines) + f"\n\nNo regression (10% slack): "
                 f"{json.dumps(result['targets_met'])}\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
