"""KVCacheManager: unit tests per method (the random state machine: test_kv_cache_model.py)."""

from __future__ import annotations

import pytest

from mxserve.api.block_hash import block_hashes
from mxserve.worker.kv_cache import BlockRemoved, BlockStored, KVCacheManager

MODEL = "test-model"
BS = 4


def hashes_of(tokens: list[int], block_size: int = BS) -> list[int]:
    return block_hashes(tokens, block_size, MODEL)


def cached_request(mgr: KVCacheManager, request_id: str, tokens: list[int]) -> list[int]:
    """Allocate, 'compute' and cache a request's tokens; returns its block table."""
    assert mgr.allocate(request_id, len(tokens))
    mgr.cache_blocks(request_id, hashes_of(tokens, mgr.block_size), len(tokens))
    return mgr.get_block_ids(request_id)


# ---- construction and plain allocation ------------------------------------------------------


@pytest.mark.parametrize("num_blocks, block_size", [(0, 4), (4, 0), (-1, 4)])
def test_rejects_bad_sizes(num_blocks, block_size):
    with pytest.raises(ValueError):
        KVCacheManager(num_blocks, block_size)


def test_allocate_rounds_up_and_never_shrinks():
    mgr = KVCacheManager(record_events=True, num_blocks=8, block_size=BS)
    assert mgr.allocate("a", 5)
    assert len(mgr.get_block_ids("a")) == 2
    assert mgr.allocate("a", 3)  # asks for less: keeps what it has
    assert len(mgr.get_block_ids("a")) == 2
    assert mgr.allocate("a", 9)
    table = mgr.get_block_ids("a")
    assert len(table) == 3 and len(set(table)) == 3
    assert mgr.num_free_blocks == 5
    assert mgr.usage == pytest.approx(3 / 8)
    mgr.check_integrity()


def test_allocate_zero_tokens_holds_nothing():
    mgr = KVCacheManager(record_events=True, num_blocks=2, block_size=BS)
    assert mgr.allocate("a", 0)
    assert mgr.get_block_ids("a") == []
    mgr.check_integrity()


def test_unknown_request_is_empty_and_free_is_noop():
    mgr = KVCacheManager(record_events=True, num_blocks=2, block_size=BS)
    assert mgr.get_block_ids("nope") == []
    mgr.free("nope")
    mgr.trim("nope", 0)
    assert mgr.num_free_blocks == 2
    mgr.check_integrity()


def test_get_block_ids_returns_a_copy():
    mgr = KVCacheManager(record_events=True, num_blocks=2, block_size=BS)
    mgr.allocate("a", 4)
    mgr.get_block_ids("a").append(99)
    assert len(mgr.get_block_ids("a")) == 1


def test_num_blocks_needed():
    mgr = KVCacheManager(record_events=True, num_blocks=8, block_size=BS)
    assert mgr.num_blocks_needed("a", 9) == 3
    assert mgr.num_blocks_needed("a", 9, num_prefix_blocks=2) == 1
    assert mgr.num_blocks_needed("a", 9, num_prefix_blocks=3) == 0
    mgr.allocate("a", 5)
    assert mgr.num_blocks_needed("a", 9) == 1
    assert mgr.num_blocks_needed("a", 2) == 0


# ---- prefix cache hits, LRU eviction, atomicity ---------------------------------------------


def test_cache_hit_after_free():
    mgr = KVCacheManager(record_events=True, num_blocks=8, block_size=BS)
    tokens = list(range(10))  # two full blocks and a partial one
    table = cached_request(mgr, "a", tokens)
    mgr.free("a")
    assert mgr.num_free_blocks == 8 and mgr.usage == 0.0
    hits = mgr.lookup_prefix(hashes_of(tokens))
    assert hits == table[:2]
    assert mgr.num_free_blocks == 8  # lookup changes nothing
    assert mgr.allocate("b", 12, prefix_block_ids=hits)
    assert mgr.get_block_ids("b")[:2] == hits
    assert mgr.num_free_blocks == 5
    mgr.check_integrity()


