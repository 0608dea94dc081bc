"""KV transfer served (cluster/kv_service.py), on the session's multi-node cluster
(tests/cpu/conftest.py `served`) with two more nodes, one worker replica each: a worker chosen
for load pulls the prompt's cached prefix from the worker on the other node over gRPC, answers
exactly as the offline engine does, counts the pulled tokens as cached, and serves it to later
requests; a corrupted transfer is caught and the answer is unchanged."""

from __future__ import annotations

import os
import random
import time

from mxserve import SamplingParams
from mxserve.cluster.config import Resources
from mxserve.cluster.local import drain_worker

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

MB = 2**20
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _kv_stats(app: str, num_workers: int = 2) -> dict[str, dict]:
    """Each worker's transfer counters, by worker id (handle calls until all answered)."""
    from ray import serve

    handle = serve.get_deployment_handle("Worker", app_name=app)
    seen: dict[str, dict] = {}
    for _ in range(200):
        stats = handle.kv_transfer_stats.remote().result(timeout_s=30)
        seen[stats["worker_id"]] = stats
        if len(seen) == num_workers:
            return seen
    raise AssertionError(f"only {sorted(seen)} answered")


def _set_faults(app: str, worker_id: str, faults: dict) -> None:
    from ray import serve

    handle = serve.get_deployment_handle("Worker", app_name=app)
    for _ in range(200):
        if handle.set_kv_faults.remote(worker_id, faults).result(timeout_s=30):
            return
    raise AssertionError(f"{worker_id} never answered")


def _generate(served, app: str, prompt: list[int]):
    with served.client(app) as client:
        return client.generate(prompt, temperature=0, max_tokens=12, ignore_eos=True)


def test_a_worker_chosen_for_load_pulls_the_prefix_from_the_other_node(served):
    from ray import serve

    nodes = served.add_nodes(2, num_cpus=1, resources={"xfer_node": 1},
                             object_store_memory=128 * MB)
    # prefix_weight 0: routing by load and cache size alone, so the second request goes to
    # the worker that does not hold the prefix (which then pulls it)
    app = served.deploy(app_name="xfer", num_workers=2, engine=dict(served.config.engine),
                        worker_resources=Resources(num_cpus=0.5, resources={"xfer_node": 1}),
                        routing=dict(prefix_weight=0.0, retry_after_s=0.5, lookup_timeout_s=2.0,
                                     stats_period_s=0.25),
                        # a slow prefill assumed: every pull beats computing (the measured
                        # rates of a tiny model decide by noise)
                        kv_transfer=dict(enabled=True, chunk_bytes=16384, num_streams=4,
                                         prefill_tokens_per_s=50.0))
    try:
        rng = random.Random(3)
        prefixes = [[rng.randrange(3, 256) for _ in range(96)] for _ in range(2)]
        prompts = [p + [rng.randrange(3, 256) for _ in range(9)] for p in prefixes
                   for _ in range(3)]
        want = [o.token_ids for o in served.llm.generate(prompts, GREEDY)]
        with served.client(app.app_name) as client:
            workers = client.health().workers
        assert len({w.node_id for w in workers}) == 2  # one worker on each new node

        first = _generate(served, app.app_name, prompts[0])
        assert first.token_ids == want[0] and first.cached_tokens == 0
        held = served.wait_indexed(prefixes[0], app)
        (holder,) = held
        second = _generate(served, app.app_name, prompts[1])
        assert second.token_ids == want[1]
        assert second.cached_tokens == 96  # pulled, not computed
        stats = _kv_stats(app.app_name)
        (receiver,) = set(stats) - {holder}
        assert stats[receiver]["pulls"].get("ok") == 1
        assert stats[receiver]["pulls"]["blocks"] == 6
        assert stats[holder]["served"].get("served") == 3  # 3 chunks of 2 blocks, 3 streams
        # the receiver published the pulled blocks: the index lists both workers as holders
        deadline = time.monotonic() + 20
        while len(served.wait_indexed(prefixes[0], app)) < 2:
            assert time.monotonic() < deadline, "the pulled blocks never reached the index"
            time.sleep(0.1)
        third = _generate(served, app.app_name, prompts[2])
        assert third.token_ids == want[2] and third.cached_tokens == 96

        # A corrupted chunk: caught, counted, the answer unchanged.
        assert _generate(served, app.app_name, prompts[3]).token_ids == want[3]
        (holder2,) = served.wait_indexed(prefixes[1], app)
        _set_faults(app.app_name, holder2, {"corrupt_chunk": 0})
        time.sleep(0.6)  # the choice weighs the workers' cache sizes and KV usage: let their
        # reports (every stats_period_s) take in the last request's blocks first
        fourth = _generate(served, app.app_name, prompts[4])
        assert fourth.token_ids == want[4] and fourth.cached_tokens == 0
        stats = _kv_stats(app.app_name)
        other = next(w for w in stats if w != holder2)
        assert stats[other]["pulls"].get("checksum") == 1, stats
        served.wait_idle(app.app_name)
    finally:
        serve.delete(app.app_name)
        served.remove_nodes(nodes)


