"""The routing policy (router/routing.py) on its own, against a real redis-server: prefix
affinity against load, load-only spreading, bursts that see their own dispatches, and falling
back (counted) when Redis is down or slow, then coming back."""

from __future__ import annotations

import asyncio
import random
import socket
import uuid
from collections import Counter

import pytest

from mxserve.api.block_hash import block_hashes
from mxserve.api.prefix_index import PrefixIndex
from mxserve.cluster.redis_server import LocalRedis
from mxserve.router.routing import Dispatched, PrefixRouter, ReplicaLoad, RoutingConfig

BS = 16
PROMPT = list(range(3, 3 + 64 * BS))  # 64 blocks: 1024 tokens
HASHES = block_hashes(PROMPT, BS, "m")


def loads(**ongoing) -> list[ReplicaLoad]:
    return [ReplicaLoad(name, n, 0.0) for name, n in ongoing.items()]


class Observed:
    def __init__(self):
        self.counts = Counter()

    def __call__(self, outcome, latency_s):
        self.counts[outcome] += 1


async def index_with(server: LocalRedis, **held: int) -> PrefixIndex:
    index = PrefixIndex.from_url(server.url, f"r-{uuid.uuid4().hex[:8]}")
    for worker, n in held.items():
        await index.apply(worker, 1, 0, HASHES[:n], [], reset=True)
    return index


def test_the_worker_holding_the_prefix_wins_until_it_is_much_busier(redis_server):
    async def main():
        index = await index_with(redis_server, a=64, b=8)
        router = PrefixRouter(index, RoutingConfig(request_tokens=64, kv_weight=0))
        d = await router.route(loads(a=0, b=0, c=0), HASHES, BS)
        assert (d.order[0], d.source, d.cached_tokens) == ("a", "prefix", 1024)
        assert d.order[1] == "b"  # 128 cached tokens beat none
        # a is 10 requests busier: 1024 - 640 > 128 - 0, still a
        assert (await router.route(loads(a=10, b=0, c=0), HASHES, BS)).order[0] == "a"
        # 20 busier: 1024 - 1280 < 128: traffic shifts despite affinity
        d = await router.route(loads(a=20, b=0, c=0), HASHES, BS)
        assert d.order[0] == "b" and d.order[-1] == "a"
        await index.close()
    asyncio.run(main())


def test_unknown_prompts_go_to_the_least_loaded_and_ties_spread(redis_server):
    async def main():
        index = await index_with(redis_server)
        router = PrefixRouter(index, RoutingConfig(recent_ttl_s=0), rng=random.Random(0))
        other = block_hashes([7] * 64, BS, "m")
        d = await router.route(loads(a=3, b=1, c=2), other, BS)
        assert d.order == ["b", "c", "a"] and d.cached_tokens == 0
        firsts = Counter([(await router.route(loads(a=0, b=0, c=0), other, BS)).order[0]
                          for _ in range(300)])
        assert set(firsts) == {"a", "b", "c"} and min(firsts.values()) > 60
        kv = [ReplicaLoad("a", 0, 0.9), ReplicaLoad("b", 0, 0.1)]
        assert (await router.route(kv, other, BS)).order == ["b", "a"]
        await index.close()
    asyncio.run(main())


def test_new_prefixes_go_to_the_emptiest_cache_among_equally_loaded(redis_server):
    async def main():
        index = await index_with(redis_server, a=64, b=8)
        router = PrefixRouter(index, RoutingConfig(recent_ttl_s=0), rng=random.Random(0))
        new = block_hashes([9] * 64, BS, "m")
        assert (await router.route(loads(a=0, b=0, c=0), new, BS)).order == ["c", "b", "a"]
        # load counts too: one queued request (64 tokens) costs more than the fullest cache (32)
        d = await router.route(loads(a=0, b=0, c=1), new, BS)
        assert d.order == ["b", "a", "c"]
        await index.close()
    asyncio.run(main())


