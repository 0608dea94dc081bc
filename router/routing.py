"""Which worker gets a request: the policy behind the worker deployment's Ray Serve request router
(cluster/request_router.py only wires it). No Ray here; tested on its own.

Each candidate worker is scored, in prompt tokens:

    score = prefix_weight * cached_prompt_tokens - load_weight * queued_work_tokens
            - kv_weight * kv_usage - cache_weight * cached_blocks / most_cached_blocks

    queued_work_tokens = pending prefill tokens + request_tokens * requests running or waiting

cached_prompt_tokens comes from the global prefix index (one Redis round trip: the leading prompt
blocks each worker holds). The work is what the worker last reported (its prompt tokens not yet
prefilled, its requests; polled every `stats_period_s`) corrected by what this router knows
since (`Dispatched`): the requests it dispatched after the report, less those the report counts
that have finished since. Consecutive choices within one burst see each other instead of all
reading the same stale report. So a worker that holds a prefix of
N tokens wins until the work queued on it exceeds the others' by N / load_weight tokens: a cached
prefix is weighed against the prefill and decode work it would wait behind, and spreads once
recomputing it elsewhere is cheaper. Prompts that nobody holds go to the least loaded worker
and, among equals, to the one whose cache holds the least (cached_blocks, from the index, over
the largest such count): new prefixes spread over the workers' caches instead of piling onto
one. Ties are broken at random.

Several router replicas each count only their own dispatches between two reports; each keeps
its own share of the traffic balanced, and the next report (which counts everyone's) corrects
the rest.

The index learns of a prefix only once a worker has computed it, so a burst of requests sharing a
new prefix would scatter before the first one lands. The router therefore also remembers where it
sent each prompt's blocks for `recent_ttl_s` and counts them as held there, whichever of the two
says more.

When the index cannot answer within `lookup_timeout_s` (Redis slow or down), the request is
routed by load alone, power-of-two-choices style, and the index is left alone for
`retry_after_s` before it is asked again; both are counted and logged. A stale or missing
index costs cache affinity, never a request.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from mxserve.api.prefix_index import PrefixIndex

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoutingConfig:
    prefix_weight: float = 1.0  # score per prompt token the worker already holds
    load_weight: float = 1.0  # score lost per token of work queued on the worker
    request_tokens: float = 64.0  # work a running or waiting request counts for, in tokens,
    # beyond its pending prefill: the decode steps it shares with a newcomer
    kv_weight: float = 256.0  # score lost at a full KV pool, in proportion to the used fraction
    cache_weight: float = 32.0  # score lost by the worker caching the most blocks (others: less;
    # under one request's work: among equally loaded workers only)
    lookup_timeout_s: float = 0.05  # an index lookup slower than this falls back to load only
    retry_after_s: float = 1.0  # after an index failure, route by load this long
    recent_ttl_s: float = 10.0  # how long a routed prompt's blocks count as held (0: off)
    max_recent_blocks: int = 200_000  # memory bound of that record

    def __post_init__(self) -> None:
        for name in ("prefix_weight", "load_weight", "request_tokens", "kv_weight",
                     "cache_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"routing {name} must be >= 0")
        if self.lookup_timeout_s <= 0 or self.retry_after_s < 0 or self.recent_ttl_s < 0:
            raise ValueError("need lookup_timeout_s > 0, retry_after_s >= 0, recent_ttl_s >= 0")


@dataclass(frozen=True)
class ReplicaLoad:
    """A worker's last load report (Serve polls it every `stats_period_s`)."""

    replica_id: str
    num_ongoing: int  # requests running or waiting there
    kv_usage: float  # fraction of its KV blocks in use, [0, 1]
    pending_prefill_tokens: int = 0  # prompt tokens of its requests not yet prefilled
    reported_at: float | None = None  # the report's wall-clock time (None: nothing reported)


