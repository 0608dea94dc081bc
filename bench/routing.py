"""Prefix-aware routing vs round robin vs power of two choices, served end to end on CPU.

Cluster: a local Ray with 4 SmolLM2-135M-Instruct worker replicas (1 intra-op thread each), one
router, Ray Serve's gRPC proxy, and a local redis-server for the prefix index. Each worker's KV
pool is `--kv-blocks` 16-token blocks (default 320 = 5120 tokens): room for two or three tenants'
system prompts beside the running requests. Memory is what makes routing matter: a worker that
sees every tenant keeps evicting their prompts.

Workload (multi-tenant): `--tenants` tenants (default 8), each with its own system prompt of
exactly `--system-tokens` tokens (KJV text through the SmolLM2 tokenizer; whole 16-token blocks),
and many short questions (one KJV verse each, 8-48 tokens); requests of all tenants interleave at
random, arriving as a Poisson process at `--rate` requests/s; each decodes `--max-tokens`
greedy tokens (ignore_eos). Prompts are sent as token ids (system + question).

Every policy serves the same request sequence with the same arrival times, each on a fresh
deployment (cold caches), one after another in this run:
- prefix: mxserve's router (cached prefix tokens from the Redis index minus a load penalty);
- round_robin: each request to the next worker;
- power_of_two: Ray Serve's default (the less loaded of two random workers).

Reported per policy: prefix-cache hit rate (cached prompt tokens / prompt tokens, from each
response's usage), TTFT p50/p99 (send -> first token), end-to-end latency p50/p99, throughput
(requests and output tokens per second from the first send to the last completion), and the
requests each worker got. Targets (issue 5): hit rate >= 85%, TTFT p50 >= 2x better than round
robin. Then: index lookup latency with `--index-blocks` (1M) blocks from 16 workers in a fresh
redis-server, p99 <= 2 ms.

    python bench/routing.py                       # writes bench/results/routing.{json,md}
    python bench/routing.py --requests 24 --out /tmp/r.json --index-blocks 20000   # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.util
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POLICIES = ("prefix", "round_robin", "power_of_two")
TARGETS = {"hit_rate": 0.85, "ttft_p50_speedup_vs_round_robin": 2.0, "lookup_p99_ms": 2.0}


# ---- workload --------------------------------------------------------------------------------
def kjv_verses() -> list[str]:
    spec = importlib.util.find_spec("bible")
    path = os.path.join(spec.submodule_search_locations[0], "data", "kjv.jsonl")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def workload(args, tokenizer) -> list[tuple[float, int, list[int]]]:
    """(arrival time s, tenant, prompt token ids) for every request, in arrival order."""
    rng = random.Random(args.seed)
    verses = kjv_verses()
    systems = []
    for t in range(args.tenants):
        start = rng.randrange(len(verses) - 400)
        text = f"You are the assistant of tenant {t}. Answer from this text.\n" + " ".join(
            verses[start:start + 200])
        ids = tokenizer.encode(text, add_special_tokens=False)[:args.system_tokens]
        assert len(ids) == args.system_tokens, "a system prompt came out short"
        systems.append(ids)
    requests, now = [], 0.0
    for _ in range(args.requests):
        now += rng.expovariate(args.rate)
        tenant = rng.randrange(args.tenants)
        question = tokenizer.encode("\nQuestion: " + rng.choice(verses),
                                    add_special_tokens=False)[:48]
        requests.append((now, tenant, systems[tenant] + question))
    return requests


# ---- the cluster -----------------------------------------------------------------------------
def base_config(args, redis_url: str):
    from mxserve.cluster.config import Resources, ServeConfig
    from mxserve.cluster.redis_server import free_port

    return ServeConfig(
        num_workers=args.workers, redis_url=redis_url, grpc_port=free_port(),
        http_port=free_port(), proxy_location="HeadOnly", max_queued_requests=256,
        engine=dict(num_threads=1, num_kv_blocks=args.kv_blocks, max_num_seqs=16),
        worker_resources=Resources(num_cpus=0.25), router_resources=Resources(num_cpus=0.25))


async def run_policy(args, config, requests) -> dict:
    """Replay `requests` against the deployed app at their arrival times."""
    import grpc

    from mxserve.cluster.client import build_request
    from mxserve.proto import mxserve_pb2_grpc as pb_grpc

    channels = [grpc.aio.insecure_channel(f"localhost:{config.grpc_port}") for _ in range(8)]
    stubs = [pb_grpc.MxServeStub(c) for c in channels]
    metadata = (("application", config.app_name),)

    async def one(i: int, arrival: float, prompt: list[int], t0: float) -> dict:
        await asyncio.sleep(max(0.0, t0 + arrival - time.perf_counter()))
        request = build_request(prompt, temperature=0, max_tokens=args.max_tokens,
                                ignore_eos=True)
        sent = time.perf_counter()
        first = last = None
        num_tokens = 0
        async for r in stubs[i % len(stubs)].Generate(request, metadata=metadata):
            last = time.perf_counter()
            first = first or last
            num_tokens += len(r.token_ids)
            if r.finish_reason:
                usage = r.usage
        return dict(sent=sent, ttft=first - sent, e2e=last - sent, end=last,
                    tokens=num_tokens, prompt=usage.prompt_tokens, cached=usage.cached_tokens)

    try:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(i, a, p, t0) for i, (a, _, p) in
                                         enumerate(requests)))
    finally:
        for c in channels:
            await c.close()
    return summarize(results)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summarize(results: list[dict]) -> dict:
    ttft = [r["ttft"] * 1e3 for r in results]
    e2e = [r["e2e"] * 1e3 for r in results]
    span = max(r["end"] for r in results) - min(r["sent"] for r in results)
    return dict(num_requests=len(results),
                hit_rate=round(sum(r["cached"] for r in results)
                               / sum(r["prompt"] for r in results), 4),
                ttft_ms=dict(p50=round(pct(ttft, .5), 1), p99=round(pct(ttft, .99), 1),
                             mean=round(statistics.fmean(ttft), 1)),
                e2e_ms=dict(p50=round(pct(e2e, .5), 1), p99=round(pct(e2e, .99), 1)),
                requests_per_s=round(len(results) / span, 3),
                output_tok_s=round(sum(r["tokens"] for r in results) / span, 1))


def per_worker_requests(config) -> list[int]:
    from mxserve.cluster.client import Client

    with Client(f"localhost:{config.grpc_port}", config.app_name) as client:
        return sorted((w.num_requests_total for w in client.health().workers), reverse=True)


def serve_policies(args, requests) -> dict:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve

    from mxserve.cluster.local import SERVE_ENV, deploy, wait_for_grpc
    from mxserve.cluster.redis_server import LocalRedis

    for key, value in SERVE_ENV.items():  # as `mxserve serve` starts its local Ray
        os.environ.setdefault(key, value)
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=512 * 2**20,
             log_to_driver=False)
    out = {}
    with LocalRedis() as redis:
        base = base_config(args, redis.url)
        for policy in args.policies:
            config = base.model_copy(update=dict(
                app_name=f"bench-{policy}", routing=base.routing.model_copy(
                    update=dict(policy=policy))))
            deploy(config)
            wait_for_grpc(config)
            print(f"{policy}: deployed, {len(requests)} requests ...", flush=True)
            result = asyncio.run(run_policy(args, config, requests))
            result["requests_per_worker"] = per_worker_requests(config)
            out[policy] = result
            print(f"  {json.dumps(result)}", flush=True)
            serve.delete(config.app_name)
    serve.shutdown()
    ray.shutdown()
    return out


# ---- the index at scale ----------------------------------------------------------------------
def index_lookup_latency(args) -> dict:
    """`--index-blocks` blocks spread over 16 workers (chains of 64 blocks, each chain held by
    1-3 workers) in a fresh redis-server; then lookups of 64-block prompts, one at a time."""
    from mxserve.api.prefix_index import PrefixIndex
    from mxserve.cluster.redis_server import LocalRedis

    rng = random.Random(args.seed)
    chains = [[rng.getrandbits(128) for _ in range(64)] for _ in range(args.index_blocks // 64)]

    async def main(url: str) -> dict:
        index = PrefixIndex.from_url(url, "bench")
        held: dict[int, list[int]] = {w: [] for w in range(16)}
        for chain in chains:
            for w in rng.sample(range(16), rng.randint(1, 3)):
                held[w].extend(chain)
        start = time.perf_counter()
        for w, hashes in held.items():
            await index.apply(f"w{w}", 1, 0, [], [], reset=True)
            for seq, i in enumerate(range(0, len(hashes), 4096), start=1):
                await index.apply(f"w{w}", 1, seq, hashes[i:i + 4096], [])
        fill_s = time.perf_counter() - start
        num_keys = await index.client.dbsize()
        memory = (await index.client.info("memory"))["used_memory"]
        probes = [rng.choice(chains)[:rng.choice([16, 32, 64])] for _ in range(args.lookups)]
        probes += [[rng.getrandbits(128)] + rng.choice(chains)[1:64]  # a miss at block 0
                   for _ in range(args.lookups // 10)]
        rng.shuffle(probes)
        for p in probes[:100]:  # warm: script loaded, connection open
            await index.lookup(p)
        times = []
        for p in probes:
            t = time.perf_counter()
            await index.lookup(p)
            times.append((time.perf_counter() - t) * 1e3)
        await index.close()
        return dict(num_blocks=len(chains) * 64, num_workers=16, num_block_keys=num_keys,
                    total_entries=sum(len(h) for h in held.values()),
                    redis_used_memory_mb=round(memory / 2**20, 1), fill_s=round(fill_s, 1),
                    num_lookups=len(times), lookup_ms=dict(
                        p50=round(pct(times, .5), 3), p99=round(pct(times, .99), 3),
                        max=round(max(times), 3)))

    with LocalRedis() as redis:
        return asyncio.run(main(redis.url))


# ---- report ----------------------------------------------------------------------------------
def environment() -> dict:
    import ray
    import redis
    import torch

    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                   platform.processor())
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip() or None
    from mxserve.cluster.redis_server import redis_server_binary
    server = subprocess.run([redis_server_binary(), "--version"], capture_output=True,
                            text=True).stdout.split()[2]
    return {"device": {"cpu": cpu, "cores": os.cpu_count(),
                       "load_average_at_end": [round(x, 2) for x in os.getloadavg()]},
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "ray": ray.__version__, "redis_py": redis.__version__,
                         "redis_server": server, "mxserve_commit": commit},
            "command": " ".join([os.path.basename(sys.executable), *sys.argv])}


def markdown(report: dict) -> str:
    cfg, pol = report["config"], report["policies"]
    lines = [f"# routing ({report['device']['cpu']}, {report['device']['cores']} cores, "
             f"{report['date']})", "",
             f"`{report['command']}`: {cfg['workers']} SmolLM2 workers (KV pool "
             f"{cfg['kv_blocks']} blocks each), {cfg['tenants']} tenants x "
             f"{cfg['system_tokens']}-token system prompts, {cfg['requests']} requests at "
             f"{cfg['rate']} req/s (Poisson), {cfg['max_tokens']} output tokens each.", "",
             "| policy | hit rate | TTFT p50 / p99 ms | e2e p50 / p99 ms | req/s | out tok/s | "
             "requests per worker |", "|---|---|---|---|---|---|---|"]
    for name, r in pol.items():
        lines.append(f"| {name} | {r['hit_rate']:.1%} | {r['ttft_ms']['p50']} / "
                     f"{r['ttft_ms']['p99']} | {r['e2e_ms']['p50']} / {r['e2e_ms']['p99']} | "
                     f"{r['requests_per_s']} | {r['output_tok_s']} | {r['requests_per_worker']} |")
    lines += ["", "| ratio (prefix vs baseline) | x |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in report["ratios"].items()]
    idx = report.get("index")
    if idx:
        lines += ["", f"Index: {idx['num_blocks']:,} blocks from {idx['num_workers']} workers "
                  f"({idx['total_entries']:,} entries, Redis {idx['redis_used_memory_mb']} MB): "
                  f"lookup p50 {idx['lookup_ms']['p50']} ms, p99 {idx['lookup_ms']['p99']} ms "
                  f"over {idx['num_lookups']} lookups."]
    lines += ["", f"Targets: {json.dumps(report['targets_met'])}"]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--rate", type=float, default=0.4, help="arrivals per second")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--kv-blocks", type=int, default=320)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--index-blocks", type=int, default=1_000_000)
    parser.add_argument("--lookups", type=int, default=2000)
    parser.add_argument("--out", default=os.path.join(REPO, "bench", "results", "routing.json"))
    args = parser.parse_args()

    from mxserve.worker.model.loader import open_checkpoint

    tokenizer = open_checkpoint(None).tokenizer
    requests = workload(args, tokenizer)
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    policies = serve_policies(args, requests)
    index = index_lookup_latency(args) if args.index_blocks else None
    ratios = {}
    if "prefix" in policies:
        p = policies["prefix"]
        for base in (b for b in ("round_robin", "power_of_two") if b in policies):
            b = policies[base]
            ratios[f"ttft_p50_speedup_vs_{base}"] = round(b["ttft_ms"]["p50"]
                                                          / p["ttft_ms"]["p50"], 2)
            ratios[f"ttft_p99_speedup_vs_{base}"] = round(b["ttft_ms"]["p99"]
                                                          / p["ttft_ms"]["p99"], 2)
            ratios[f"throughput_ratio_vs_{base}"] = round(p["output_tok_s"]
                                                          / b["output_tok_s"], 2)
    met = {}
    if "prefix" in policies:
        met["hit_rate"] = policies["prefix"]["hit_rate"] >= TARGETS["hit_rate"]
    if "ttft_p50_speedup_vs_round_robin" in ratios:
        met["ttft_p50_2x_vs_round_robin"] = (ratios["ttft_p50_speedup_vs_round_robin"]
                                             >= TARGETS["ttft_p50_speedup_vs_round_robin"])
    if index:
        met["lookup_p99_le_2ms"] = index["lookup_ms"]["p99"] <= TARGETS["lookup_p99_ms"]
    report = {**environment(), "config": {**{k: v for k, v in vars(args).items() if k != "out"},
                                          "load_average_at_start": load_at_start},
              "policies": policies, "ratios": ratios, "index": index, "targets": TARGETS,
              "targets_met": met}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    text = markdown(report)
    with open(args.out.removesuffix(".json") + ".md", "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