def _streams(served, app: str, prompts: list[list[int]], max_tokens: int):
    """Start one streaming client a prompt; a future of each one's token ids."""
    from concurrent.futures import ThreadPoolExecutor

    def one(prompt):
        with served.client(app) as client:
            return client.generate(prompt, temperature=0, max_tokens=max_tokens,
                                   ignore_eos=True).token_ids

    pool = ThreadPoolExecutor(len(prompts))
    futures = [pool.submit(one, p) for p in prompts]
    pool.shutdown(wait=False)
    return futures


def _wait_running(served, app: str, n: int, timeout_s: float = 60.0) -> list:
    deadline = time.monotonic() + timeout_s
    with served.client(app) as client:
        while True:
            workers = client.health().workers
            if sum(w.num_running for w in workers) >= n:
                return workers
            assert time.monotonic() < deadline, f"never {n} running: {workers}"
            time.sleep(0.02)


def test_drain_under_load_moves_eight_running_streams_to_the_other_worker(served):
    """Eight greedy streams share a prefix, so routing (prefix only) puts all on its holder;
    the holder is drained (as `mxserve drain` does): every stream completes on the other
    worker with the undisturbed run's tokens, none repeated or missing, and the drained
    worker holds no block."""
    from ray import serve

    nodes = served.add_nodes(2, num_cpus=1, resources={"xfer_node": 1},
                             object_store_memory=128 * MB)
    options = dict(app_name="drain", num_workers=2, engine=dict(served.config.engine),
                   worker_resources=Resources(num_cpus=0.25, resources={"xfer_node": 1}),
                   routing=dict(load_weight=0.0, kv_weight=0.0, cache_weight=0.0,
                                lookup_timeout_s=2.0, stats_period_s=0.25),
                   kv_transfer=dict(enabled=True, prefill_tokens_per_s=50.0))
    app = served.deploy(**options)
    try:
        rng = random.Random(5)
        prefix = [rng.randrange(3, 256) for _ in range(64)]
        prompts = [prefix + [rng.randrange(3, 256) for _ in range(5 + 3 * i)] for i in range(8)]
        params = SamplingParams(temperature=0, max_tokens=360, ignore_eos=True)
        want = [o.token_ids for o in served.llm.generate(prompts, params)]
        _generate(served, app.app_name, prefix + [7])
        (holder,) = served.wait_indexed(prefix, app)

        pending = _streams(served, app.app_name, prompts, 360)
        workers = {w.worker_id: w for w in _wait_running(served, app.app_name, 8)}
        assert workers[holder].num_running == 8
        assert drain_worker(app.app_name, holder) == 8  # what `mxserve drain` does
        assert [f.result(timeout=300) for f in pending] == want
        stats = _kv_stats(app.app_name)
        other = next(w for w in stats if w != holder)
        assert stats[holder]["migrated_out"] == 8 and stats[other]["resumed"] == 8
        assert stats[other]["pulls"].get("ok", 0) >= 1
        loads = {w.worker_id: w for w in served.wait_idle(app.app_name)}
        assert loads[holder].draining and loads[holder].num_kv_blocks_used == 0

    finally:
        serve.delete(app.app_name)
        served.remove_nodes(nodes)


