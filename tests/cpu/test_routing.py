"""The routing policy (router/routing.py) on its own, against a real redis-server: prefix
affinity against load, load-only spreading, and falling back (counted) when Redis is down or
slow, then coming back."""

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
from mxserve.router.routing import PrefixRouter, ReplicaLoad, RoutingConfig

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
        router = PrefixRouter(index, RoutingConfig(load_weight=64, kv_weight=0))
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
        # load counts too: three queued requests (3 x 64) cost more than the fullest cache (128)
        d = await router.route(loads(a=0, b=0, c=3), new, BS)
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


@pytest.mark.parametrize("bad", [dict(load_weight=-1), dict(lookup_timeout_s=0)])
def test_bad_routing_config_is_refused(bad):
    with pytest.raises(ValueError):
        RoutingConfig(**bad)
