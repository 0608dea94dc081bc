"""The global prefix index in Redis: which worker holds which KV block (ARCHITECTURE.md, "The
global prefix index in Redis"). Workers write their own entries; routers only read.

A block hash (api/block_hash.py) names a whole prefix, so the index is a radix tree over
16-token blocks flattened into one Redis hash per node. Keys, all under one namespace `ns`:

    {ns}:b:<hash>      hash: field = worker id, value = when that worker last reported storing
                       the block (unix seconds); <hash> is the block hash in 32 hex digits
    {ns}:w:<worker>    set of the block hashes the worker holds (so it can be purged)
    {ns}:seq:<worker>  hash {epoch, seq}: the worker's last applied event batch
    {ns}:hb:<worker>   the worker's heartbeat; expires unless refreshed
    {ns}:workers       set of the worker ids that have entries

Every write is one Lua script, so a batch is applied whole, in order against other workers'
batches and against lookups. A batch carries (epoch, seq): it applies only if it follows the
last one applied for that worker, else the script reports a gap and the worker resyncs with a
reset batch (a new epoch, seq 0) that replaces all its entries. A Redis restart loses the seq
key, which reads as a gap too. A lookup is one script call: one round trip per request.

Single Redis (or a primary with replicas); scripts build key names, so Redis Cluster is not
supported.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

# ARGV: ns, worker, epoch, seq, now, reset (0/1), num_stored, stored..., removed...
# Returns {1, seq} when applied, {0, last_seq} (last_seq -1: none) on a gap.
_APPLY = """
local ns, worker, epoch, seq, now = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]
local reset, num_stored = ARGV[6] == '1', tonumber(ARGV[7])
local seq_key, set_key = ns .. ':seq:' .. worker, ns .. ':w:' .. worker
if reset then
  for _, h in ipairs(redis.call('SMEMBERS', set_key)) do
    redis.call('HDEL', ns .. ':b:' .. h, worker)
  end
  redis.call('DEL', set_key)
else
  local last = redis.call('HMGET', seq_key, 'epoch', 'seq')
  if last[1] ~= epoch or tonumber(last[2]) ~= seq - 1 then
    if last[1] == epoch then return {0, tonumber(last[2])} end
    return {0, -1}
  end
end
for i = 8, 7 + num_stored do
  redis.call('HSET', ns .. ':b:' .. ARGV[i], worker, now)
  redis.call('SADD', set_key, ARGV[i])
end
for i = 8 + num_stored, #ARGV do
  redis.call('HDEL', ns .. ':b:' .. ARGV[i], worker)
  redis.call('SREM', set_key, ARGV[i])
end
redis.call('HSET', seq_key, 'epoch', epoch, 'seq', seq)
redis.call('SADD', ns .. ':workers', worker)
return {1, seq}
"""

# ARGV: ns, worker, batch. Drops up to `batch` of the worker's entries; returns how many are
# left (0: the worker is gone from the index). Bounded work per call keeps Redis responsive.
_PURGE = """
local ns, worker, batch = ARGV[1], ARGV[2], tonumber(ARGV[3])
local set_key = ns .. ':w:' .. worker
for _, h in ipairs(redis.call('SPOP', set_key, batch)) do
  redis.call('HDEL', ns .. ':b:' .. h, worker)
end
local left = redis.call('SCARD', set_key)
if left == 0 then
  redis.call('DEL', ns .. ':seq:' .. worker)
  redis.call('SREM', ns .. ':workers', worker)
end
return left
"""

# ARGV: ns, hash_0, hash_1, ... (a prompt's chained block hashes, in order).
# Returns {{worker, n, ...}, {worker, size, ...}}: n = how many leading blocks the worker holds
# (the walk starts at the root and stops at the first block no worker still in the run holds);
# size = how many blocks it holds in all, for every worker in the index.
_LOOKUP = """
local ns, counts, alive = ARGV[1], {}, nil
for i = 2, #ARGV do
  local holders = redis.call('HKEYS', ns .. ':b:' .. ARGV[i])
  if alive == nil then
    alive = {}
    for _, w in ipairs(holders) do alive[w] = true end
  else
    local here = {}
    for _, w in ipairs(holders) do here[w] = true end
    for w in pairs(alive) do
      if not here[w] then alive[w] = nil end
    end
  end
  if next(alive) == nil then break end
  for w in pairs(alive) do counts[w] = i - 1 end
