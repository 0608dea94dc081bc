"""The draft replica served (speculative_config draft_placement "replica"), on the session's
multi-node cluster (tests/cpu/conftest.py `served`) with one more node for the draft: two worker
replicas on the head node share one Draft replica on that node over worker/draft_channel.py;
greedy answers equal the offline engine's without speculation; the draft replica killed mid-run,
every stream completes unchanged, the workers count the fallback, and once Serve has replaced it
speculation resumes."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

from mxserve import SamplingParams
from mxserve.cluster.config import Resources

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

MB = 2**20


def _replicas(app: str, deployment: str) -> list:
    import ray

    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    return [ray.get_actor(n["name"], namespace="serve")
            for n in ray.util.list_named_actors(all_namespaces=True)
            if n["namespace"] == "serve" and n["name"].startswith(prefix)]


def _draft_stats(app: str, num_workers: int = 2) -> list[dict]:
    """Each worker's draft channel counters (handle calls until every worker has answered: Serve
    routes each to one replica, and under load it may skip a busy one for a while)."""
    from ray import serve

    handle = serve.get_deployment_handle("Worker", app_name=app)
    seen: dict[str, dict] = {}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        stats = handle.draft_stats.remote().result(timeout_s=30)
        seen[stats["worker_id"]] = stats
        if len(seen) == num_workers:
            return sorted(seen.values(), key=lambda s: s["worker_id"])
        time.sleep(0.02)
    raise AssertionError(f"only {sorted(seen)} answered")


def _answers(served, app: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    def one(prompt):
        with served.client(app) as client:
            return client.generate(prompt, temperature=0, max_tokens=max_tokens,
                                   ignore_eos=True).token_ids

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts, timeout=300))


def test_workers_share_a_draft_replica_on_another_node_and_survive_its_death(
        served, random_eagle_head):
    import ray
    from ray import serve

    head = random_eagle_head(served.config.model, seed=5)
    (node,) = served.add_nodes(1, num_cpus=1, resources={"draft_node": 1},
                               object_store_memory=128 * MB)
    spec = {"method": "eagle", "model": head, "num_speculative_tokens": 3,
            "draft_placement": "replica", "draft_timeout_s": 1.0}
    app = served.deploy(app_name="spec", num_workers=2,
                        engine={**served.config.engine, "speculative_config": spec},
                        worker_resources=Resources(num_cpus=0.25, resources={"spare": 1}),
                        drafts=dict(resources=dict(num_cpus=0.5, resources={"draft_node": 1}),
                                    num_kv_blocks=512))
    try:
        prompts = [[(3 * i + j) % 200 + 3 for j in range(10 + 3 * i)] for i in range(8)]
        greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        want = [o.token_ids for o in served.llm.generate(prompts, greedy)]
        assert _answers(served, app.app_name, prompts, 24) == want
        draft = serve.get_deployment_handle("Draft", app_name=app.app_name)
        stats = draft.stats.remote().result(timeout_s=30)
        with served.client(app.app_name) as client:
            worker_nodes = {w.node_id for w in client.health().workers}
        assert stats["node_id"] not in worker_nodes and stats["num_rounds"] > 0
        assert stats["num_targets"] == 2  # both workers drafted through it
        before = _draft_stats(app.app_name)
        assert len(before) == 2 and all(s["num_failures"] == 0 for s in before)

        # Kill the draft replica while long streams run (long enough to outlast the kill,
        # which takes effect a moment after ray.kill returns).
        long_want = [o.token_ids for o in served.llm.generate(
            prompts[:4], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))]
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(_answers, served, app.app_name, prompts[:4], 400)
            deadline = time.monotonic() + 60
            while sum(s["num_rounds"] for s in _draft_stats(app.app_name)) < \
                    sum(s["num_rounds"] for s in before) + 8:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            (victim,) = _replicas(app.app_name, "Draft")
            ray.kill(victim, no_restart=True)
            assert pending.result(timeout=300) == long_want
        after = _draft_stats(app.app_name)
        assert sum(s["num_failures"] for s in after) >= 1
        assert sum(s["num_fallback_steps"] for s in after) >= 1

        # Serve replaces the replica; the workers find the new one and draft again.
        deadline = time.monotonic() + 120
        while True:
            try:
                new = draft.stats.remote().result(timeout_s=10)
                if new["address"] != stats["address"] or new["num_rounds"] == 0:
                    break
            except Exception:
                pass
            assert time.monotonic() < deadline, "the draft replica was not replaced"
            time.sleep(0.5)
        rounds = sum(s["num_rounds"] for s in _draft_stats(app.app_name))
        deadline = time.monotonic() + 60  # within a retry and an address refresh
        while sum(s["num_rounds"] for s in _draft_stats(app.app_name)) == rounds:
            assert time.monotonic() < deadline, "speculation did not resume"
            assert _answers(served, app.app_name, prompts, 24) == want
        assert draft.stats.remote().result(timeout_s=30)["num_rounds"] > 0
    finally:
        serve.delete(app.app_name)
        served.remove_nodes([node])


def test_draft_replicas_autoscale_on_their_own_load(served, random_eagle_head):
    """Workers' drafting keeps the Draft replica busy past target_busy: Serve adds one (the
    traffic never passes through a Serve handle, so only the replicas' own report can say so);
    idle again, it goes back to one."""
    from ray import serve

    head = random_eagle_head(served.config.model, seed=6)
    spec = {"method": "eagle", "model": head, "num_speculative_tokens": 3,
            "draft_placement": "replica"}
    app = served.deploy(
        app_name="spec-scale", num_workers=1,
        engine={**served.config.engine, "speculative_config": spec},
        worker_resources=Resources(num_cpus=0.25, resources={"spare": 1}),
        drafts=dict(resources=dict(num_cpus=0.25, resources={"spare": 1}), num_kv_blocks=256,
                    autoscaling=dict(min_replicas=1, max_replicas=2, target_busy=0.02,
                                     upscale_delay_s=0, downscale_delay_s=2,
                                     metrics_interval_s=0.5)))
    try:
        assert len(_replicas(app.app_name, "Draft")) == 1
        prompts = [[(5 * i + j) % 200 + 3 for j in range(12)] for i in range(8)]
        deadline = time.monotonic() + 90
        while len(_replicas(app.app_name, "Draft")) < 2:
            assert time.monotonic() < deadline, "no second draft replica under load"
            _answers(served, app.app_name, prompts, 48)
        deadline = time.monotonic() + 90
        while len(_replicas(app.app_name, "Draft")) > 1:
            assert time.monotonic() < deadline, "the second draft replica stayed while idle"
            time.sleep(0.5)
    finally:
        serve.delete(app.app_name)