def test_hit_on_a_block_in_use_shares_it():
    mgr = KVCacheManager(record_events=True, num_blocks=4, block_size=BS)
    tokens = list(range(8))
    table = cached_request(mgr, "a", tokens)
    hits = mgr.lookup_prefix(hashes_of(tokens))
    assert mgr.allocate("b", 12, prefix_block_ids=hits)
    assert mgr.get_block_ids("b")[:2] == table
    assert mgr.num_free_blocks == 1
    mgr.free("a")
    assert mgr.num_free_blocks == 1  # b still holds the shared blocks
    mgr.free("b")
    assert mgr.num_free_blocks == 4
    mgr.check_integrity()


def test_lookup_stops_at_first_miss():
    mgr = KVCacheManager(record_events=True, num_blocks=8, block_size=BS)
    tokens = list(range(12))
    table = cached_request(mgr, "a", tokens)
    hashes = hashes_of(tokens)
    assert mgr.lookup_prefix([hashes[0], 12345, hashes[2]]) == table[:1]
    assert mgr.lookup_prefix([12345] + hashes) == []
    assert mgr.lookup_prefix([]) == []


def test_lru_evicts_least_recently_freed_and_sequence_tail_first():
    mgr = KVCacheManager(record_events=True, num_blocks=4, block_size=BS)
    a_tokens, b_tokens = [1] * 8, [2] * 8
    a, b = cached_request(mgr, "a", a_tokens), cached_request(mgr, "b", b_tokens)
    ha, hb = hashes_of(a_tokens), hashes_of(b_tokens)
    mgr.free("a")
    mgr.free("b")
    mgr.take_events()
    popped = []
    for i in range(4):
        assert mgr.allocate(f"c{i}", 1)
        popped += mgr.get_block_ids(f"c{i}")
    assert popped == [a[1], a[0], b[1], b[0]]
    assert mgr.take_events() == [BlockRemoved(h) for h in (ha[1], ha[0], hb[1], hb[0])]
    mgr.check_integrity()


def test_hit_refreshes_lru_position():
    mgr = KVCacheManager(record_events=True, num_blocks=2, block_size=BS)
    a, b = cached_request(mgr, "a", [1] * 4), cached_request(mgr, "b", [2] * 4)
    mgr.free("a")
    mgr.free("b")  # LRU: a, b
    assert mgr.allocate("a2", 4, mgr.lookup_prefix(hashes_of([1] * 4)))
    mgr.free("a2")  # LRU: b, a
    assert mgr.allocate("c", 4)
    assert mgr.get_block_ids("c") == b
    assert mgr.lookup_prefix(hashes_of([1] * 4)) == a


def test_free_pool_is_used_before_evicting():
    mgr = KVCacheManager(record_events=True, num_blocks=4, block_size=BS)
    tokens = list(range(8))
    table = cached_request(mgr, "a", tokens)
    mgr.free("a")
    mgr.take_events()
    assert mgr.allocate("b", 8)
    assert not set(mgr.get_block_ids("b")) & set(table)
    assert mgr.take_events() == []
    assert mgr.lookup_prefix(hashes_of(tokens)) == table


def test_allocate_failure_changes_nothing():
    mgr = KVCacheManager(record_events=True, num_blocks=4, block_size=BS)
    tokens = list(range(8))
    cached_request(mgr, "a", tokens)
    mgr.free("a")  # 2 evictable blocks
    assert mgr.allocate("b", 4)  # 1 block in use, 1 in the free pool
    mgr.take_events()
    hits = mgr.lookup_prefix(hashes_of(tokens))
    # 3 blocks look free, but the 2 hits leave only 1 for the 2 new blocks needed.
    assert mgr.num_free_blocks == 3
    assert not mgr.allocate("c", 16, prefix_block_ids=hits)
    assert mgr.get_block_ids("c") == []
    assert mgr.num_free_blocks == 3
    assert mgr.take_events() == []
    assert mgr.lookup_prefix(hashes_of(tokens)) == hits
    mgr.check_integrity()
    assert mgr.allocate("c", 12, prefix_block_ids=hits)
    assert mgr.num_free_blocks == 0
    mgr.check_integrity()


def test_allocate_failure_on_growth_keeps_table():
    mgr = KVCacheManager(record_events=True, num_blocks=3, block_size=BS)
    assert mgr.allocate("a", 8)
    table = mgr.get_block_ids("a")
    assert not mgr.allocate("a", 16)
    assert mgr.get_block_ids("a") == table and mgr.num_free_blocks == 1


