"""Prefix-aware routing vs round robin vs power of two choices, served end to end on CPU.

Cluster: a local Ray with 4 SmolLM2-135M-Instruct worker replicas (1 intra-op thread each), one
router, Ray Serve's gRPC proxy, and a local redis-server for the prefix index. Each worker's KV
pool is `--kv-blocks` 16-token blocks (default 320 = 5120 tokens): room for two or three tenants'
system prompts beside the running requests. Memory is what makes routing matter: a worker that
sees every tenant keeps evicting their prompts.

Prompts (bench/lib/routing_load.py): multi-tenant ones are one of `--tenants` (8) system prompts
of exactly `--system-tokens` (1024) tokens (KJV text through the SmolLM2 tokenizer; whole 16-token
blocks) + a short question (one KJV verse, 8-48 tokens); unrelated ones have the same lengths and
share nothing. Each request decodes `--max-tokens` greedy tokens (ignore_eos), sent as token ids.
Workloads (`--workloads`):
- poisson: multi-tenant, Poisson arrivals at `--rate` req/s (far below capacity);
- bursts: multi-tenant, `--bursts` bursts of `--burst-size` requests at once, `--burst-every-s`
  apart;
- closed: multi-tenant, a closed loop of `--clients-per-worker` x workers clients (saturation);
- closed_unrelated: the same closed loop on unrelated prompts (affinity must not cost balance).

Every policy serves each workload's same requests, each on a fresh deployment (cold caches), one
after another in this run:
- prefix: mxserve's router (cached prefix tokens from the Redis index minus the work queued);
- round_robin: each request to the next worker;
- power_of_two: Ray Serve's default (the less loaded of two random workers).
`--rounds N` serves it all N times, the policies' order reversed every other round, and pools
the rounds: the spread between rounds is the run's noise. `--warmup-requests N` first serves N
requests unmeasured (whichever policy went first on a fresh Ray paid for its warm-up).

Reported per workload and policy: prefix-cache hit rate (cached prompt tokens / prompt tokens,
from each response's usage), TTFT p50/p99 (send -> first token), end-to-end latency p50/p99,
throughput (requests and output tokens per second from the first send to the last completion),
and the requests each worker got. Targets: issue 5 (poisson: hit rate >= 85%, TTFT p50 >= 2x
better than round robin) and issue 30 (closed: throughput >= 1.3x round robin, TTFT p50 >= 2x
better; closed_unrelated: throughput >= 0.95x round robin). Then: index lookup latency with
`--index-blocks` (1M) blocks from 16 workers in a fresh redis-server, p99 <= 2 ms.

    python bench/routing.py                       # writes bench/results/routing.{json,md}
    python bench/routing.py --requests 24 --closed-requests 16 --bursts 1 --out /tmp/r.json \
        --index-blocks 20000                      # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import platform
import random
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench", "lib"))
from routing_load import pct, replay, summarize, workloads  # noqa: E402

# prefix_no_index: mxserve's router without the Redis index (its load term alone): what the
# index and its KV-event publishing cost or gain, with the policy's balance unchanged
POLICIES = ("prefix", "round_robin", "power_of_two", "prefix_no_index")
WORKLOADS = ("poisson", "bursts", "closed", "closed_unrelated")
TARGETS = {"hit_rate": 0.85, "ttft_p50_speedup_vs_round_robin": 2.0, "lookup_p99_ms": 2.0,
           "closed_throughput_vs_round_robin": 1.3, "closed_ttft_p50_speedup_vs_round_robin": 2.0,
           "closed_unrelated_throughput_vs_round_robin": 0.95}


# ---- the cluster -----------------------------------------------------------------------------
def base_config(args, redis_url: str):
    from mxserve.cluster.config import Resources, ServeConfig
    from mxserve.cluster.redis_server import free_port

    return ServeConfig(
        num_workers=args.workers, redis_url=redis_url, grpc_port=free_port(),
        http_port=free_port(), proxy_location="HeadOnly", max_queued_requests=256,
        ingress="proxy",  # as its committed results ran
        engine=dict(num_threads=1, num_kv_blocks=args.kv_blocks, max_num_seqs=16),
        worker_resources=Resources(num_cpus=0.25), router_resources=Resources(num_cpus=0.25),
        routing=dict(json.loads(args.routing)))


def per_worker(config) -> tuple[list[int], list[int]]:
    """(requests each worker got, most first; the preemptions each of them made)."""
    from mxserve.cluster.client import Client

    with Client(f"localhost:{config.grpc_port}", config.app_name) as client:
        workers = sorted(client.health().workers, key=lambda w: -w.num_requests_total)
    return [w.num_requests_total for w in workers], [w.num_preemptions for w in workers]


def serve_policies(args, loads) -> dict:
    """{workload: {policy: summary}}, each policy on a fresh deployment per workload."""
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
        if args.warmup_requests:  # a fresh Ray's first app pays for warming up: not measured
            warm = dataclasses.replace(loads[0], prompts=loads[0].prompts[:args.warmup_requests],
                                       arrivals=None if loads[0].arrivals is None else
                                       loads[0].arrivals[:args.warmup_requests])
            config = base.model_copy(update=dict(app_name="bench-warmup",
                                                 route_prefix="/bench-warmup"))
            deploy(config)
            wait_for_grpc(config)
            print(f"warm-up: {len(warm.prompts)} requests ...", flush=True)
            asyncio.run(replay(config.grpc_port, config.app_name, warm, args.max_tokens))
            serve.delete(config.app_name)
        for workload in loads:
            records: dict[str, list[list[dict]]] = {p: [] for p in args.policies}
            counts: dict[str, list[list[int]]] = {p: [] for p in args.policies}
            preempted: dict[str, list[list[int]]] = {p: [] for p in args.policies}
            for r in range(args.rounds):  # odd rounds reversed: neither policy always goes first
                for policy in (args.policies if r % 2 == 0 else args.policies[::-1]):
                    suffix = f"-r{r}" if args.rounds > 1 else ""
                    name = f"bench-{workload.name}-{policy}{suffix}"
                    config = base.model_copy(update=dict(
                        app_name=name, route_prefix=f"/{name}",
                        routing=base.routing.model_copy(update=dict(
                            policy="prefix" if policy == "prefix_no_index" else policy))))
                    if policy == "prefix_no_index":
                        config = config.model_copy(update=dict(redis_url=None))
                    deploy(config)
                    wait_for_grpc(config)
                    print(f"{workload.name} / {policy} (round {r + 1}): "
                          f"{len(workload.prompts)} requests ...", flush=True)
                    records[policy].append(asyncio.run(replay(
                        config.grpc_port, config.app_name, workload, args.max_tokens)))
                    requests, preemptions = per_worker(config)
                    counts[policy].append(requests)
                    preempted[policy].append(preemptions)
                    print(f"  {json.dumps(summarize(records[policy][-1]))}", flush=True)
                    serve.delete(config.app_name)  # the next app indexes in its own namespace
            out[workload.name] = {policy: {**summarize_rounds(records[policy]),
                                           "requests_per_worker": counts[policy] if
                                           args.rounds > 1 else counts[policy][0],
                                           "preemptions_per_worker": preempted[policy] if
                                           args.rounds > 1 else preempted[policy][0]}
                                  for policy in args.policies}
    serve.shutdown()
    ray.shutdown()
    return out


def summarize_rounds(rounds: list[list[dict]]) -> dict:
    """One summary of a policy's rounds: percentiles over every request, throughput as all
    output tokens over the rounds' summed spans; with several rounds each one's own summary
    goes under "rounds"."""
    pooled = summarize([r for records in rounds for r in records])
    if len(rounds) > 1:
        span = sum(max(r["end"] for r in rs) - min(r["sent"] for r in rs) for rs in rounds)
        pooled.update(requests_per_s=round(pooled["num_requests"] / span, 3),
                      output_tok_s=round(sum(r["tokens"] for rs in rounds for r in rs) / span, 1),
                      rounds=[summarize(rs) for rs in rounds])
    return pooled


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
    cfg = report["config"]
    lines = [f"# routing ({report['device']['cpu']}, {report['device']['cores']} cores, "
             f"{report['date']})", "",
             f"`{report['command']}`: {cfg['workers']} SmolLM2 workers (KV pool "
             f"{cfg['kv_blocks']} blocks each), {cfg['tenants']} tenants x "
             f"{cfg['system_tokens']}-token system prompts, {cfg['max_tokens']} output tokens "
             "a request.", ""]
    for name, pol in report["policies"].items():
        lines += [f"## {name}: {report['workloads'][name]}", "",
                  "| policy | hit rate | TTFT p50 / p99 ms | e2e p50 / p99 ms | req/s | out tok/s "
                  "| requests per worker | preemptions per worker |",
                  "|---|---|---|---|---|---|---|---|"]
        for policy, r in pol.items():
            lines.append(f"| {policy} | {r['hit_rate']:.1%} | {r['ttft_ms']['p50']} / "
                         f"{r['ttft_ms']['p99']} | {r['e2e_ms']['p50']} / {r['e2e_ms']['p99']} "
                         f"| {r['requests_per_s']} | {r['output_tok_s']} | "
                         f"{r['requests_per_worker']} | "
                         f"{r.get('preemptions_per_worker', '-')} |")
        if any("rounds" in r for r in pol.values()):
            lines += ["", "Each round's out tok/s (the policies' order reversed every other "
                      "round): " + "; ".join(
                          f"{policy} " + ", ".join(str(x["output_tok_s"]) for x in r["rounds"])
                          for policy, r in pol.items())]
        ratios = report["ratios"].get(name, {})
        if ratios:
            lines += ["", "| prefix vs | TTFT p50 | TTFT p99 | throughput |", "|---|---|---|---|"]
            lines += [f"| {base} | {r['ttft_p50_speedup']}x | {r['ttft_p99_speedup']}x | "
                      f"{r['throughput_ratio']}x |" for base, r in ratios.items()]
        lines.append("")
    idx = report.get("index")
    if idx:
        lines += [f"Index: {idx['num_blocks']:,} blocks from {idx['num_workers']} workers "
                  f"({idx['total_entries']:,} entries, Redis {idx['redis_used_memory_mb']} MB): "
                  f"lookup p50 {idx['lookup_ms']['p50']} ms, p99 {idx['lookup_ms']['p99']} ms "
                  f"over {idx['num_lookups']} lookups.", ""]
    lines += [f"Targets: {json.dumps(report['targets_met'])}"]
    return "\n".join(lines) + "\n"


def ratios_of(policies: dict) -> dict:
    """{workload: {baseline: prefix's TTFT p50/p99 speed-ups and throughput ratio}}."""
    out = {}
    for name, pol in policies.items():
        if "prefix" not in pol:
            continue
        p = pol["prefix"]
        out[name] = {base: dict(
            ttft_p50_speedup=round(pol[base]["ttft_ms"]["p50"] / p["ttft_ms"]["p50"], 2),
            ttft_p99_speedup=round(pol[base]["ttft_ms"]["p99"] / p["ttft_ms"]["p99"], 2),
            throughput_ratio=round(p["output_tok_s"] / pol[base]["output_tok_s"], 2))
            for base in ("round_robin", "power_of_two", "prefix_no_index") if base in pol}
    return out


def targets_met(policies: dict, ratios: dict, index: dict | None) -> dict:
    met = {}
    rr = {name: r.get("round_robin") for name, r in ratios.items()}
    if "prefix" in policies.get("poisson", {}):
        met["poisson_hit_rate"] = policies["poisson"]["prefix"]["hit_rate"] >= TARGETS["hit_rate"]
    if rr.get("poisson"):
        met["poisson_ttft_p50_2x_vs_round_robin"] = (
            rr["poisson"]["ttft_p50_speedup"] >= TARGETS["ttft_p50_speedup_vs_round_robin"])
    if rr.get("closed"):
        met["closed_throughput_1.3x_vs_round_robin"] = (
            rr["closed"]["throughput_ratio"] >= TARGETS["closed_throughput_vs_round_robin"])
        met["closed_ttft_p50_2x_vs_round_robin"] = (
            rr["closed"]["ttft_p50_speedup"] >= TARGETS["closed_ttft_p50_speedup_vs_round_robin"])
    if rr.get("closed_unrelated"):
        met["closed_unrelated_throughput_0.95x_vs_round_robin"] = (
            rr["closed_unrelated"]["throughput_ratio"]
            >= TARGETS["closed_unrelated_throughput_vs_round_robin"])
    if index:
        met["lookup_p99_le_2ms"] = index["lookup_ms"]["p99"] <= TARGETS["lookup_p99_ms"]
    return met


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--requests", type=int, default=120, help="poisson: requests")
    parser.add_argument("--rate", type=float, default=0.4, help="poisson: arrivals per second")
    parser.add_argument("--bursts", type=int, default=4)
    parser.add_argument("--burst-size", type=int, default=16)
    parser.add_argument("--burst-every-s", type=float, default=8.0)
    parser.add_argument("--closed-requests", type=int, default=96, help="closed loops: requests")
    parser.add_argument("--clients-per-worker", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--kv-blocks", type=int, default=320)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-requests", type=int, default=0,
                        help="first serve this many of the first workload's requests, "
                             "unmeasured (a fresh Ray's first app pays for warming up)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="serve each workload this many times per policy, the policies' "
                             "order reversed every other round; pooled results (spread shown)")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--routing", default="{}",
                        help='routing options as JSON, e.g. \'{"request_tokens": 16}\'')
    parser.add_argument("--index-blocks", type=int, default=1_000_000)
    parser.add_argument("--lookups", type=int, default=2000)
    parser.add_argument("--out", default=os.path.join(REPO, "bench", "results", "routing.json"))
    args = parser.parse_args()

    from mxserve.worker.model.loader import open_checkpoint

    loads = workloads(args, open_checkpoint(None).tokenizer)
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    policies = serve_policies(args, loads)
    index = index_lookup_latency(args) if args.index_blocks else None
    ratios = ratios_of(policies)
    report = {**environment(), "config": {**{k: v for k, v in vars(args).items() if k != "out"},
                                          "load_average_at_start": load_at_start},
              "workloads": {w.name: w.about for w in loads}, "policies": policies,
              "ratios": ratios, "index": index, "targets": TARGETS,
              "targets_met": targets_met(policies, ratios, index)}
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
