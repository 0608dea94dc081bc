"""Overload on CPU: 10x a server's capacity, shed (mxserve's admission) vs queued (the baseline).

One SmolLM2-135M-Instruct worker replica (1 intra-op thread, max_num_seqs 4) on a local Ray,
called through Ray Serve's gRPC proxy with `grpc.aio` clients from this process. Every request
is a distinct chat question, greedy, exactly `--max-tokens` output tokens. Phases, per variant:
- unloaded: `--unloaded` requests one after another;
- at capacity: 4 clients, closed loop, `--capacity-s` seconds;
- overload: 40 clients (10x the capacity), closed loop, `--overload-s` seconds; a rejected
  client waits the server's `retry-after-ms` hint (jittered 0.5-1.5x) and sends again.
Variants, the same load:
- shed: max_queued_requests 0 (capacity 4): the proxy and the router reject the excess at once;
- queued (baseline, what a server without admission does): max_queued_requests 36 (capacity
  40): every request is admitted and waits in the worker's queue.
Reported per phase: TTFT p50/p90/p99 (admitted requests), rejection latency, requests/s, and
the router's and the worker's resident memory every 10 s of the overload.
Targets (issue 27): at 10x capacity the excess is rejected fast, the admitted p99 TTFT stays
within 3x of the unloaded p99, memory stays flat.

    python bench/overload.py      # ~5 min; writes bench/results/overload.{json,md}
    python bench/overload.py --unloaded 10 --capacity-s 5 --overload-s 10 --out /tmp/o.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lib.revision import head_commit, write_result  # noqa: E402

ENGINE = dict(num_threads=1, max_num_seqs=4)
VARIANTS = {"shed": 0, "queued": 36}  # max_queued_requests
MB = 2**20


def pct(xs: list[float]) -> dict:
    xs = sorted(x * 1e3 for x in xs)
    if not xs:
        return {}
    return {f"p{q}": round(xs[min(len(xs) - 1, int(q / 100 * len(xs)))], 1)
            for q in (50, 90, 99)}


def audits(app: str, deployment: str, want: int = 1) -> list[dict]:
    from ray import serve

    handle = serve.get_deployment_handle(deployment, app_name=app)
    seen: dict = {}
    for _ in range(100):
        audit = handle.audit.remote().result(timeout_s=60)
        seen[audit["replica_id"]] = audit
        if len(seen) == want:
            break
    return list(seen.values())


async def run_variant(args, config) -> dict:
    import grpc

    from mxserve.proto import mxserve_pb2 as pb

    counter = iter(range(10**9))
    jitter = random.Random(4)
    metadata = (("application", config.app_name),)

    def request() -> pb.GenerateRequest:
        i = next(counter)
        return pb.GenerateRequest(
            chat=pb.ChatMessages(messages=[pb.ChatMessage(
                role="user", content=f"Question {i}: what is {i % 97} times {i % 13 + 2}?")]),
            sampling_params=pb.SamplingParams(max_tokens=args.max_tokens, ignore_eos=True,
                                              temperature=0))

    async with grpc.aio.insecure_channel(f"127.0.0.1:{config.grpc_port}") as channel:
        call = channel.unary_stream("/mxserve.v1.MxServe/Generate",
                                    request_serializer=pb.GenerateRequest.SerializeToString,
                                    response_deserializer=pb.GenerateResponse.FromString)

        async def one() -> tuple[str, float, float | None]:
            start = time.monotonic()
            first = None
            try:
                async for _ in call(request(), metadata=metadata, timeout=600):
                    first = first or time.monotonic() - start
                return "ok", first, None
            except grpc.aio.AioRpcError as e:
                hint = dict(e.trailing_metadata() or ()).get("retry-after-ms")
                return e.code().name, time.monotonic() - start, \
                    int(hint) / 1e3 if hint else None

        async def clients(n: int, seconds: float, memory: list | None = None) -> dict:
            results: list = []
            stop = time.monotonic() + seconds

            async def client():
                while time.monotonic() < stop:
                    result = await one()
                    results.append(result)
                    if result[0] != "ok":
                        await asyncio.sleep((result[2] or 1.0) * jitter.uniform(0.5, 1.5))

            async def sample():
                while time.monotonic() < stop - 5:
                    await asyncio.sleep(10)
                    memory.append(await asyncio.to_thread(lambda: [
                        a["rss_bytes"] for a in audits(config.app_name, "Router")
                        + audits(config.app_name, "Worker")]))

            start = time.monotonic()
            await asyncio.gather(*(client() for _ in range(n)),
                                 *([sample()] if memory is not None else []))
            wall = time.monotonic() - start
            ok = [r[1] for r in results if r[0] == "ok"]
            shed = [r for r in results if r[0] != "ok"]
            return dict(clients=n, seconds=round(wall, 1), admitted=len(ok),
                        admitted_per_s=round(len(ok) / wall, 2), ttft_ms=pct(ok),
                        rejected=len(shed), rejected_codes=sorted({r[0] for r in shed}),
                        rejection_ms=pct([r[1] for r in shed]))

        for _ in range(3):
            await one()
        unloaded = [(await one())[1] for _ in range(args.unloaded)]
        at_capacity = await clients(4, args.capacity_s)
        memory: list = []
        overload = await clients(40, args.overload_s, memory)
    return dict(unloaded=dict(requests=len(unloaded), ttft_ms=pct(unloaded)),
                at_capacity=at_capacity, overload=overload,
                rss_mb=[[round(b / MB, 1) for b in row] for row in memory])


def markdown(report: dict) -> str:
    rows = ["| variant | phase | clients | admitted/s | TTFT p50 / p90 / p99 ms | rejected | "
            "rejection p50 / p99 ms |", "|---|---|---|---|---|---|---|"]
    for name, v in report["variants"].items():
        u = v["unloaded"]["ttft_ms"]
        rows.append(f"| {name} | unloaded | 1 | | {u['p50']} / {u['p90']} / {u['p99']} | | |")
        for phase in ("at_capacity", "overload"):
            p = v[phase]
            t, r = p["ttft_ms"], p["rejection_ms"]
            rows.append(f"| {name} | {phase.replace('_', ' ')} | {p['clients']} | "
                        f"{p['admitted_per_s']} | {t.get('p50')} / {t.get('p90')} / "
                        f"{t.get('p99')} | {p['rejected']} | "
                        f"{r.get('p50', '')} / {r.get('p99', '')} |")
    shed = report["variants"]["shed"]
    met = report["targets_met"]
    lines = [f"# overload: 10x capacity, shed vs queued (SmolLM2-135M-Instruct, "
             f"{report['machine']['cpus']} CPUs)", "",
             f"`{report['command']}` ({report['date']}). One worker, max_num_seqs 4; "
             f"{report['max_tokens']} greedy tokens a request.", "", *rows, "",
             f"Shed: admitted p99 TTFT at 10x {shed['overload']['ttft_ms']['p99']} ms = "
             f"{report['ratios']['shed_overload_p99_vs_unloaded_p99']}x the unloaded p99, "
             f"{report['ratios']['shed_overload_p99_vs_capacity_p99']}x that at capacity; "
             f"queued (baseline): {report['ratios']['queued_overload_p99_vs_unloaded_p99']}x "
             "the unloaded p99. Router / worker RSS during the overload (MB): "
             f"{shed['rss_mb']}.", "",
             "Targets: " + ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in met.items())
             + "."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--unloaded", type=int, default=60)
    parser.add_argument("--capacity-s", type=float, default=20)
    parser.add_argument("--overload-s", type=float, default=60)
    parser.add_argument("--out", default=os.path.join(REPO, "bench", "results", "overload.json"))
    args = parser.parse_args()

    import ray
    import torch
    from ray import serve

    from mxserve.cluster.config import Resources, ServeConfig
    from mxserve.cluster.local import SERVE_ENV, deploy, wait_for_grpc
    from mxserve.cluster.redis_server import free_port

    for key, value in SERVE_ENV.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=512 * MB,
             logging_level="ERROR", log_to_driver=False)
    variants = {}
    try:
        grpc_port = free_port()
        for name, queued in VARIANTS.items():
            config = ServeConfig(engine=ENGINE, grpc_port=grpc_port, http_port=free_port(),
                                 max_queued_requests=queued, app_name=f"overload-{name}",
                                 route_prefix=f"/overload-{name}",
                                 ingress="proxy",  # apps on one port; the proxy sheds first
                                 worker_resources=Resources(num_cpus=0.5),
                                 router_resources=Resources(num_cpus=0.25))
            deploy(config)
            wait_for_grpc(config)
            variants[name] = asyncio.run(run_variant(args, config))
            serve.delete(config.app_name)
            print(name, json.dumps(variants[name]), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    shed, queued = variants["shed"], variants["queued"]
    unloaded_p99 = shed["unloaded"]["ttft_ms"]["p99"]
    ratios = dict(
        shed_overload_p99_vs_unloaded_p99=round(
            shed["overload"]["ttft_ms"]["p99"] / unloaded_p99, 2),
        shed_overload_p99_vs_capacity_p99=round(
            shed["overload"]["ttft_ms"]["p99"] / shed["at_capacity"]["ttft_ms"]["p99"], 2),
        queued_overload_p99_vs_unloaded_p99=round(
            queued["overload"]["ttft_ms"]["p99"] / queued["unloaded"]["ttft_ms"]["p99"], 2))
    rss = shed["rss_mb"]
    targets_met = dict(
        excess_rejected_fast=bool(shed["overload"]["rejected"])
        and shed["overload"]["rejection_ms"]["p99"] <= shed["at_capacity"]["ttft_ms"]["p99"],
        admitted_p99_ttft_within_3x_unloaded=ratios["shed_overload_p99_vs_unloaded_p99"] <= 3,
        memory_flat=len(rss) >= 2 and all(b <= a * 1.05 + 8 for a, b in zip(rss[0], rss[-1])))
    report = dict(
        benchmark="overload",
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        commit=head_commit(), command="python bench/overload.py " + " ".join(sys.argv[1:]),
        machine=dict(cpus=os.cpu_count(), platform=platform.platform(),
                     python=platform.python_version(), torch=torch.__version__,
                     ray=ray.__version__, grpcio=__import__("grpc").__version__),
        engine=ENGINE, max_tokens=args.max_tokens, variants=variants, ratios=ratios,
        targets_met=targets_met)
    md = markdown(report)
    write_result(args.out, report, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