def test_prefix_misuse_raises():
    mgr = KVCacheManager(record_events=True, num_blocks=8, block_size=BS)
    table = cached_request(mgr, "a", list(range(8)))
    with pytest.raises(ValueError, match="first allocate"):
        mgr.allocate("a", 12, prefix_block_ids=table[:1])
    with pytest.raises(ValueError, match="duplicate"):
        mgr.allocate("b", 12, prefix_block_ids=[table[0], table[0]])
    mgr.allocate("c", 4)
    with pytest.raises(ValueError, match="not in the prefix cache"):
        mgr.allocate("b", 12, prefix_block_ids=mgr.get_block_ids("c"))
    mgr.check_integrity()


# ---- cache_blocks and events ----------------------------------------------------------------


def test_cache_blocks_emits_chained_events_once():
    mgr = KVCacheManager(record_events=True, num_blocks=8, block_size=BS)
    tokens = list(range(13))
    h = hashes_of(tokens)
    assert mgr.allocate("a", 13)
    mgr.cache_blocks("a", h, 5)  # only block 0 is full
    assert mgr.take_events() == [BlockStored(h[0], None)]
    mgr.cache_blocks("a", h, 13)
    assert mgr.take_events() == [BlockStored(h[1], h[0]), BlockStored(h[2], h[1])]
    mgr.cache_blocks("a", h, 13)
    assert mgr.take_events() == []
    assert BlockStored(1, None) == BlockStored(1, None)
    with pytest.raises(AttributeError):
        BlockStored(1, None).block_hash = 2  # frozen


def test_cache_blocks_after_hit_skips_shared_blocks():
    mgr = KVCacheManager(record_events=True, num_blocks=8, block_size=BS)
    tokens = list(range(12))
    h = hashes_of(tokens)
    cached_request(mgr, "a", tokens[:8])
    mgr.take_events()
    assert mgr.allocate("b", 12, mgr.lookup_prefix(h))
    mgr.cache_blocks("b", h, 12)
    assert mgr.take_events() == [BlockStored(h[2], h[1])]
    mgr.check_integrity()


def test_cache_blocks_rejects_more_than_held():
    mgr = KVCacheManager(record_events=True, num_blocks=8, block_size=BS)
    mgr.allocate("a", 4)
    with pytest.raises(ValueError):
        mgr.cache_blocks("a", hashes_of(list(range(8))), 8)
    with pytest.raises(ValueError):
        mgr.cache_blocks("a", [], 4)


def test_duplicate_hash_keeps_first_block():
    mgr = KVCacheManager(record_events=True, num_blocks=4, block_size=BS)
    tokens = list(range(8))
    a = cached_request(mgr, "a", tokens)
    b = cached_request(mgr, "b", tokens)  # computed concurrently, no hit
    h = hashes_of(tokens)
    assert mgr.take_events() == [BlockStored(h[0], None), BlockStored(h[1], h[0])]
    assert mgr.lookup_prefix(hashes_of(tokens)) == a
    mgr.free("b")
    mgr.free("a")
    mgr.check_integrity()
    # b's unregistered blocks went to the free pool and are used first, without evictions.
    assert mgr.allocate("c", 8)
    assert sorted(mgr.get_block_ids("c")) == sorted(b)
    assert mgr.take_events() == []


# ---- trim (speculation rollback) ------------------------------------------------------------


def test_trim_releases_tail_blocks():
    mgr = KVCacheManager(record_events=True, num_blocks=8, block_size=BS)
    assert mgr.allocate("a", 6)
    assert mgr.allocate("a", 6 + 5)  # speculate 5 slots: 3 blocks
    table = mgr.get_block_ids("a")
    mgr.trim("a", 7)  # 1 of 5 accepted
    assert mgr.get_block_ids("a") == table[:2]
    assert mgr.num_free_blocks == 6
    mgr.check_integrity()