def test_a_burst_sharing_a_new_prefix_follows_the_first_request(redis_server):
    """Nothing in the index yet (the first request is still prefilling): the router's memory of
    where it sent the prefix keeps the burst together, until load outweighs it or it expires."""
    async def main():
        index = await index_with(redis_server)
        router = PrefixRouter(index, RoutingConfig(recent_ttl_s=0.2, kv_weight=0))
        first = (await router.route(loads(a=0, b=0, c=0), HASHES, BS)).order[0]
        busy = dict(a=0, b=0, c=0) | {first: 3}
        d = await router.route(loads(**busy), HASHES[:40] + [1, 2], BS)  # shares 40 blocks
        assert d.order[0] == first and d.cached_tokens == 640
        busy[first] = 17  # 1024 tokens < 17 * 64: the others win now
        assert (await router.route(loads(**busy), HASHES, BS)).order[0] != first
        await asyncio.sleep(0.25)  # expired: the index (still empty) is all there is
        d = await router.route(loads(a=1, b=1, c=1), HASHES, BS)
        assert d.cached_tokens == 0
        await index.close()
    asyncio.run(main())


def test_every_worker_sent_a_prefix_keeps_it_while_it_prefills(redis_server):
    """The holder is loaded, so one request recomputes the prefix elsewhere; once the next goes
    back to the holder, the other worker still counts as holding it (its prefill is queued, the
    index learns of it only when done): the burst alternates instead of piling on the holder."""
    async def main():
        index = await index_with(redis_server, a=64)
        router = PrefixRouter(index, RoutingConfig(request_tokens=64, kv_weight=0,
                                                   cache_weight=0, lookup_timeout_s=1.0),
                              rng=random.Random(0))
        report = [ReplicaLoad("a", 17, 0.0, reported_at=0.0),  # 1088 tokens > the 1024 held
                  ReplicaLoad("b", 0, 0.0, reported_at=0.0)]
        got = []
        for i in range(8):
            d = await router.route(report, HASHES, BS, len(PROMPT) + 8)
            got.append(d.order[0])
            router.dispatched.add(f"r{i}", d.order[0], len(PROMPT) + 8
                                  - d.held_tokens.get(d.order[0], 0), at=1.0)
        assert got[0] == "b" and got.count("b") >= 4, got
        await index.close()
    asyncio.run(main())


def test_redis_down_falls_back_to_two_choices_then_comes_back():
    server = LocalRedis().start()
    observed = Observed()

    async def main():
        index = await index_with(server, a=64)
        router = PrefixRouter(index, RoutingConfig(retry_after_s=0.3), rng=random.Random(1),
                              on_lookup=observed)
        assert (await router.route(loads(a=0, b=0), HASHES, BS)).order[0] == "a"
        server.stop()
        d = await router.route(loads(a=0, b=5), HASHES, BS)
        assert d.source == "fallback" and d.order == ["a", "b"]  # the less loaded of two
        d = await router.route(loads(a=5, b=0), HASHES, BS)  # backing off: Redis not asked
        assert d.source == "fallback" and d.order == ["b", "a"]
        assert observed.counts == {"ok": 1, "error": 1, "skipped": 1}
        server.start()  # back, but empty: workers resync into it (tested in test_prefix_index)
        await index.apply("a", 2, 0, HASHES, [], reset=True)
        await asyncio.sleep(0.35)
        d = await router.route(loads(a=3, b=0), HASHES, BS)
        assert (d.source, d.order[0]) == ("prefix", "a")
        await index.close()

    try:
        asyncio.run(main())
    finally:
        server.stop()