class Dispatched:
    """What this router sent to each worker, as a correction to the worker's last report: the
    requests dispatched after the report was taken (it cannot know them yet), minus those
    dispatched before it that have finished since (it still counts them, and their prompts as
    pending prefill if it was taken before they were prefilled: a request that has finished has
    none, so its prefill tokens come off too, the total never below zero). Entries: request id
    -> (worker, prefill tokens it brings, wall-clock dispatch time); finished ones are kept
    `keep_done_s` with their finish time."""

    def __init__(self, max_entries: int = 100_000, keep_done_s: float = 10.0) -> None:
        # a choice Serve never dispatched (cancelled first) gets no completion: the oldest
        # entries go past max_entries; a report newer than an entry already ignores it
        self.max_entries, self.keep_done_s = max_entries, keep_done_s
        self._entries: dict[str, tuple[str, int, float]] = {}  # in dispatch order
        # (worker, dispatched, finished, prefill tokens)
        self._done: dict[str, tuple[str, float, float, int]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, request_id: str, replica_id: str, prefill_tokens: int,
            at: float | None = None) -> None:
        self._entries.pop(request_id, None)
        self._entries[request_id] = (replica_id, prefill_tokens,
                                     time.time() if at is None else at)
        while len(self._entries) > self.max_entries:
            del self._entries[next(iter(self._entries))]

    def replica_of(self, request_id: str) -> str | None:
        entry = self._entries.get(request_id)
        return entry[0] if entry else None

    def done(self, request_id: str, at: float | None = None) -> None:
        entry = self._entries.pop(request_id, None)
        now = time.time() if at is None else at
        if entry is not None:
            self._done[request_id] = (entry[0], entry[2], now, entry[1])
        while self._done and next(iter(self._done.values()))[2] < now - self.keep_done_s:
            del self._done[next(iter(self._done))]

    def drop_replica(self, replica_id: str) -> None:
        self._entries = {k: v for k, v in self._entries.items() if v[0] != replica_id}
        self._done = {k: v for k, v in self._done.items() if v[0] != replica_id}

    def since(self, replica_id: str, reported_at: float | None) -> tuple[int, int]:
        """(requests, prefill tokens) to add to the worker's report taken at reported_at (None:
        no report yet, so every request in flight); either may be negative."""
        requests = tokens = 0
        for rid, n, at in self._entries.values():
            if rid == replica_id and (reported_at is None or at >= reported_at):
                requests, tokens = requests + 1, tokens + n
        if reported_at is not None:
            for rid, at, finished, n in self._done.values():
                if rid == replica_id and at < reported_at <= finished:
                    requests, tokens = requests - 1, tokens - n
        return requests, tokens


@dataclass(frozen=True)
class Decision:
    order: list[str]  # replica ids, the preferred first; later ones if it refuses
    source: str  # "prefix" (index answered), "load" (nothing to look up), "fallback"
    cached_tokens: int  # prompt tokens the first choice holds (0 unless source == "prefix")
    held_tokens: dict[str, int] = field(default_factory=dict)  # replica -> prompt tokens held


# (outcome, latency_s): outcome "ok", "error" (failed or timed out) or "skipped" (backing off)
LookupObserver = Callable[[str, float | None], None]


