"""The paged KV cache's block bookkeeping: reference counts, a free pool and a prefix cache.

Pure Python, no torch: this module hands out block ids; the KV tensors live with the model runner
(`[num_blocks, block_size, num_kv_heads, head_dim]` per layer for K and for V).
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BlockStored:
    """A block with this hash is now in the cache (for the global prefix index)."""

    block_hash: int
    parent_hash: int | None  # None for a sequence's first block


@dataclass(frozen=True)
class BlockRemoved:
    """The block with this hash left the cache (evicted, overwritten or reset)."""

    block_hash: int


KVEvent = BlockStored | BlockRemoved


class KVCacheManager:
    """Hands out fixed-size KV blocks to requests, sharing full blocks across requests by hash.

    Each block is in exactly one of three places:

        free pool --allocate--> referenced --free/trim, ref 0, no hash--> free pool
            ^                   (ref >= 1) --free/trim, ref 0, hashed--> evictable LRU
            |                      ^   cache_blocks gives full blocks a hash   |   |
            |                      +------ hit: allocate(prefix_block_ids) ----+   |
            +-------------- evict: allocate pops the LRU head ---------------------+

    A block released to ref 0 goes to the free pool if it has no hash, else to the tail of the
    evictable LRU: it still holds valid KV that a later request with the same prefix can reuse
    (`lookup_prefix` -> `allocate(prefix_block_ids=...)`). `allocate` pops from the free pool first,
    then evicts the least recently released cached block. A request's blocks are released last
    block first, so a sequence's tail is evicted before its head.

    Hashes are the chained block hashes of `mxserve.api.block_hash`; the manager never computes
    them, it only maps hash <-> block id. Every change to that map is recorded as a `KVEvent`.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 record_events: bool = False):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"need num_blocks > 0 and block_size > 0, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: deque[int] = deque(range(num_blocks))  # ref 0, no hash; pop left
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0, hashed; evict first
        self._ref_counts = [0] * num_blocks
        self._hash_to_block: dict[int, int] = {}
        self._block_to_hash: dict[int, int] = {}
        self._tables: dict[str, list[int]] = {}  # request id -> block table (never empty)
        # request id -> its table's version: new when the table is made or trimmed, not when
        # blocks are added at its end (table_version)
        self._versions: dict[str, int] = {}
        self._version_ids = itertools.count(1)
        # request id -> how many leading blocks cache_blocks has already dealt with
        self._num_cached: dict[str, int] = {}
        # requests whose blocks were compacted (KV eviction): their KV no longer matches their
        # tokens' hashes, so cache_blocks registers nothing more of theirs
        self._compacted: set[str] = set()
        self._events: list[KVEvent] = []
        # Only whoever calls take_events (the index publisher) turns this on.
        self.record_events = record_events

    # ---- queries -------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate` can hand out now: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by at least one request, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (a copy); [] for an unknown request."""
        return list(self._tables.get(request_id, ()))

    def table_version(self, request_id: str) -> int:
        """A number that changes whenever the request's block table changes other than by
        blocks added at its end (made anew after a free, trimmed); unique over the manager's
        life, 0 for a request holding no blocks. Lets a copy of the table be updated by its new
        tail alone (cuda_graphs.DecodeGraphs)."""
        return self._versions.get(request_id, 0)

    def cached_block_hashes(self) -> list[int]:
        """Every hash in the prefix cache now (in use or evictable): a full dump for the index."""
        return list(self._hash_to_block)

    def lookup_prefix(self, block_hashes: list[int]) -> list[int]:
        """Block ids of the longest prefix of `block_hashes` in the cache; changes nothing."""
        if not self.enable_prefix_caching:
            return []
        block_ids = []
        for block_hash in block_hashes:
            block_id = self._hash_to_block.get(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def num_blocks_needed(
        self, request_id: str, num_tokens: int, num_prefix_blocks: int = 0
    ) -> int:
        """How many blocks `allocate(request_id, num_tokens, <that many prefix blocks>)` would pop.

        Compare with `num_free_blocks` minus the prefix blocks that are now evictable (a hit takes
        them out of the LRU); `allocate` itself is atomic and returns False when short.
        """
        num_held = len(self._tables.get(request_id, ())) + num_prefix_blocks
        return max(0, self._blocks_for(num_tokens) - num_held)

    # ---- changes -------------------------------------------------------------------------------

    def allocate(
        self, request_id: str, num_tokens: int, prefix_block_ids: Sequence[int] = ()
    ) -> bool:
        """Grow the request's block table to hold `num_tokens` tokens in total; never shrinks.

        `prefix_block_ids` (from `lookup_prefix`, only when the request holds no blocks) become its
        first blocks, shared with whoever else holds them. New blocks come from the free pool, then
        by evicting cached blocks (BlockRemoved). Returns False and changes nothing when there are
        not enough blocks. Raises ValueError on a misused prefix.
        """
        table = self._tables.get(request_id, [])
        if not prefix_block_ids and len(table) * self.block_size >= num_tokens:
            return True  # its blocks hold these tokens already (most decode steps)
        self._check_prefix(table, prefix_block_ids)
        num_new = self._blocks_for(num_tokens) - len(table) - len(prefix_block_ids)
        num_hits_evictable = sum(b in self._evictable for b in prefix_block_ids)
        if num_new > self.num_free_blocks - num_hits_evictable:
            return False
        for block_id in prefix_block_ids:
            self._evictable.pop(block_id, None)
            self._ref_counts[block_id] += 1
        table = table + list(prefix_block_ids)
        table.extend(self._pop_block() for _ in range(num_new))
        if table:
            self._tables[request_id] = table
            self._num_cached.setdefault(request_id, len(prefix_block_ids))
            if request_id not in self._versions:
                self._versions[request_id] = next(self._version_ids)
        return True

    def cache_blocks(
        self, request_id: str, block_hashes: list[int], num_computed_tokens: int
    ) -> None:
        """Register the request's full computed blocks in the prefix cache (BlockStored each).

        Block i (for i < num_computed_tokens // block_size) gets hash block_hashes[i] unless it is
        registered already. If that hash already names another block (computed twice at once), the
        other mapping stays and this block stays unregistered. No-op with prefix caching off.
        """
        if not self.enable_prefix_caching or request_id in self._compacted:
            return
        table = self._tables.get(request_id, [])
        num_full = num_computed_tokens // self.block_size
        if num_full > len(table) or num_full > len(block_hashes):
            raise ValueError(
                f"{request_id}: {num_full} full blocks computed but it holds {len(table)} blocks "
                f"and {len(block_hashes)} hashes were given"
            )
        for i in range(self._num_cached.get(request_id, 0), num_full):
            self._register(table[i], block_hashes[i], block_hashes[i - 1] if i else None)
        if table:
            self._num_cached[request_id] = max(num_full, self._num_cached[request_id])

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Keep only the blocks that hold the first `num_tokens` tokens; release the rest.

        Rolls back speculation: allocate k more slots, verify, trim to the accepted length. A kept
        last block that is now partial will be overwritten, so its hash is unregistered
        (BlockRemoved); raises ValueError (changing nothing) if that block is shared, or if
        `num_tokens` is more than the request holds.
        """
        table = self._tables.get(request_id, [])
        num_keep = self._blocks_for(num_tokens)
        if num_tokens < 0 or num_keep > len(table):
            raise ValueError(
                f"{request_id}: cannot trim {len(table)} blocks to {num_tokens} tokens"
            )
        partial = table[num_keep - 1] if num_tokens % self.block_size else None
        if partial is not None and partial in self._block_to_hash:
            if self._ref_counts[partial] > 1:
                raise ValueError(f"{request_id}: block {partial} is shared, cannot overwrite it")
            self._unregister(partial)
        for block_id in reversed(table[num_keep:]):
            self._release(block_id)
        del table[num_keep:]
        if table:
            num_full = num_tokens // self.block_size
            self._num_cached[request_id] = min(self._num_cached[request_id], num_full)
            self._versions[request_id] = next(self._version_ids)
        else:
            self._forget(request_id)

    def compact(self, request_id: str, keep: Sequence[int] | np.ndarray
                ) -> tuple[np.ndarray, np.ndarray] | None:
        """Keep only the request's tokens at table positions `keep` (ascending), moved to
        positions 0 .. len(keep) - 1 in as few blocks as they need; release the other blocks.

        Returns the (source slots, destination slots) the KV must move by (int64 arrays; gather
        all sources, then write: they may overlap), or None, changing nothing, when there is no
        block to move into. Leading blocks kept whole stay where they are. Shared blocks
        (another request or the prefix cache's LRU holds them) are never written: the survivors
        go to the request's own unhashed blocks first, then to free blocks, then to its own
        cached blocks, which lose their hash (BlockRemoved). Blocks released keep their hash and
        content, so the prefix cache still serves them. The request's KV no longer matches its
        tokens' hashes: none of its blocks is registered again (cache_blocks) until it is freed.
        """
        table = self._tables.get(request_id)
        keep = np.asarray(keep, dtype=np.int64)
        if table is None or not len(keep) or keep[-1] >= len(table) * self.block_size \
                or (np.diff(keep) <= 0).any() or keep[0] < 0:
            raise ValueError(f"{request_id}: cannot keep positions {keep[:4].tolist()}... of "
                             f"{len(table or ())} blocks")
        bs = self.block_size
        # leading blocks whose tokens all stay in place (keep[j] == j up to their end)
        in_place = keep == np.arange(len(keep))
        num_whole = (len(keep) if in_place.all() else int(np.argmin(in_place))) // bs
        num_dst = self._blocks_for(len(keep)) - num_whole
        rest = table[num_whole:]
        own = [b for b in rest if self._ref_counts[b] == 1 and b not in self._block_to_hash]
        own_cached = [b for b in rest if self._ref_counts[b] == 1 and b in self._block_to_hash]
        num_fresh = min(max(0, num_dst - len(own)), len(self._free))
        if len(own) + num_fresh + len(own_cached) < num_dst:
            return None
        dst_blocks = own[:num_dst]
        fresh = [self._free.popleft() for _ in range(num_fresh)]
        for block_id in fresh:
            self._ref_counts[block_id] = 1
        dst_blocks += fresh
        for block_id in own_cached[:num_dst - len(dst_blocks)]:
            self._unregister(block_id)
            dst_blocks.append(block_id)
        new_table = table[:num_whole] + dst_blocks
        moving = keep[num_whole * bs:]
        at = np.arange(num_whole * bs, len(keep))
        src = np.asarray(table, dtype=np.int64)[moving // bs] * bs + moving % bs
        dst = np.asarray(new_table, dtype=np.int64)[at // bs] * bs + at % bs
        differ = src != dst
        src, dst = src[differ], dst[differ]
        kept = set(new_table)
        for block_id in reversed(table):
            if block_id not in kept:
                self._release(block_id)
        self._tables[request_id] = new_table
        self._num_cached[request_id] = min(self._num_cached[request_id], num_whole)
        self._versions[request_id] = next(self._version_ids)
        self._compacted.add(request_id)
        return src, dst

    def free(self, request_id: str) -> None:
        """Release all the request's blocks, last first; a no-op for an unknown request."""
        for block_id in reversed(self._tables.get(request_id, ())):
            self._release(block_id)
        self._forget(request_id)

    def take_events(self) -> list[KVEvent]:
        """The BlockStored / BlockRemoved events since the last call, oldest first. Recorded only
        while `record_events` is set, so nobody's unread events pile up."""
        events, self._events = self._events, []
        return events

    def reset_prefix_cache(self) -> bool:
        """Unregister every cached block; False, changing nothing, if any block is in use."""
        if len(self._free) + len(self._evictable) != self.num_blocks:
            return False
        for block_id in list(self._evictable):
            self._unregister(block_id)
            self._free.append(block_id)
        self._evictable.clear()
        return True

    # ---- internals -----------------------------------------------------------------------------

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _check_prefix(self, table: list[int], prefix_block_ids: Sequence[int]) -> None:
        if not prefix_block_ids:
            return
        if table:
            raise ValueError("prefix_block_ids are only allowed on a request's first allocate")
        if len(set(prefix_block_ids)) != len(prefix_block_ids):
            raise ValueError(f"duplicate prefix block ids: {list(prefix_block_ids)}")
        for block_id in prefix_block_ids:
            if block_id not in self._block_to_hash:
                raise ValueError(f"prefix block {block_id} is not in the prefix cache")

    def _pop_block(self) -> int:
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id, _ = self._evictable.popitem(last=False)
            self._unregister(block_id)
        self._ref_counts[block_id] = 1
        return block_id

    def _release(self, block_id: int) -> None:
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            if block_id in self._block_to_hash:
                self._evictable[block_id] = None
            else:
                self._free.append(block_id)

    def _register(self, block_id: int, block_hash: int, parent_hash: int | None) -> None:
        if block_id in self._block_to_hash:
            if self._block_to_hash[block_id] != block_hash:
                raise ValueError(f"block {block_id} is cached under another hash")
            return
        if block_hash in self._hash_to_block:
            return  # the same content computed twice at once: keep the first copy
        self._hash_to_block[block_hash] = block_id
        self._block_to_hash[block_id] = block_hash
        if self.record_events:
            self._events.append(BlockStored(block_hash, parent_hash))

    def _unregister(self, block_id: int) -> None:
        block_hash = self._block_to_hash.pop(block_id)
        del self._hash_to_block[block_hash]
        if self.record_events:
            self._events.append(BlockRemoved(block_hash))

    def _forget(self, request_id: str) -> None:
        self._tables.pop(request_id, None)
        self._compacted.discard(request_id)
        self._num_cached.pop(request_id, None)
        self._versions.pop(request_id, None)

    # ---- testing -------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError naming the first broken invariant of the bookkeeping."""
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a block is in the free pool twice"
        assert not free & evictable, f"blocks both free and evictable: {free & evictable}"
        table_counts = Counter(b for table in self._tables.values() for b in table)
        for block_id in range(self.num_blocks):
            ref = self._ref_counts[block_id]
            assert ref == table_counts[block_id], (
                f"block {block_id}: ref count {ref} but in {table_counts[block_id]} block tables"
            )
            is_idle = block_id in free or block_id in evictable
            assert is_idle == (ref == 0), f"block {block_id}: ref {ref}, free/evictable={is_idle}"
        odd = (free | evictable | table_counts.keys()) ^ set(range(self.num_blocks))
        assert not odd, f"blocks unknown or in no place: {odd}"
        assert len(free) + len(evictable) + len(table_counts) == self.num_blocks, "counts differ"
        self._check_hash_maps(free, evictable)
        assert self._num_cached.keys() == self._tables.keys(), "cache cursors for unknown requests"
        assert self._compacted <= self._tables.keys(), "compacted requests that hold nothing"
        for request_id, table in self._tables.items():
            assert table, f"{request_id}: empty block table kept"
            assert len(set(table)) == len(table), f"{request_id}: block twice in its table"
            assert self._num_cached[request_id] <= len(table), f"{request_id}: cursor past table"

    def _check_hash_maps(self, free: set[int], evictable: set[int]) -> None:
        assert len(self._hash_to_block) == len(self._block_to_hash), "hash maps differ in size"
        for block_hash, block_id in self._hash_to_block.items():
            assert self._block_to_hash.get(block_id) == block_hash, f"maps disagree on {block_id}"
        assert evictable <= self._block_to_hash.keys(), "an evictable block has no hash"
        assert not free & self._block_to_hash.keys(), "a free-pool block has a hash"
        if not self.enable_prefix_caching:
            assert not self._block_to_hash, "hashes registered with prefix caching off"
