"""KVCacheManager's invariants: check_integrity catches each kind of corruption, and random
sequences of requests are checked against a model of what the manager must hold
(tests/cpu/test_kv_cache.py has the per-method unit tests)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from mxserve.api.block_hash import block_hashes
from mxserve.worker.kv_cache import BlockRemoved, BlockStored, KVCacheManager

MODEL = "test-model"


def hashes_of(tokens: list[int], block_size: int) -> list[int]:
    return block_hashes(tokens, block_size, MODEL)


def cached_request(mgr: KVCacheManager, request_id: str, tokens: list[int]) -> None:
    """Allocate, 'compute' and cache a request's tokens."""
    assert mgr.allocate(request_id, len(tokens))
    mgr.cache_blocks(request_id, hashes_of(tokens, mgr.block_size), len(tokens))


# ---- check_integrity must catch corruption --------------------------------------------------


def _corrupt_ref(m):
    m._ref_counts[m.get_block_ids("a")[0]] += 1


def _corrupt_free_dup(m):
    m._free.append(m._free[0])


def _corrupt_referenced_in_lru(m):
    m._evictable[m.get_block_ids("a")[0]] = None


def _corrupt_hash_map(m):
    m._hash_to_block[next(iter(m._hash_to_block))] = m._free[0]


def _corrupt_lost_block(m):
    m._free.popleft()


def _corrupt_unhashed_evictable(m):
    m._evictable[m._free.popleft()] = None


@pytest.mark.parametrize(
    "corrupt",
    [
        _corrupt_ref,
        _corrupt_free_dup,
        _corrupt_referenced_in_lru,
        _corrupt_hash_map,
        _corrupt_lost_block,
        _corrupt_unhashed_evictable,
    ],
)
def test_check_integrity_catches_corruption(corrupt):
    mgr = KVCacheManager(record_events=True, num_blocks=6, block_size=4)
    cached_request(mgr, "a", list(range(8)))
    mgr.check_integrity()
    corrupt(mgr)
    with pytest.raises(AssertionError):
        mgr.check_integrity()


# ---- random sequences against a model ---------------------------------------------------------

_UNSET = object()  # parent of a block that no request has written since it was handed out
token_lists = st.lists(st.integers(0, 2), min_size=1, max_size=6)  # tiny vocab: repeated blocks


