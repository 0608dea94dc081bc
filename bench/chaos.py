"""Worker loss under steady load (the chaos harness, cluster/chaos.py) on a local Ray cluster:
SmolLM2-135M-Instruct (float32, one thread a worker) on `--workers` worker replicas behind the
router, prefix-aware routing on a local redis-server, 8 closed-loop clients sending greedy
requests (KJV passages of 40-160 tokens, 32 output tokens) for `--duration-s`; a random worker
replica's process SIGKILLed every `--kill-every-s` (once Serve has replaced the last one) and,
with --redis-crash, Redis SIGKILLed and restarted empty halfway between two worker kills. No
draft replica: this configuration does not speculate.

Measures: requests completed / failed (by status) / hung; requests in flight on a killed
worker (they migrate); output mismatches against the offline engine's undisturbed greedy
output (must be 0); TTFT p50/p99 of requests in a fault window (first token awaited across a
kill, or sent within `--window-s` after one) vs the rest; KV blocks still held by the workers
once idle (must be 0). The baseline is the same run outside the fault windows.

Run: python bench/chaos.py [--duration-s 300 --kill-every-s 30 --workers 2 --redis-crash]
     (~8 min: the offline reference, start-up, the load, the heal)
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lib.revision import head_commit, write_result  # noqa: E402
from mx_quality import kjv_tokens  # noqa: E402

ENGINE = dict(dtype="float32", num_threads=1, num_kv_blocks=512, max_num_seqs=16)
NUM_PROMPTS, MAX_TOKENS = 24, 32


def prompts_and_reference() -> tuple[list[list[int]], list[list[int]]]:
    """The prompt pool and each prompt's undisturbed greedy output (the offline engine)."""
    from mxserve import LLM, SamplingParams
    from mxserve.worker.model.loader import open_checkpoint

    text = kjv_tokens(open_checkpoint(None).tokenizer, 8000)
    prompts = [text[300 * i: 300 * i + 40 + 5 * i] for i in range(NUM_PROMPTS)]
    llm = LLM(load_progress=False, **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [o.token_ids for o in llm.generate(prompts, params)]
    del llm
    return prompts, want


def run(args) -> dict:
    import ray
    from ray import serve

    from mxserve.cluster.chaos import run_chaos
    from mxserve.cluster.config import Resources, ServeConfig
    from mxserve.cluster.local import SERVE_ENV, deploy, wait_for_grpc
    from mxserve.cluster.redis_server import LocalRedis, free_port

    prompts, want = prompts_and_reference()
    for key, value in SERVE_ENV.items():  # as `mxserve serve` starts its local Ray
        os.environ.setdefault(key, value)
    # address "local": a Ray of its own, even where another runs on this machine
    ray.init(address="local", num_cpus=4, include_dashboard=False, object_store_memory=512 * 2**20,
             log_to_driver=False)
    try:
        with LocalRedis() as redis:
            config = ServeConfig(
                app_name="chaos", num_workers=args.workers, redis_url=redis.url,
                grpc_port=free_port(), http_port=free_port(), proxy_location="HeadOnly",
                ingress="proxy",  # as its committed results ran
                engine=ENGINE, worker_resources=Resources(num_cpus=0.25),
                router_resources=Resources(num_cpus=0.25))
            deploy(config)
            wait_for_grpc(config)
            endpoint = f"localhost:{config.grpc_port}"
            t0 = time.monotonic()
            result = run_chaos(endpoint, config.app_name, args.workers, prompts, want,
                               duration_s=args.duration_s, kill_every_s=args.kill_every_s,
                               num_clients=args.clients, window_s=args.window_s,
                               restart_redis=redis.crash_and_restart if args.redis_crash
                               else None)
            summary = result.summary()
            summary["load_s"] = round(time.monotonic() - t0, 1)
            summary["config"] = dict(health_check_period_s=config.health_check_period_s,
                                     migration_limit=config.migration_limit,
                                     engine=ENGINE, prompts=NUM_PROMPTS, max_tokens=MAX_TOKENS)
            serve.delete(config.app_name)
    finally:
        serve.shutdown()
        ray.shutdown()
    return summary


def markdown(r: dict) -> str:
    s = r["summary"]
    w, rw, o = s["ttft_in_window"], s["ttft_redis_window"], s["ttft_outside"]
    return "\n".join([
        f"# Worker loss under steady load (CPU, {r['date']}, {r['commit']})", "",
        f"SmolLM2-135M-Instruct float32 on {r['workers']} workers ({r['device']}), "
        f"{r['clients']} closed-loop greedy clients for {r['duration_s']} s; a worker "
        f"SIGKILLed every {r['kill_every_s']} s" + (", Redis crashed between" if
                                                   r["redis_crash"] else "") + ".", "",
        "| requests | completed | failed | hung | worker kills | Redis crashes | migrated "
        "| mismatches | KV blocks leaked |", "|---|---|---|---|---|---|---|---|---|",
        f"| {s['requests']} | {s['completed']} | {s['failed']} {s['failed_by_status'] or ''} "
        f"| {s['hung']} | {s['kills']} | {s['redis_kills']} | {s['migrated']} "
        f"| {s['mismatches']} | {s['kv_blocks_leaked']} |", "",
        f"TTFT (s), fault windows (first token awaited across a kill, or sent within "
        f"{r['window_s']} s after one) vs outside:", "",
        "| | n | p50 | p99 | max |", "|---|---|---|---|---|",
        f"| worker kill window | {w['n']} | {w.get('p50_s')} | {w.get('p99_s')} "
        f"| {w.get('max_s')} |",
        f"| Redis crash window | {rw['n']} | {rw.get('p50_s')} | {rw.get('p99_s')} "
        f"| {rw.get('max_s')} |",
        f"| outside | {o['n']} | {o.get('p50_s')} | {o.get('p99_s')} | {o.get('max_s')} |", "",
        f"Targets: {r['targets_met']}", ""])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration-s", type=float, default=300.0)
    p.add_argument("--kill-every-s", type=float, default=30.0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--window-s", type=float, default=10.0)
    p.add_argument("--redis-crash", action="store_true")
    p.add_argument("--out", default="bench/results/chaos.json")
    args = p.parse_args()
    import grpc
    import ray
    import torch

    t0 = time.perf_counter()
    summary = run(args)
    targets_met = {"no_output_mismatch": summary["mismatches"] == 0,
                   "no_kv_block_leaked": summary["kv_blocks_leaked"] == 0,
                   "every_request_completed": summary["failed"] == 0,
                   "none_hung": summary["hung"] == 0}
    result = dict(bench="chaos", device=f"cpu ({platform.processor() or 'x86_64'}, "
                                        f"{os.cpu_count()} cores)",
                  date=datetime.date.today().isoformat(), commit=head_commit(),
                  versions=dict(python=platform.python_version(), torch=torch.__version__,
                                ray=ray.__version__, grpcio=grpc.__version__),
                  command="python bench/chaos.py " + " ".join(sys.argv[1:]),
                  workers=args.workers, clients=args.clients, duration_s=args.duration_s,
                  kill_every_s=args.kill_every_s, window_s=args.window_s,
                  redis_crash=args.redis_crash, summary=summary, targets_met=targets_met,
                  seconds=round(time.perf_counter() - t0))
    write_result(args.out, result, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
