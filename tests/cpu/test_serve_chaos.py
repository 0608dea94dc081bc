"""The chaos harness (cluster/chaos.py), short: eight closed-loop clients on two workers of the
tiny model for ~30 s, a random worker SIGKILLed every 10 s and, between kills, the app's own
Redis index crashed and restarted (or, with speculation on a draft replica, the draft replica
SIGKILLed), on the session's cluster (tests/cpu/conftest.py `served`) with more nodes. No
request hangs or fails, every output equals the undisturbed run's, the killed workers'
requests moved, and no KV block is left held."""

from __future__ import annotations

import os
import random

from mxserve import SamplingParams
from mxserve.cluster.chaos import run_chaos
from mxserve.cluster.config import Resources
from mxserve.cluster.redis_server import LocalRedis

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

MB = 2**20


def test_steady_load_through_worker_kills_and_a_redis_crash(served):
    from ray import serve

    nodes = served.add_nodes(2, num_cpus=1, resources={"chaos_node": 1},
                             object_store_memory=128 * MB)
    with LocalRedis() as redis:
        app = served.deploy(app_name="chaos-load", num_workers=2, redis_url=redis.url,
                            engine=dict(served.config.engine), health_check_period_s=1.0,
                            worker_resources=Resources(num_cpus=0.25,
                                                       resources={"chaos_node": 1}),
                            routing=dict(lookup_timeout_s=0.5, retry_after_s=0.5,
                                         stats_period_s=0.25))
        try:
            rng = random.Random(11)
            prompts = [[rng.randrange(3, 256) for _ in range(8 + 3 * i)] for i in range(12)]
            want = [o.token_ids for o in served.llm.generate(
                prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))]
            result = run_chaos(served.endpoint, app.app_name, 2, prompts, want,
                               duration_s=32, kill_every_s=10, num_clients=8, window_s=5,
                               request_timeout_s=60, restart_redis=redis.crash_and_restart,
                               min_worker_kills=2)
            s = result.summary()
            assert s["kills"] >= 2 and s["redis_kills"] >= 1, s
            assert s["requests"] >= 40 and s["completed"] == s["requests"], s
            assert s["mismatches"] == 0 and s["hung"] == 0, s
            assert s["migrated"] >= 1, s  # some kill caught requests in flight
            assert s["ttft_in_window"]["n"] >= 1, s
            assert s["kv_blocks_leaked"] == 0, s
        finally:
            serve.delete(app.app_name)
            served.remove_nodes(nodes)


def test_steady_load_through_worker_and_draft_replica_kills(served, random_eagle_head):
    """Speculation on a draft replica (a random EAGLE head: drafts mostly rejected), workers
    and the draft replica killed in turn: the workers fall back to plain decoding while the
    draft is gone, and greedy output stays the offline engine's (without speculation)."""
    from ray import serve

    head = random_eagle_head(served.config.model, seed=5)
    nodes = served.add_nodes(2, num_cpus=1, resources={"chaos_node": 1},
                             object_store_memory=128 * MB)
    nodes += served.add_nodes(1, num_cpus=1, resources={"chaos_draft": 1},
                              object_store_memory=128 * MB)
    spec = {"method": "eagle", "model": head, "num_speculative_tokens": 3,
            "draft_placement": "replica", "draft_timeout_s": 1.0}
    app = served.deploy(app_name="chaos-spec", num_workers=2, health_check_period_s=1.0,
                        engine={**served.config.engine, "speculative_config": spec},
                        worker_resources=Resources(num_cpus=0.25, resources={"chaos_node": 1}),
                        drafts=dict(resources=dict(num_cpus=0.25, resources={"chaos_draft": 1}),
                                    num_kv_blocks=256),
                        routing=dict(lookup_timeout_s=0.5, stats_period_s=0.25))
    try:
        rng = random.Random(12)
        prompts = [[rng.randrange(3, 256) for _ in range(8 + 3 * i)] for i in range(12)]
        want = [o.token_ids for o in served.llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))]
        result = run_chaos(served.endpoint, app.app_name, 2, prompts, want, duration_s=26,
                           kill_every_s=8, num_clients=8, window_s=4, request_timeout_s=60,
                           kill_drafts=True, min_worker_kills=2)
        s = result.summary()
        assert s["kills"] >= 2 and s["draft_kills"] >= 1, s
        assert s["requests"] >= 30 and s["completed"] == s["requests"], s
        assert s["mismatches"] == 0 and s["hung"] == 0, s
        assert s["kv_blocks_leaked"] == 0, s
    finally:
        serve.delete(app.app_name)
        served.remove_nodes(nodes)
