"""Worker loss served: a worker replica's process SIGKILLed mid-stream under load, on the
session's multi-node cluster (tests/cpu/conftest.py `served`) with two more nodes, one worker
replica each. Every stream goes on on the other worker from its prompt plus the tokens already
sent, and ends with the undisturbed run's greedy tokens; new requests go to the live worker at
once; Serve replaces the killed replica and the app heals."""

from __future__ import annotations

import os
import random
import signal
import time

from mxserve import SamplingParams
from mxserve.cluster.config import Resources
from mxserve.cluster.local import worker_pids

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

MB = 2**20


def _wait_workers(served, app: str, ready, timeout_s: float = 90.0) -> list:
    """The workers' loads once ready(loads) holds (or fail)."""
    deadline = time.monotonic() + timeout_s
    with served.client(app) as client:
        while True:
            workers = list(client.health().workers)
            if ready(workers):
                return workers
            assert time.monotonic() < deadline, f"never ready: {workers}"
            time.sleep(0.02)


def _index_workers(config) -> set[str]:
    """The workers the app's Redis prefix index lists."""
    import asyncio

    from mxserve.api.prefix_index import PrefixIndex

    async def listed() -> set[str]:
        index = PrefixIndex.from_url(config.redis_url, config.index_namespace)
        try:
            return await index.workers()
        finally:
            await index.close()
    return asyncio.run(listed())


def test_a_worker_killed_mid_stream_its_streams_end_as_if_undisturbed(served):
    """Eight greedy streams over two workers; the process of the worker running most of them
    is SIGKILLed once each has output: every stream completes with the offline engine's
    tokens (none repeated or missing), the survivor took the victim's streams, a request sent
    right after the kill is answered within 2 s by the live worker, the Redis prefix index
    drops the dead worker within its heartbeat TTL, and Serve's replacement worker joins."""
    from ray import serve

    nodes = served.add_nodes(2, num_cpus=1, resources={"chaos_node": 1},
                             object_store_memory=128 * MB)
    app = served.deploy(app_name="chaos", num_workers=2, engine=dict(served.config.engine),
                        worker_resources=Resources(num_cpus=0.25, resources={"chaos_node": 1}),
                        health_check_period_s=1.0,
                        routing=dict(prefix_weight=0.0, lookup_timeout_s=2.0,
                                     stats_period_s=0.25))
    try:
        rng = random.Random(27)
        prompts = [[rng.randrange(3, 256) for _ in range(20 + 4 * i)] for i in range(8)]
        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        want = [o.token_ids for o in served.llm.generate(prompts, params)]
        probe = [rng.randrange(3, 256) for _ in range(16)]
        probe_want = served.llm.generate([probe], SamplingParams(
            temperature=0, max_tokens=8, ignore_eos=True))[0].token_ids
        pids = worker_pids(app.app_name)
        assert len(pids) == 2, pids

        pending = served.streams(app.app_name, prompts, 400)
        loads = _wait_workers(served, app.app_name, lambda ws: sum(
            w.num_running for w in ws) == 8 and all(w.num_running for w in ws))
        victim = max(loads, key=lambda w: w.num_running)
        (survivor,) = set(pids) - {victim.worker_id}
        before = {w.worker_id: w.num_requests_total for w in loads}
        assert victim.worker_id in _index_workers(app)
        pending.wait_first_output()
        os.kill(pids[victim.worker_id], signal.SIGKILL)
        killed_at = time.monotonic()
        victim, num_on_victim = victim.worker_id, victim.num_running

        start = time.monotonic()
        with served.client(app.app_name) as client:
            got = client.generate(probe, temperature=0, max_tokens=8, ignore_eos=True)
        assert got.token_ids == probe_want
        assert time.monotonic() - start < 2.0, time.monotonic() - start

        results = pending.results()
        assert results == want, [r if isinstance(r, str) else len(r) for r in results]
        loads = {w.worker_id: w for w in served.wait_idle(app.app_name)}
        moved = loads[survivor].num_requests_total - before[survivor] - 1  # (less the probe)
        assert moved >= num_on_victim, (moved, num_on_victim)  # each resumed there

        # live workers purge the dead one from the index once its heartbeat expires
        ttl = app.routing.heartbeat_ttl_s
        while victim in _index_workers(app):
            assert time.monotonic() - killed_at < ttl + 10, "the dead worker stayed indexed"
            time.sleep(0.2)

        # Serve replaces the killed replica; the new one serves
        healed = _wait_workers(served, app.app_name, lambda ws: len(ws) == 2 and victim not in {
            w.worker_id for w in ws}, timeout_s=120)
        (new,) = {w.worker_id for w in healed} - {survivor}
        assert set(worker_pids(app.app_name)) == {survivor, new}
        loads = {w.worker_id: w for w in served.wait_idle(app.app_name)}
        assert loads[survivor].num_kv_blocks_used == 0
    finally:
        serve.delete(app.app_name)
        served.remove_nodes(nodes)


def test_a_worker_that_stops_answering_is_replaced_and_its_streams_go_on(served):
    """The process of the worker running most of eight streams is stopped (SIGSTOP: alive,
    silent). Its health check times out, Serve kills it at once (SERVE_ENV's force stop), its
    streams break and go on on the other worker: every stream ends with the offline engine's
    tokens, within seconds of the health check's timeout rather than Serve's graceful
    shutdown timeout."""
    from ray import serve

    nodes = served.add_nodes(2, num_cpus=1, resources={"chaos_node": 1},
                             object_store_memory=128 * MB)
    app = served.deploy(app_name="silent", num_workers=2, engine=dict(served.config.engine),
                        worker_resources=Resources(num_cpus=0.25, resources={"chaos_node": 1}),
                        health_check_period_s=1.0, health_check_timeout_s=2.0,
                        graceful_shutdown_timeout_s=120.0,
                        routing=dict(prefix_weight=0.0, lookup_timeout_s=2.0,
                                     stats_period_s=0.25))
    pids: dict[str, int] = {}
    try:
        rng = random.Random(28)
        prompts = [[rng.randrange(3, 256) for _ in range(20 + 4 * i)] for i in range(8)]
        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        want = [o.token_ids for o in served.llm.generate(prompts, params)]
        pids = worker_pids(app.app_name)
        pending = served.streams(app.app_name, prompts, 400)
        loads = _wait_workers(served, app.app_name, lambda ws: sum(
            w.num_running for w in ws) == 8 and all(w.num_running for w in ws))
        victim = max(loads, key=lambda w: w.num_running).worker_id
        pending.wait_first_output()
        os.kill(pids[victim], signal.SIGSTOP)
        stopped_at = time.monotonic()
        results = pending.results()
        assert results == want, [r if isinstance(r, str) else len(r) for r in results]
        assert time.monotonic() - stopped_at < 60  # (graceful_shutdown_timeout_s is 120)
        healed = _wait_workers(served, app.app_name, lambda ws: len(ws) == 2 and victim not in {
            w.worker_id for w in ws}, timeout_s=120)
        assert len(healed) == 2
    finally:
        for pid in pids.values():  # (one Serve failed to kill must not stay stopped)
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        serve.delete(app.app_name)
        served.remove_nodes(nodes)
