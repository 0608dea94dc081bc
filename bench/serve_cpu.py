"""Serving overhead on CPU: client -> Ray Serve proxy (gRPC or HTTP) -> router -> worker vs the
in-process engine.

The same SmolLM2-135M-Instruct engine configuration (1 intra-op thread, default dtype) serves
the same prompts three ways:
- in-process: an `AsyncEngine` in this process, detokenizing itself (as `LLM` does);
- served (gRPC): `mxserve serve`'s application on a local Ray (1 router, 1 worker replica),
  called through Ray Serve's gRPC proxy on loopback with `grpc.aio` clients from this process;
- http: the same application through Ray Serve's HTTP proxy, OpenAI's streamed
  /v1/chat/completions read as server-sent events by aiohttp clients (a lean client, as the
  grpc.aio one is: the openai package's own parsing is the caller's cost, not the server's).
Every request is a chat question (distinct per request) with greedy decoding and exactly
`--max-tokens` output tokens (ignore_eos). Concurrency 1: requests one after another;
concurrency 16: `--rounds` rounds of 16 concurrent requests. The three paths take turns round
by round (both engines stay loaded), so load from elsewhere on the machine hits them alike, and
each goes first in turn: the served path that follows an in-process round finds the worker idle
and pays for waking it (up to ~15 ms of TTFT at 1 client when gRPC always went first). After a
warm-up of each.

Per request: TTFT = send -> first token; TPOT = (last token - first token) / (tokens - 1).
Reported: mean and p50/p90 of both, and output tok/s; overhead = served - in-process.
Targets (issue): at 1 client, serving adds <= 30 ms TTFT and <= 2 ms per output token; the
HTTP path is held to the same.

    python bench/serve_cpu.py                  # writes bench/results/serve_cpu.{json,md}
    python bench/serve_cpu.py --requests 4 --rounds 1 --out /tmp/s.json   # smoke
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
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE = dict(num_threads=1)
TARGETS = {"ttft_overhead_ms": 30.0, "tpot_overhead_ms": 2.0}
TOPICS = ["France", "Japan", "Brazil", "Canada", "Egypt", "India", "Italy", "Kenya", "Mexico",
          "Norway", "Peru", "Spain", "Chile", "Greece", "Ireland", "Nepal"]


def questions(n: int, offset: int = 0) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Tell me about {TOPICS[(i + offset) % 16]}, "
                                         f"part {(i + offset) // 16 + 1}."}] for i in range(n)]


def summarize(samples: list[tuple[float, float, int]], wall_s: float) -> dict:
    ttft = sorted(s[0] * 1e3 for s in samples)
    tpot = sorted(s[1] * 1e3 for s in samples)
    pct = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    return dict(num_requests=len(samples),
                ttft_ms=dict(mean=statistics.fmean(ttft), p50=pct(ttft, .5), p90=pct(ttft, .9)),
                tpot_ms=dict(mean=statistics.fmean(tpot), p50=pct(tpot, .5), p90=pct(tpot, .9)),
                output_tok_s=sum(s[2] for s in samples) / wall_s)


async def run_load(one, prompts: list, concurrency: int) -> tuple[list, float]:
    """`one(prompt) -> (ttft_s, tpot_s, tokens)`; `concurrency` clients share the prompts.
    Returns the samples and the wall time."""
    queue = list(prompts)
    samples = []

    async def client():
        while queue:
            samples.append(await one(queue.pop(0)))

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return samples, time.perf_counter() - start


def timed(stream_start: float, times: list[float], num_tokens: int) -> tuple[float, float, int]:
    first, last = times[0], times[-1]
    return first - stream_start, (last - first) / max(1, num_tokens - 1), num_tokens


# ---- the two paths ---------------------------------------------------------------------------
def inproc_client(args):
    """(one, close) for the in-process engine."""
    from mxserve.api.sampling_params import SamplingParams
    from mxserve.worker.async_engine import AsyncEngine
    from mxserve.worker.config import EngineConfig
    from mxserve.worker.engine import build_engine

    engine = build_engine(EngineConfig(load_progress=False, **ENGINE))
    tok = engine.tokenizer
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    async_engine = AsyncEngine(engine)
    async_engine.start()

    async def one(messages):
        start = time.perf_counter()
        ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
        times, n = [], 0
        async for out in async_engine.generate(ids, params):
            if out.new_token_ids:
                times.append(time.perf_counter())
                n += len(out.new_token_ids)
        return timed(start, times, n)

    async def close():
        async_engine.shutdown()

    return one, close


def start_server():
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    from mxserve.cluster.config import Resources, ServeConfig
    from mxserve.cluster.local import SERVE_ENV, deploy, wait_for_grpc
    from mxserve.cluster.redis_server import free_port

    for key, value in SERVE_ENV.items():  # as `mxserve serve` starts its local Ray
        os.environ.setdefault(key, value)

    config = ServeConfig(engine=ENGINE, grpc_port=free_port(), http_port=free_port(),
                         worker_resources=Resources(num_cpus=1),
                         router_resources=Resources(num_cpus=0.5), proxy_location="HeadOnly",
                         ingress="proxy")  # as its committed results ran
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=512 * 2**20,
             log_to_driver=False)
    deploy(config)
    wait_for_grpc(config)
    return config


def served_client(args, config):
    """(one, close) for the served path, over grpc.aio (16 channels)."""
    import grpc

    from mxserve.cluster.client import build_request
    from mxserve.proto import mxserve_pb2_grpc as pb_grpc

    channels = [grpc.aio.insecure_channel(f"localhost:{config.grpc_port}") for _ in range(16)]
    stubs = [pb_grpc.MxServeStub(c) for c in channels]
    metadata = (("application", config.app_name),)
    counter = iter(range(10**9))

    async def one(messages):
        stub = stubs[next(counter) % len(stubs)]
        request = build_request(messages=messages, temperature=0, max_tokens=args.max_tokens,
                                ignore_eos=True)
        start = time.perf_counter()
        times, n = [], 0
        async for r in stub.Generate(request, metadata=metadata):
            if r.token_ids:
                times.append(time.perf_counter())
                n += len(r.token_ids)
        return timed(start, times, n)

    async def close():
        for c in channels:
            await c.close()

    return one, close


def http_client(args, config):
    """(one, close) for OpenAI's HTTP API, streamed chat completions over aiohttp."""
    import aiohttp

    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64))
    url = f"http://127.0.0.1:{config.http_port}/v1/chat/completions"

    async def one(messages):
        body = {"messages": messages, "temperature": 0, "max_tokens": args.max_tokens,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        start = time.perf_counter()
        times, n = [], 0
        async with session.post(url, json=body) as reply:
            async for line in reply.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    times.append(time.perf_counter())
                elif chunk.get("usage"):  # (a chunk may carry several tokens' text)
                    n = chunk["usage"]["completion_tokens"]
        return timed(start, times, n)

    async def close():
        await session.close()

    return one, close


async def run_paired(args, config) -> tuple[dict, dict, dict]:
    """The paths on the same prompts, alternating round by round so that other load on the
    machine hits them alike."""
    paths = {"inproc": inproc_client(args), "served": served_client(args, config),
             "http": http_client(args, config)}
    try:
        for one, _ in paths.values():
            await run_load(one, questions(4, offset=100), 4)  # warm-up
        results: dict = {name: {} for name in paths}
        for concurrency in (1, 16):
            n = 1 if concurrency == 1 else 16
            samples: dict = {name: ([], 0.0) for name in paths}
            for r in range(args.requests if concurrency == 1 else args.rounds):
                prompts = questions(n, offset=r * n)
                names = list(paths)  # each path goes first in turn: whichever follows the
                names = names[r % 3:] + names[:r % 3]  # in-process run finds an idle worker
                for name in names:
                    got, wall = await run_load(paths[name][0], prompts, concurrency)
                    samples[name] = (samples[name][0] + got, samples[name][1] + wall)
            for name, (got, wall) in samples.items():
                results[name][f"c{concurrency}"] = summarize(got, wall)
                print(f"  {name} {concurrency:2d} client(s): "
                      f"{json.dumps(results[name][f'c{concurrency}'])}", flush=True)
        return results["inproc"], results["served"], results["http"]
    finally:
        for _, close in paths.values():
            await close()


# ---- report ----------------------------------------------------------------------------------
def overhead(served: dict, inproc: dict) -> dict:
    return {k: {"ttft_ms": served[k]["ttft_ms"]["mean"] - inproc[k]["ttft_ms"]["mean"],
                "ttft_p50_ms": served[k]["ttft_ms"]["p50"] - inproc[k]["ttft_ms"]["p50"],
                "tpot_ms": served[k]["tpot_ms"]["mean"] - inproc[k]["tpot_ms"]["mean"],
                "tpot_p50_ms": served[k]["tpot_ms"]["p50"] - inproc[k]["tpot_ms"]["p50"]}
            for k in served}


PATHS = {"inproc": "in-process", "served": "gRPC", "http": "HTTP (OpenAI)"}


def markdown(report: dict) -> str:
    rows = ["| clients | path | TTFT mean (p50, p90) ms | TPOT mean (p50, p90) ms | tok/s |",
            "|---|---|---|---|---|"]
    for k in ("c1", "c16"):
        for path, name in PATHS.items():
            r = report[path][k]
            t, p = r["ttft_ms"], r["tpot_ms"]
            rows.append(f"| {k[1:]} | {name} | {t['mean']:.1f} ({t['p50']:.1f}, {t['p90']:.1f}) "
                        f"| {p['mean']:.2f} ({p['p50']:.2f}, {p['p90']:.2f}) "
                        f"| {r['output_tok_s']:.1f} |")
        for key, name in (("overhead", "gRPC"), ("http_overhead", "HTTP"),
                          ("http_vs_grpc", "HTTP - gRPC")):
            o = report[key][k]
            rows.append(f"| {k[1:]} | **{name} overhead** | **{o['ttft_ms']:+.1f}** "
                        f"(p50 {o['ttft_p50_ms']:+.1f}) | **{o['tpot_ms']:+.2f}** "
                        f"(p50 {o['tpot_p50_ms']:+.2f}) | |")
    c1, h, meets = report["overhead"]["c1"], report["http_overhead"]["c1"], report["meets"]
    word = lambda ok: "met" if ok else "NOT met"  # noqa: E731
    verdict = (f"Targets at 1 client: TTFT overhead <= {TARGETS['ttft_overhead_ms']:.0f} ms "
               f"(mean {c1['ttft_ms']:+.1f}: {word(meets['ttft'])}; p50 {c1['ttft_p50_ms']:+.1f}: "
               f"{word(meets['ttft_p50'])}), TPOT overhead <= {TARGETS['tpot_overhead_ms']:.0f} ms "
               f"(mean {c1['tpot_ms']:+.2f}: {word(meets['tpot'])}; p50 {c1['tpot_p50_ms']:+.2f}: "
               f"{word(meets['tpot_p50'])}); over HTTP: TTFT {h['ttft_ms']:+.1f} "
               f"({word(meets['http_ttft'])}), TPOT {h['tpot_ms']:+.2f} "
               f"({word(meets['http_tpot'])}). Load average (1 min) from other work on the "
               f"machine: "
               f"{report['machine']['loadavg_start']:.2f} at the start, "
               f"{report['machine']['loadavg_end']:.2f} at the end.")
    note = ("The in-process engine shares this process's interpreter with the clients' event "
            "loop; a served engine runs in a process of its own, so a served path can show a "
            "negative overhead. HTTP clients are aiohttp, gRPC clients grpc.aio, both lean.")
    return (f"# serve_cpu: serving overhead, SmolLM2-135M-Instruct, {report['machine']['cpus']} "
            f"CPUs\n\n{report['max_tokens']} greedy output tokens per chat request; "
            f"`{report['command']}` ({report['date']}).\n\n" + "\n".join(rows) + "\n\n" + verdict
            + "\n\n" + note + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--requests", type=int, default=24, help="requests at 1 client")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of 16 requests at 16")
    parser.add_argument("--out", default=os.path.join(REPO, "bench", "results", "serve_cpu.json"))
    args = parser.parse_args()

    import torch

    loadavg_start = os.getloadavg()[0]
    config = start_server()
    try:
        inproc, served, http = asyncio.run(run_paired(args, config))
    finally:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()
    over, http_over = overhead(served, inproc), overhead(http, inproc)
    report = dict(
        benchmark="serve_cpu",
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        command="python bench/serve_cpu.py " + " ".join(sys.argv[1:]),
        machine=dict(cpus=os.cpu_count(), platform=platform.platform(),
                     loadavg_start=loadavg_start, loadavg_end=os.getloadavg()[0],
                     python=platform.python_version(), torch=torch.__version__,
                     ray=__import__("ray").__version__, grpcio=__import__("grpc").__version__),
        engine=ENGINE, max_tokens=args.max_tokens, targets=TARGETS,
        inproc=inproc, served=served, http=http, overhead=over, http_overhead=http_over,
        http_vs_grpc=overhead(http, served),
        meets=dict(ttft=over["c1"]["ttft_ms"] <= TARGETS["ttft_overhead_ms"],
                   tpot=over["c1"]["tpot_ms"] <= TARGETS["tpot_overhead_ms"],
                   ttft_p50=over["c1"]["ttft_p50_ms"] <= TARGETS["ttft_overhead_ms"],
                   tpot_p50=over["c1"]["tpot_p50_ms"] <= TARGETS["tpot_overhead_ms"],
                   http_ttft=http_over["c1"]["ttft_ms"] <= TARGETS["ttft_overhead_ms"],
                   http_tpot=http_over["c1"]["tpot_ms"] <= TARGETS["tpot_overhead_ms"]))
    report["targets_met"] = report["meets"]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    md = markdown(report)
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