end
local out = {}
for w, n in pairs(counts) do
  out[#out + 1] = w
  out[#out + 1] = n
end
local sizes = {}
for _, w in ipairs(redis.call('SMEMBERS', ns .. ':workers')) do
  sizes[#sizes + 1] = w
  sizes[#sizes + 1] = redis.call('SCARD', ns .. ':w:' .. w)
end
return {out, sizes}
"""


def _pairs(flat: list) -> dict[str, int]:
    return {flat[i]: int(flat[i + 1]) for i in range(0, len(flat), 2)}


def block_key_part(block_hash: int) -> str:
    return format(block_hash, "032x")


class PrefixIndex:
    """Async client of the index, for workers (apply, heartbeat, purge, reap) and routers
    (lookup). Every method may raise redis' ConnectionError / TimeoutError: callers decide
    what a Redis outage means for them."""

    def __init__(self, client: aioredis.Redis, namespace: str) -> None:
        self.client = client
        self.ns = namespace
        self._apply = client.register_script(_APPLY)
        self._purge = client.register_script(_PURGE)
        self._lookup = client.register_script(_LOOKUP)

    @classmethod
    def from_url(cls, url: str, namespace: str, timeout_s: float = 1.0) -> PrefixIndex:
        """`url` as redis-py reads it: redis://[:password@]host:port/db, or rediss:// for TLS."""
        # One immediate retry on a broken connection: after a Redis restart the pooled
        # connections are dead, and the first command on each should not count as an outage.
        client = aioredis.from_url(url, socket_timeout=timeout_s,
                                   socket_connect_timeout=timeout_s, decode_responses=True,
                                   retry=Retry(NoBackoff(), 1),
                                   retry_on_error=[RedisConnectionError])
        return cls(client, namespace)

    async def close(self) -> None:
        await self.client.aclose()

    # ---- workers ---------------------------------------------------------------------------
    async def apply(self, worker_id: str, epoch: int, seq: int, stored: Iterable[int],
                    removed: Iterable[int], reset: bool = False) -> bool:
        """Apply one event batch; False (nothing changed) if it does not follow the worker's
        last applied batch: resync with `reset=True`, which replaces every entry of the worker
        with `stored` and starts (epoch, seq) over."""
        stored = [block_key_part(h) for h in stored]
        removed = [block_key_part(h) for h in removed]
        applied, _ = await self._apply(args=[self.ns, worker_id, epoch, seq, f"{time.time():.3f}",
                                             int(reset), len(stored), *stored, *removed])
        return bool(applied)

    async def heartbeat(self, worker_id: str, ttl_s: float) -> None:
        await self.client.set(f"{self.ns}:hb:{worker_id}", "1", px=max(1, int(ttl_s * 1000)))

    async def purge(self, worker_id: str, batch: int = 2000) -> None:
        """Drop every entry of the worker (it died or left), `batch` entries per script call."""
        await self.client.delete(f"{self.ns}:hb:{worker_id}")
        while await self._purge(args=[self.ns, worker_id, batch]):
            pass

    async def reap(self) -> list[str]:
        """Purge the workers whose heartbeat expired; returns their ids."""
        workers = sorted(await self.client.smembers(f"{self.ns}:workers"))
        if not workers:
            return []
        async with self.client.pipeline(transaction=False) as pipe:
            for w in workers:
                pipe.exists(f"{self.ns}:hb:{w}")
            alive = await pipe.execute()
        dead = [w for w, is_alive in zip(workers, alive) if not is_alive]
        for w in dead:
            await self.purge(w)
        return dead

    # ---- routers -----------------------------------------------------------------------------
    async def lookup(self, block_hashes: list[int]) -> dict[str, int]:
        """For each worker holding the first block: how many leading blocks it holds."""
        return (await self.lookup_with_sizes(block_hashes))[0]

    async def lookup_with_sizes(self, block_hashes: list[int]
                                ) -> tuple[dict[str, int], dict[str, int]]:
        """`lookup`'s answer, and how many blocks each worker in the index holds in all; one
        round trip."""
        held, sizes = await self._lookup(args=[self.ns, *map(block_key_part, block_hashes)])
        return _pairs(held), _pairs(sizes)

    # ---- inspection (tests, operators) ----------------------------------------------------
    async def workers(self) -> set[str]:
        return set(await self.client.smembers(f"{self.ns}:workers"))

    async def blocks_of(self, worker_id: str) -> set[int]:
        return {int(h, 16) for h in await self.client.smembers(f"{self.ns}:w:{worker_id}")}

    async def holders(self, block_hash: int) -> set[str]:
        return set(await self.client.hkeys(f"{self.ns}:b:{block_key_part(block_hash)}"))