class PrefixRouter:
    def __init__(self, index: PrefixIndex | None, config: RoutingConfig | None = None,
                 rng: random.Random | None = None,
                 on_lookup: LookupObserver | None = None) -> None:
        self.index = index
        self.config = config or RoutingConfig()
        self.rng = rng or random.Random()
        self.on_lookup = on_lookup or (lambda outcome, latency_s: None)
        self.dispatched = Dispatched()  # the caller records dispatches and completions here
        self._index_down_until = 0.0
        self._index_down = False
        # block hash -> {replica id: expiry}: where recently routed prompts' blocks went
        self._recent: OrderedDict[int, dict[str, float]] = OrderedDict()

    async def route(self, loads: Sequence[ReplicaLoad], block_hashes: Sequence[int],
                    block_size: int, prompt_len: int = 0) -> Decision:
        """Order the candidates for a prompt of prompt_len tokens with these chained block
        hashes."""
        if not loads:
            return Decision([], "load", 0)
        if self.index is None or not block_hashes:
            return Decision(self._by_score(loads, {}, block_size, prompt_len), "load", 0)
        answer = await self._lookup(list(block_hashes))
        if answer is None:
            return Decision(self._two_choices(loads), "fallback", 0)
        held, sizes = answer
        for replica_id, n in self._recently_sent(block_hashes).items():
            held[replica_id] = max(held.get(replica_id, 0), n)
        order = self._by_score(loads, held, block_size, prompt_len, sizes)
        self._remember(block_hashes, order[0])
        held_tokens = {r: n * block_size for r, n in held.items()}
        return Decision(order, "prefix", held_tokens.get(order[0], 0), held_tokens)

    def work_tokens(self, load: ReplicaLoad) -> float:
        """The work queued on a worker, in tokens: its report plus this router's dispatches
        since."""
        requests, prefill = self.dispatched.since(load.replica_id, load.reported_at)
        return (max(0, load.pending_prefill_tokens + prefill)
                + self.config.request_tokens * max(0, load.num_ongoing + requests))

    def _recently_sent(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Per replica, the leading blocks of the prompt that recent routing sent there (each
        replica sent a prefix keeps it: it holds those blocks once its prefill ends)."""
        now, held = time.monotonic(), {}
        for i, h in enumerate(block_hashes):
            sent_to = [r for r, expiry in self._recent.get(h, {}).items()
                       if expiry >= now and held.get(r, 0) == i]
            if not sent_to:
                break
            for replica_id in sent_to:
                held[replica_id] = i + 1
        return held

    def _remember(self, block_hashes: Sequence[int], replica_id: str) -> None:
        if not self.config.recent_ttl_s:
            return
        expiry = time.monotonic() + self.config.recent_ttl_s
        for h in block_hashes:
            self._recent.setdefault(h, {})[replica_id] = expiry
            self._recent.move_to_end(h)
        while len(self._recent) > self.config.max_recent_blocks:
            self._recent.popitem(last=False)

    def _by_score(self, loads: Sequence[ReplicaLoad], held: dict[str, int], block_size: int,
                  prompt_len: int, sizes: dict[str, int] | None = None) -> list[str]:
        c, sizes = self.config, sizes or {}
        most = max([sizes.get(load.replica_id, 0) for load in loads] + [1])

        def score(load: ReplicaLoad) -> float:
            cached = min(held.get(load.replica_id, 0) * block_size, prompt_len or 1 << 62)
            return (c.prefix_weight * cached - c.load_weight * self.work_tokens(load)
                    - c.kv_weight * load.kv_usage
                    - c.cache_weight * sizes.get(load.replica_id, 0) / most)

        ranked = sorted(loads, key=lambda load: (-score(load), self.rng.random()))
        return [load.replica_id for load in ranked]

    def _two_choices(self, loads: Sequence[ReplicaLoad]) -> list[str]:
        """Two at random, the less loaded first; the rest after them in random order."""
        shuffled = list(loads)
        self.rng.shuffle(shuffled)
        first = sorted(shuffled[:2], key=lambda load: (self.work_tokens(load), load.kv_usage))
        return [load.replica_id for load in first + shuffled[2:]]

    async def _lookup(self, block_hashes: list[int]
                      ) -> tuple[dict[str, int], dict[str, int]] | None:
        """(leading blocks held, blocks cached in all) per worker, or None when the index is
        down, slow or backing off."""
        now = time.monotonic()
        if now < self._index_down_until:
            self.on_lookup("skipped", None)
            return None
        try:
            answer = await asyncio.wait_for(self.index.lookup_with_sizes(block_hashes),
                                            self.config.lookup_timeout_s)
        except Exception as e:  # timeout, connection refused, Redis errors
            self.on_lookup("error", time.monotonic() - now)
            self._index_down_until = time.monotonic() + self.config.retry_after_s
            if not self._index_down:
                logger.warning("prefix index unavailable (%r): routing by load only, retrying "
                               "every %.1f s", e, self.config.retry_after_s)
            self._index_down = True
            return None
        self.on_lookup("ok", time.monotonic() - now)
        if self._index_down:
            logger.warning("prefix index is back: prefix-aware routing resumed")
            self._index_down = False
        return answer