class KVCacheMachine(RuleBasedStateMachine):
    """Requests arrive (often sharing prefixes), compute, grow, speculate and roll back, finish.

    The model tracks what each block holds: `content[block] = (parent hash, token per slot)`,
    written only through the block tables the manager hands out. Every hash the manager claims to
    cache must name a block that really holds that hash's tokens after that parent.
    """

    @initialize(
        num_blocks=st.integers(3, 24),
        block_size=st.sampled_from([1, 2, 4]),
        caching=st.sampled_from([True, True, True, False]),
    )
    def setup(self, num_blocks, block_size, caching):
        self.mgr = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching,
                                  record_events=True)
        self.bs, self.caching = block_size, caching
        self.tokens: dict[str, list[int]] = {}  # running request -> tokens it holds slots for
        self.num_computed: dict[str, int] = {}
        self.prompts: list[list[int]] = []  # earlier prompts, to share prefixes with
        self.content: dict[int, tuple[object, list[int | None]]] = {}
        self.hash_info: dict[int, tuple[int | None, tuple[int, ...]]] = {}  # hash -> parent, tokens
        self.cached: set[int] = set()  # hashes cached according to the events
        self.num_requests = 0

    # -- helpers --

    def hashes(self, tokens: list[int]) -> list[int]:
        hashes = hashes_of(tokens, self.bs)
        for i, h in enumerate(hashes):
            block = tuple(tokens[i * self.bs : (i + 1) * self.bs])
            self.hash_info[h] = (hashes[i - 1] if i else None, block)
        return hashes

    def held_by_others(self, request_id: str | None = None) -> set[int]:
        held = (self.mgr.get_block_ids(r) for r in self.tokens if r != request_id)
        return {b for table in held for b in table}

    def pick(self, index: int, candidates) -> str:
        candidates = sorted(candidates)
        return candidates[index % len(candidates)]

    def assert_holds(self, block_id: int, block_hash: int) -> None:
        parent, tokens = self.hash_info[block_hash]
        assert self.content.get(block_id) == (parent, list(tokens)), f"block {block_id} is stale"

    def replay_events(self, events: list | None = None) -> None:
        """Follow the events as the prefix index would; they must make sense in order."""
        for event in self.mgr.take_events() if events is None else events:
            if isinstance(event, BlockStored):
                assert event.block_hash not in self.cached, "stored twice"
                assert self.hash_info[event.block_hash][0] == event.parent_hash
                self.cached.add(event.block_hash)
            else:
                assert event.block_hash in self.cached, "removed but never stored"
                self.cached.remove(event.block_hash)

    def allocate(self, request_id: str, num_tokens: int, hits: list[int] = ()) -> bool:
        """allocate, checking success against the model and that failure changes nothing."""
        self.replay_events()
        old_table = self.mgr.get_block_ids(request_id)
        num_new = self.mgr.num_blocks_needed(request_id, num_tokens, len(hits))
        assert num_new == max(0, -(-num_tokens // self.bs) - len(old_table) - len(hits))
        held = self.held_by_others()
        num_idle_hits = len(set(hits) - held)  # a hit takes these off the LRU
        num_evictable = len({self.mgr.lookup_prefix([h])[0] for h in self.cached} - held)
        before = (self.mgr.num_free_blocks, {r: self.mgr.get_block_ids(r) for r in self.tokens})
        ok = self.mgr.allocate(request_id, num_tokens, hits)
        assert ok == (num_new <= before[0] - num_idle_hits)
        if not ok:
            after = (self.mgr.num_free_blocks, {r: self.mgr.get_block_ids(r) for r in self.tokens})
            assert after == before and self.mgr.take_events() == []
            return False
        # The free pool is used up before any cached block is evicted.
        events = self.mgr.take_events()
        num_free_pool = before[0] - num_evictable
        assert len(events) == max(0, num_new - num_free_pool)
        assert all(isinstance(e, BlockRemoved) for e in events)
        self.replay_events(events)
        table = self.mgr.get_block_ids(request_id)
        assert table[: len(old_table) + len(hits)] == old_table + list(hits)
        for block_id in table[len(old_table) + len(hits) :]:
            self.content[block_id] = (_UNSET, [None] * self.bs)
        return True

    def write(self, request_id: str, tokens: list[int], start: int, end: int) -> None:
        """The model runner writes KV for positions [start, end) through the block table."""
        table, hashes = self.mgr.get_block_ids(request_id), self.hashes(tokens)
        others = self.held_by_others(request_id)
        for pos in range(start, end):
            i = pos // self.bs
            assert table[i] not in others, f"{request_id} writes into shared block {table[i]}"
            parent, slots = self.content[table[i]]
            expected = hashes[i - 1] if i else None
            assert parent in (_UNSET, expected), f"block {table[i]} changed context"
            slots[pos % self.bs] = tokens[pos]
            self.content[table[i]] = (expected, slots)

    # -- rules --

    @rule(src=st.integers(0, 10**6), cut=st.integers(0, 16), tail=token_lists)
    def add_request(self, src, cut, tail):
        base = self.prompts[src % len(self.prompts)] if self.prompts else []
        tokens = base[:cut] + tail
        request_id = f"r{self.num_requests}"
        self.num_requests += 1
        hashes = self.hashes(tokens)
        hits = self.mgr.lookup_prefix(hashes)
        assert len(hits) <= len(hashes) and (self.caching or not hits)
        for block_id, block_hash in zip(hits, hashes, strict=False):
            self.assert_holds(block_id, block_hash)
        if self.allocate(request_id, len(tokens), hits):
            self.tokens[request_id] = tokens
            self.num_computed[request_id] = len(hits) * self.bs
            self.prompts.append(tokens)

    @precondition(lambda self: self.tokens)
    @rule(index=st.integers(0, 10**6), chunk=st.integers(1, 12))
    def compute(self, index, chunk):
        """A prefill chunk (or the decode of appended tokens)."""
        self.run_model(self.pick(index, self.tokens), chunk)

    def run_model(self, request_id: str, max_tokens: int) -> None:
        tokens, start = self.tokens[request_id], self.num_computed[request_id]
        end = min(len(tokens), start + max_tokens)
        self.write(request_id, tokens, start, end)
        self.num_computed[request_id] = end
        self.cache(request_id, tokens, start, end)

    def cache(self, request_id: str, tokens: list[int], start: int, end: int) -> None:
        """cache_blocks after computing [start, end): the blocks filled now become cached."""
        hashes = self.hashes(tokens)
        self.mgr.cache_blocks(request_id, hashes, end)
        for i in range(start // self.bs, end // self.bs):
            # Cached as this request's block, or as a twin someone computed at the same time.
            assert len(self.mgr.lookup_prefix([hashes[i]])) == int(self.caching)

    @precondition(lambda self: self.tokens)
    @rule(index=st.integers(0, 10**6), new_tokens=token_lists)
    def append(self, index, new_tokens):
        request_id = self.pick(index, self.tokens)
        tokens = self.tokens[request_id] + new_tokens
        if self.allocate(request_id, len(tokens)):
            self.tokens[request_id] = tokens

    @precondition(lambda self: self.tokens)
    @rule(
        index=st.integers(0, 10**6),
        draft=token_lists,
        num_accepted=st.integers(0, 6),
        cache_draft=st.booleans(),
    )
    def speculate(self, index, draft, num_accepted, cache_draft):
        request_id = self.pick(index, self.tokens)
        self.run_model(request_id, len(self.tokens[request_id]))  # finish the prefill first
        tokens = self.tokens[request_id]
        if not self.allocate(request_id, len(tokens) + len(draft)):
            return
        self.write(request_id, tokens + draft, len(tokens), len(tokens) + len(draft))
        if cache_draft:  # a scheduler that caches before verifying: trim must unregister
            self.cache(request_id, tokens + draft, len(tokens), len(tokens) + len(draft))
        num_tokens = len(tokens)
        tokens = tokens + draft[: min(num_accepted, len(draft))]
        self.mgr.trim(request_id, len(tokens))
        table = self.mgr.get_block_ids(request_id)
        for pos in range(len(tokens), len(table) * self.bs):  # rejected drafts: garbage now
            self.content[table[-1]][1][pos % self.bs] = None
        self.tokens[request_id], self.num_computed[request_id] = tokens, len(tokens)
        self.cache(request_id, tokens, num_tokens, len(tokens))

    @precondition(lambda self: self.tokens)
    @rule(index=st.integers(0, 10**6))
    def free(self, index):
        request_id = self.pick(index, self.tokens)
        self.mgr.free(request_id)
        del self.tokens[request_id], self.num_computed[request_id]
        assert self.mgr.get_block_ids(request_id) == []

    @rule()
    def reset_prefix_cache(self):
        idle = not self.held_by_others()
        assert self.mgr.reset_prefix_cache() == idle
        if idle:
            assert self.mgr.num_free_blocks == self.mgr.num_blocks

    # -- checks after every step --

    @invariant()
    def integrity_and_model(self):
        self.mgr.check_integrity()
        self.replay_events()
        for request_id, tokens in self.tokens.items():
            assert len(self.mgr.get_block_ids(request_id)) == -(-len(tokens) // self.bs)
        held = self.held_by_others()
        assert self.mgr.num_free_blocks == self.mgr.num_blocks - len(held)
        assert self.mgr.usage == pytest.approx(len(held) / self.mgr.num_blocks)
        for block_hash in self.hash_info:
            hits = self.mgr.lookup_prefix([block_hash])
            assert bool(hits) == (block_hash in self.cached), "events disagree with the cache"
            if hits:
                self.assert_holds(hits[0], block_hash)

    def teardown(self):
        for request_id in list(self.tokens):
            self.mgr.free(request_id)
        self.mgr.check_integrity()
        assert self.mgr.num_free_blocks == self.mgr.num_blocks and self.mgr.usage == 0.0


KVCacheMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_kv_cache_state_machine = KVCacheMachine.TestCase
