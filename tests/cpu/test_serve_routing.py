"""Routing under bursts, end to end on the session's multi-node cluster (`served`,
tests/cpu/conftest.py: real Ray, a real redis-server, gRPC on loopback): a burst of concurrent
requests splits evenly over the workers, and a burst sharing a 1,024-token cached prefix stays
with its holder while the holder is idle and spreads once the holder is loaded.

Every request of a burst is sent at once (a barrier), so all of them are routed before any
worker's load report can count them: only the router's own count of what it dispatched keeps
the choices apart. (Before it, 8 such requests on 2 workers all went to one.)"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from mxserve.cluster.config import Resources


def _burst(served, prompts: list[list[int]], app: str | None = None, max_tokens: int = 200,
           wait: bool = True) -> dict[str, int] | list:
    """Send every prompt at once; requests each worker got (wait) or the pending futures. The
    default length keeps every request of a burst running until the last is routed (a request
    that has finished frees its worker, and the next may rightly go there)."""
    before = served.requests_per_worker(app) if wait else None
    barrier = threading.Barrier(len(prompts))

    def one(prompt):
        with served.client(app) as client:
            barrier.wait()
            return client.generate(prompt, max_tokens=max_tokens, ignore_eos=True)

    pool = ThreadPoolExecutor(len(prompts))
    futures = [pool.submit(one, p) for p in prompts]
    pool.shutdown(wait=False)
    if not wait:
        return futures
    assert all(len(f.result(timeout=120).token_ids) == max_tokens for f in futures)
    after = served.requests_per_worker(app)
    return {w: after[w] - before.get(w, 0) for w in after}


def _unrelated(n: int, seed: int, length: int = 24) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(length)] for _ in range(n)]


def _within_one_of_even(got: dict[str, int], n: int, workers: int) -> bool:
    return len(got) == workers and all(abs(c - n / workers) <= 1 for c in got.values())


@pytest.mark.parametrize("n", [8, 16])
def test_a_burst_of_unrelated_prompts_splits_evenly_over_two_workers(served, n):
    got = _burst(served, _unrelated(n, seed=n))
    assert _within_one_of_even(got, n, 2), got


def test_a_burst_splits_evenly_over_four_workers(served):
    from ray import serve

    four = served.deploy(app_name="four", num_workers=4,
                         worker_resources=Resources(num_cpus=0.25, resources={"spare": 1}))
    try:
        for seed in (1, 2):
            got = _burst(served, _unrelated(16, seed=100 + seed), "four")
            assert _within_one_of_even(got, 16, 4), got
    finally:
        serve.delete(four.app_name)


def test_a_burst_sharing_a_cached_prefix_stays_with_its_holder_until_it_is_loaded(
        served, tiny_checkpoint):
    """The holder wins while recomputing the 1,024 tokens elsewhere costs more than the work
    queued on it (routing.request_tokens=100 per request); past that point requests spread.

    1. A burst of 8 on the idle holder stays there (8 x ~108 tokens of work < 1,024).
    2. Sixteen long requests sharing the prefix, sent one at a time (each routed on settled
       load): the holder takes them while 1,024 - 100 x running (less its KV usage and cache
       size terms) stays above the other's score, 10 of them as measured; the other worker
       takes the next, computes the prefix, and then holds it too, so the remaining ones go to
       the less loaded of the two. The holder ends busier (10 vs 6 measured).
    3. Once no prefill is pending anywhere, a burst of 8 sharing the prefix goes mostly to the
       less loaded worker (both hold the prefix, so load decides: 2 of 8 to the busy one
       measured; at 9 vs 7 it would be 3).
    Loading the holder with a barrier burst instead would race the load reports: a report that
    lands mid-burst showing the other worker's prefill done pulls the rest of the burst there,
    and how much the holder gets becomes a matter of timing."""
    from ray import serve

    model = str(tiny_checkpoint("llama", max_position_embeddings=2048))
    app = served.deploy(app_name="long", model=model, num_workers=2,
                        engine={**served.config.engine, "num_kv_blocks": 2048},
                        # lookup_timeout_s: a starved CPU (CI) must not turn this into the
                        # index-down fallback (load only), which other tests cover
                        routing=dict(retry_after_s=0.5, stats_period_s=0.25,
                                     request_tokens=100, lookup_timeout_s=2.0),
                        worker_resources=Resources(num_cpus=0.25, resources={"spare": 1}))
    prefix = [random.Random(7).randrange(3, 256) for _ in range(1024)]

    def settled(client, before: dict[str, int], placed: int):
        """Worker loads once `placed` requests arrived since `before` and no prompt awaits its
        prefill."""
        deadline = time.monotonic() + 30
        while True:
            loads = client.health().workers
            if (sum(w.num_requests_total - before[w.worker_id] for w in loads) >= placed
                    and all(w.num_prefill_tokens_pending == 0 for w in loads)):
                return loads
            assert time.monotonic() < deadline, loads
            time.sleep(0.02)

    try:
        with served.client(app.app_name) as client:
            client.generate(prefix + [3], max_tokens=2, ignore_eos=True)
        held = served.wait_indexed(prefix, app)  # the router sees the holder in the index
        assert [n for n in held.values() if n] == [64], held  # one worker computed it
        with served.client(app.app_name) as client:  # and a load report with the prefill
            settled(client, {w.worker_id: 0 for w in client.health().workers}, 1)  # done:
        time.sleep(4 * 0.25)  # a report of it still pending (polled every 0.25 s) would send
        # the burst's first requests elsewhere
        suffixes = [[5 + i] * 8 for i in range(8)]
        got = _burst(served, [prefix + s for s in suffixes], app.app_name, max_tokens=4)
        holder = max(got, key=got.get)
        assert got[holder] == 8, got  # idle holder: the burst stays

        def load(prompt):
            with served.client(app.app_name) as one:
                return one.generate(prompt, max_tokens=600, ignore_eos=True)

        loaders, pool = [], ThreadPoolExecutor(16)
        with served.client(app.app_name) as client:
            before = {w.worker_id: w.num_requests_total for w in client.health().workers}
            for i in range(16):
                loaders.append(pool.submit(load, prefix + [9, i]))
                loads = settled(client, before, i + 1)
            pool.shutdown(wait=False)
            running = {w.worker_id: w.num_running for w in loads}
            placed = {w.worker_id: w.num_requests_total - before[w.worker_id] for w in loads}
            # stays while it is the cheaper place, then spreads
            assert 9 <= placed[holder] <= 13, (holder, placed)
            busy = max(running, key=running.get)
            other = min(running, key=running.get)
            assert running[busy] >= running[other] + 2, running
            before = {w.worker_id: w.num_requests_total for w in loads}
        second = _burst(served, [prefix + s + [11] for s in suffixes], app.app_name,
                        max_tokens=4, wait=False)
        assert all(len(f.result(timeout=120).token_ids) == 4 for f in second)
        with served.client(app.app_name) as client:
            after = {w.worker_id: w.num_requests_total for w in client.health().workers}
        spread = {w: after[w] - before[w] for w in after}
        # most goes to the less loaded worker, against >= 7 of 8 to the holder when idle
        assert spread[busy] <= 3, (running, spread)
        assert all(len(f.result(timeout=180).token_ids) == 600 for f in loaders)
    finally:
        serve.delete(app.app_name)