def test_trim_unregisters_a_partial_cached_block():
    mgr = KVCacheManager(record_events=True, num_blocks=8, block_size=BS)
    draft = list(range(8))
    h = hashes_of(draft)
    table = cached_request(mgr, "a", draft)
    mgr.take_events()
    mgr.trim("a", 6)
    assert mgr.take_events() == [BlockRemoved(h[1])]
    assert mgr.get_block_ids("a") == table
    assert mgr.lookup_prefix(h) == table[:1]
    accepted = draft[:6] + [40, 41]
    h2 = hashes_of(accepted)
    mgr.cache_blocks("a", h2, 8)
    assert mgr.take_events() == [BlockStored(h2[1], h2[0])]
    assert mgr.lookup_prefix(h2) == table
    mgr.check_integrity()


def test_trim_keeps_released_full_blocks_cached():
    mgr = KVCacheManager(record_events=True, num_blocks=8, block_size=BS)
    tokens = list(range(12))
    table = cached_request(mgr, "a", tokens)
    mgr.take_events()
    mgr.trim("a", 8)
    assert mgr.take_events() == []
    assert mgr.get_block_ids("a") == table[:2]
    assert mgr.lookup_prefix(hashes_of(tokens)) == table
    mgr.check_integrity()


def test_trim_of_shared_partial_block_raises_and_changes_nothing():
    mgr = KVCacheManager(record_events=True, num_blocks=8, block_size=BS)
    tokens = list(range(8))
    cached_request(mgr, "a", tokens)
    assert mgr.allocate("b", 8, mgr.lookup_prefix(hashes_of(tokens)))
    mgr.take_events()
    with pytest.raises(ValueError, match="shared"):
        mgr.trim("b", 6)
    assert len(mgr.get_block_ids("b")) == 2
    assert mgr.take_events() == []
    mgr.check_integrity()


def test_trim_beyond_held_raises_and_trim_to_zero_forgets():
    mgr = KVCacheManager(record_events=True, num_blocks=8, block_size=BS)
    table = cached_request(mgr, "a", list(range(8)))
    with pytest.raises(ValueError):
        mgr.trim("a", 9)
    with pytest.raises(ValueError):
        mgr.trim("a", -1)
    mgr.trim("a", 0)
    assert mgr.get_block_ids("a") == []
    assert mgr.num_free_blocks == 8
    assert mgr.allocate("a", 8, prefix_block_ids=table)  # a fresh start may hit again
    mgr.check_integrity()


# ---- prefix caching off, reset --------------------------------------------------------------


def test_prefix_caching_off():
    mgr = KVCacheManager(record_events=True, num_blocks=4, block_size=BS,
                         enable_prefix_caching=False)
    tokens = list(range(8))
    cached_request(mgr, "a", tokens)
    assert mgr.lookup_prefix(hashes_of(tokens)) == []
    assert mgr.take_events() == []
    mgr.free("a")
    assert mgr.num_free_blocks == 4
    mgr.check_integrity()


def test_reset_prefix_cache():
    mgr = KVCacheManager(record_events=True, num_blocks=4, block_size=BS)
    tokens = list(range(8))
    cached_request(mgr, "a", tokens)
    mgr.take_events()
    assert not mgr.reset_prefix_cache()
    assert mgr.lookup_prefix(hashes_of(tokens)) != []
    mgr.free("a")
    assert mgr.reset_prefix_cache()
    assert mgr.lookup_prefix(hashes_of(tokens)) == []
    assert sorted(mgr.take_events(), key=str) == sorted(
        [BlockRemoved(h) for h in hashes_of(tokens)], key=str
    )
    assert mgr.num_free_blocks == 4
    mgr.check_integrity()


def test_table_version_changes_unless_blocks_are_only_added_at_the_end():
    kv = KVCacheManager(16, 4)
    assert kv.table_version("r") == 0  # holds nothing
    assert kv.allocate("r", 5)
    first = kv.table_version("r")
    assert first != 0 and kv.allocate("r", 12) and kv.table_version("r") == first  # grew
    kv.trim("r", 6)
    trimmed = kv.table_version("r")
    assert trimmed not in (0, first)
    kv.free("r")
    assert kv.table_version("r") == 0
    assert kv.allocate("r", 3) and kv.table_version("r") not in (0, first, trimmed)
    assert kv.allocate("s", 3) and kv.table_version("s") != kv.table_version("r")