def _one_at_a_time(served, tiny_checkpoint, seed: int, count: int = 4):
    """(model, engine options, `count` prompts, their offline greedy 1,800 tokens each) for
    workers that run one request at a time (max_num_seqs 1): the streams stay alive across a
    replica being stopped."""
    from mxserve import LLM

    model = str(tiny_checkpoint("llama", max_position_embeddings=2048))
    engine = {**served.config.engine, "max_num_seqs": 1, "num_kv_blocks": 512}
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 256) for _ in range(12 + 5 * i)] for i in range(count)]
    params = SamplingParams(temperature=0, max_tokens=1800, ignore_eos=True)
    llm = LLM(model=model, load_progress=False, **{**engine, "max_num_seqs": count})
    return model, engine, prompts, [o.token_ids for o in llm.generate(prompts, params)]


def test_workers_serve_stops_hand_their_streams_to_the_new_ones(served, tiny_checkpoint):
    """The app deployed again with streams running: Serve starts new workers and stops the
    old ones (the path a scale-down takes); each old one, asked by the router to drain when it
    leaves the routing set, hands its streams on; they complete with the undisturbed run's
    tokens. One request at a time a worker (max_num_seqs 1) keeps the streams alive across
    the redeploy."""
    from ray import serve

    model, engine, prompts, want = _one_at_a_time(served, tiny_checkpoint, seed=9)
    nodes = served.add_nodes(2, num_cpus=1, resources={"xfer_node": 1},
                             object_store_memory=128 * MB)
    options = dict(app_name="rolling", model=model, num_workers=1, engine=engine,
                   worker_resources=Resources(num_cpus=0.25, resources={"xfer_node": 1}),
                   routing=dict(lookup_timeout_s=2.0, stats_period_s=0.25),
                   kv_transfer=dict(enabled=True, prefill_tokens_per_s=50.0))
    app = served.deploy(**options)
    try:
        (old,) = _kv_stats(app.app_name, 1)
        pending = _streams(served, app.app_name, prompts, 1800)
        _wait_running(served, app.app_name, 1)
        served.deploy(**options)  # a new version: new workers, the old one stopped
        assert [f.result(timeout=300) for f in pending] == want
        (new,) = _kv_stats(app.app_name, 1).values()
        assert new["worker_id"] != old and new["resumed"] >= 1, new
    finally:
        serve.delete(app.app_name)
        served.remove_nodes(nodes)


def test_a_scale_down_by_autoscaling_drains_the_worker_it_stops(served, tiny_checkpoint):
    """Two workers under autoscaling (min 1, max 2, 16 ongoing requests wanted a worker) run
    eight streams, one at a time each: the load wants one worker, so Serve stops one of them
    mid-stream; the router asks it to drain as it leaves the routing set, and its streams go
    on on the other worker with the undisturbed run's tokens. Four streams a worker, each
    1,800 tokens long, keep both busy well past the scale-down delay (5 s) on a fast machine."""
    from ray import serve

    from mxserve.cluster.config import Autoscaling

    model, engine, prompts, want = _one_at_a_time(served, tiny_checkpoint, seed=11, count=8)
    nodes = served.add_nodes(2, num_cpus=1, resources={"xfer_node": 1},
                             object_store_memory=128 * MB)
    app = served.deploy(
        app_name="scaledown", model=model, engine=engine,
        worker_resources=Resources(num_cpus=0.25, resources={"xfer_node": 1}),
        autoscaling=Autoscaling(min_workers=1, max_workers=2, initial_workers=2,
                                target_ongoing_requests=8, downscale_delay_s=5,
                                look_back_period_s=1),
        routing=dict(lookup_timeout_s=2.0, stats_period_s=0.25),
        kv_transfer=dict(enabled=True, prefill_tokens_per_s=50.0))
    try:
        pending = _streams(served, app.app_name, prompts, 1800)
        running = _wait_running(served, app.app_name, 2)  # one on each worker
        assert len(running) == 2 and all(w.num_running == 1 for w in running), running
        assert [f.result(timeout=300) for f in pending] == want
        (survivor,) = _kv_stats(app.app_name, 1).values()
        assert survivor["resumed"] >= 1, survivor
        deadline = time.monotonic() + 60
        with served.client(app.app_name) as client:
            while len(client.health().workers) > 1:  # the stopped one lingers for its peers
                assert time.monotonic() < deadline, "still 2 workers"
                time.sleep(0.5)
    finally:
        serve.delete(app.app_name)
        served.remove_nodes(nodes)