def test_a_slow_redis_times_out_fast():
    """A server that accepts connections and never answers: the lookup gives up at the
    configured timeout and the request is routed anyway."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    observed = Observed()

    async def main():
        index = PrefixIndex.from_url(f"redis://127.0.0.1:{port}/0", "slow")
        router = PrefixRouter(index, RoutingConfig(lookup_timeout_s=0.05), on_lookup=observed)
        loop = asyncio.get_running_loop()
        start = loop.time()
        d = await router.route(loads(a=1, b=0), HASHES, BS)
        assert loop.time() - start < 0.5
        assert d.source == "fallback" and sorted(d.order) == ["a", "b"]

    try:
        asyncio.run(main())
    finally:
        listener.close()
    assert observed.counts["error"] == 1


def test_without_an_index_or_a_prompt_it_routes_by_load():
    async def main():
        router = PrefixRouter(None)
        assert (await router.route(loads(a=2, b=1), HASHES, BS)).order == ["b", "a"]
        assert (await router.route([], HASHES, BS)).order == []
    asyncio.run(main())


async def burst(router, loads_now, prompts, at=None) -> Counter:
    """Route each prompt and record the dispatch as the Serve request router does, before the
    next is routed; no load report arrives in between. Requests per worker."""
    got = Counter()
    for i, prompt in enumerate(prompts):
        d = await router.route(loads_now, block_hashes(prompt, BS, "m"), BS, len(prompt))
        router.dispatched.add(f"r{i}-{id(prompt)}", d.order[0],
                              len(prompt) - d.held_tokens.get(d.order[0], 0), at)
        got[d.order[0]] += 1
    return got


@pytest.mark.parametrize("workers, n", [(2, 8), (2, 16), (4, 16), (3, 9)])
def test_a_burst_of_unrelated_prompts_splits_evenly(redis_server, workers, n):
    """Same report for the whole burst (it is older than the burst): the dispatches counted
    since it spread the burst evenly. Without them every request would go to the same worker
    (b..: their caches are emptier than a's, the tie-break for unrelated prompts)."""
    async def main():
        index = await index_with(redis_server, a=8)
        router = PrefixRouter(index, RoutingConfig(recent_ttl_s=0), rng=random.Random(n))
        names = "abcd"[:workers]
        report = [ReplicaLoad(w, 0, 0.0, 0, reported_at=0.0) for w in names]
        rng = random.Random(workers)
        prompts = [[rng.randrange(3, 250) for _ in range(40)] for _ in range(n)]
        got = await burst(router, report, prompts)
        assert sorted(got) == list(names) and max(got.values()) - min(got.values()) <= 1, got
        await index.close()
    asyncio.run(main())


def test_dispatches_the_report_already_counts_are_not_counted_twice():
    ledger = Dispatched()
    ledger.add("x", "a", 100, at=10.0)
    ledger.add("y", "a", 50, at=12.0)
    ledger.add("z", "b", 7, at=9.0)
    assert ledger.since("a", 11.0) == (1, 50)  # x was in a's report at 11
    assert ledger.since("a", None) == (2, 150)  # no report yet: all of them
    assert ledger.since("b", 11.0) == (0, 0)
    ledger.done("y")
    assert ledger.since("a", 11.0) == (0, 0) and ledger.replica_of("x") == "a"
    ledger.drop_replica("a")
    assert len(ledger) == 1 and ledger.replica_of("x") is None
    ledger = Dispatched(keep_done_s=5.0)
    ledger.add("p", "a", 10, at=1.0)
    ledger.add("q", "a", 10, at=3.0)
    ledger.done("p", at=4.0)  # finished after a's report at 2: the report still counts it
    assert ledger.since("a", 2.0) == (1 - 1, 10 - 10)  # q not in the report, p gone
    assert ledger.since("a", 4.5) == (0, 0)  # a newer report knows both
    ledger.add("r", "a", 10, at=1.5)
    ledger.done("r", at=20.0)  # p's finish is past keep_done_s now: forgotten; r is not
    assert ledger.since("a", 2.0) == (1 - 1, 10 - 10)
    bounded = Dispatched(max_entries=2)
    for i in range(3):
        bounded.add(f"q{i}", "a", 1, at=float(i))
    assert len(bounded) == 2 and bounded.replica_of("q0") is None
    router = PrefixRouter(None, RoutingConfig(request_tokens=64))
    router.dispatched.add("w", "a", 500, at=20.0)
    report = ReplicaLoad("a", 2, 0.0, pending_prefill_tokens=300, reported_at=19.0)
    assert router.work_tokens(report) == 300 + 500 + 64 * 3


def test_a_request_finished_since_the_report_no_longer_counts_as_pending_prefill(redis_server):
    """The holder of a prefix reported while its first request was still waiting to prefill;
    that request has finished since: the next one sharing the prefix goes to the holder (a
    chat's next turn right after its last), not to the idle worker holding nothing."""
    async def main():
        index = await index_with(redis_server, a=64)
        router = PrefixRouter(index, RoutingConfig(request_tokens=64), rng=random.Random(0))
        router.dispatched.add("first", "a", len(PROMPT), at=10.0)
        router.dispatched.done("first", at=12.0)
        stale = ReplicaLoad("a", 1, 0.0, pending_prefill_tokens=len(PROMPT), reported_at=11.0)
        idle = ReplicaLoad("b", 0, 0.0, pending_prefill_tokens=0, reported_at=11.0)
        assert router.work_tokens(stale) == 0
        d = await router.route([stale, idle], HASHES, BS, len(PROMPT))
        assert d.order[0] == "a" and d.cached_tokens == len(HASHES) * BS
        # a report taken after the prefill (none pending) loses nothing more: never below 0
        later = ReplicaLoad("a", 1, 0.0, pending_prefill_tokens=0, reported_at=11.5)
        assert router.work_tokens(later) == 0
        await index.close()
    asyncio.run(main())


def test_work_is_counted_in_tokens_pending_prefill_included():
    """One worker with two long prompts still to prefill is busier than one with three short
    decodes: load is tokens of work, not a request count."""
    async def main():
        router = PrefixRouter(None, RoutingConfig(request_tokens=64), rng=random.Random(0))
        long_prompts = ReplicaLoad("a", 2, 0.0, pending_prefill_tokens=4000, reported_at=0.0)
        decodes = ReplicaLoad("b", 3, 0.0, pending_prefill_tokens=0, reported_at=0.0)
        d = await router.route([long_prompts, decodes], HASHES, BS, len(PROMPT))
        assert d.order == ["b", "a"]
    asyncio.run(main())


def test_a_burst_sharing_a_cached_prefix_stays_with_its_holder_until_it_is_loaded(redis_server):
    """A 1,024-token prefix cached on a: a burst of 8 sharing it all goes to a while a is idle
    (recomputing the prefix costs more than waiting behind 7 short requests), and spreads once
    the work queued on a costs more than the prefix (request_tokens: the configured point)."""
    async def main():
        index = await index_with(redis_server, a=64)
        idle = [ReplicaLoad(w, 0, 0.0, 0, reported_at=0.0) for w in "ab"]
        prompts = [PROMPT + [5 + i] * 8 for i in range(8)]
        assert await burst(PrefixRouter(index, rng=random.Random(0)), idle, prompts) == {"a": 8}
        # a runs 30 requests (30 x 64 tokens of work, past the 1,024 cached): the burst goes
        # to b, which then holds the prefix too (the router remembers where it sent it)
        busy = [ReplicaLoad("a", 30, 0.0, 0, reported_at=0.0), ReplicaLoad("b", 0, 0.0, 0, 0.0)]
        got = await burst(PrefixRouter(index, rng=random.Random(0)), busy, prompts)
        assert got["b"] >= 7, got
        await index.close()
    asyncio.run(main())


@pytest.mark.parametrize("bad", [dict(load_weight=-1), dict(request_tokens=-1),
                                 dict(lookup_timeout_s=0)])
def test_bad_routing_config_is_refused(bad):
    with pytest.raises(ValueError):
        RoutingConfig(**bad)
