"""Publishing a worker's KV cache changes to the global prefix index (api/prefix_index.py).

The engine's loop thread hands over event batches and snapshots in cache order (AsyncEngine's
KV sink); this publisher, on the worker's event loop, coalesces what has piled up into one
index batch per Redis call, numbered (epoch, seq). Its states:

    unsynced --snapshot arrives--> reset batch (new epoch, seq 0) --ok--> synced
    synced   --events--> batch seq+1 --ok--> synced
             --gap (lost batch, Redis restarted) or Redis error--> unsynced: ask for a snapshot

While unsynced, events are dropped: the snapshot that ends that state supersedes them. A worker
starts unsynced, so joining the index is a resync from a full dump. A heartbeat key marks the
worker alive; every few beats the publisher also purges peers whose heartbeat expired (any live
worker may reap a dead one; the scripts make that safe to race). `close()` removes the worker's
own entries.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass

from mxserve.api.prefix_index import PrefixIndex
from mxserve.worker.async_engine import AsyncEngine, KVSnapshot
from mxserve.worker.kv_cache import BlockStored, KVEvent

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PublisherConfig:
    heartbeat_s: float = 1.0  # how often the heartbeat key is refreshed
    heartbeat_ttl_s: float = 5.0  # a worker silent this long is dead and gets purged
    reap_every: int = 3  # heartbeats between purges of dead peers
    retry_s: float = 0.5  # after a Redis error, wait this long before resyncing
    max_batch: int = 4096  # block hashes per Redis call (a reset is split into batches)

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_s < self.heartbeat_ttl_s:
            raise ValueError("need 0 < heartbeat_s < heartbeat_ttl_s")


class KVEventPublisher:
    """Construct, then `start()` on the worker's event loop; `close()` to leave the index."""

    def __init__(self, index: PrefixIndex, worker_id: str, engine: AsyncEngine,
                 config: PublisherConfig | None = None) -> None:
        self.index, self.worker_id, self.engine = index, worker_id, engine
        self.config = config or PublisherConfig()
        self._queue: asyncio.Queue[list[KVEvent] | KVSnapshot] = asyncio.Queue()
        self._synced = False
        self._epoch, self._seq = 0, 0
        self._tasks: list[asyncio.Task] = []
        self._closing = False
        # Counters for tests and metrics.
        self.num_batches = 0
        self.num_resyncs = 0
        self.num_errors = 0

    @property
    def synced(self) -> bool:
        return self._synced

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.engine.watch_kv_events(
            lambda item: loop.call_soon_threadsafe(self._queue.put_nowait, item))
        self._tasks = [asyncio.create_task(self._publish_loop()),
                       asyncio.create_task(self._heartbeat_loop())]

    async def stop(self) -> None:
        """End the publish and heartbeat loops without leaving the index: to peers this is a
        crash (the heartbeat expires and a live peer reaps our entries)."""
        # redis-py can swallow a cancellation that lands inside its own timeout block (turned
        # into a timeout error, which the loops outlive by design; redis-py issues 2028, 2551):
        # the flag ends the loops at their next turn, and the cancel is repeated until they do.
        # Seen in CI as a close() that never returned, and as a "crashed" publisher whose
        # heartbeat went on.
        self._closing = True
        pending = [task for task in self._tasks if not task.done()]
        while pending:
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=0.1)

    async def close(self, timeout_s: float = 2.0) -> None:
        await self.stop()
        try:
            await asyncio.wait_for(self.index.purge(self.worker_id), timeout_s)
        except Exception as e:  # Redis gone: the heartbeat expires and peers purge us
            logger.warning("worker %s: could not leave the prefix index: %r", self.worker_id, e)
        await self.index.close()

    # ---- publishing ------------------------------------------------------------------------
    async def _publish_loop(self) -> None:
        self.engine.request_kv_snapshot()
        while not self._closing:
            items = [await self._queue.get()]
            while not self._queue.empty():
                items.append(self._queue.get_nowait())
            try:
                await self._publish(items)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.num_errors += 1
                if self._synced:
                    logger.warning("worker %s: prefix index unreachable (%r); resyncing when it "
                                   "is back", self.worker_id, e)
                self._synced = False
                await asyncio.sleep(self.config.retry_s)
                self.engine.request_kv_snapshot()

    async def _publish(self, items: list[list[KVEvent] | KVSnapshot]) -> None:
        # Only what follows the last snapshot matters; without one, only a synced index can
        # take changes.
        last = max((i for i, item in enumerate(items) if isinstance(item, KVSnapshot)),
                   default=None)
        if last is not None:
            await self._reset(items[last].block_hashes)
            items = items[last + 1:]
        elif not self._synced:
            return
        changes: dict[int, bool] = {}  # hash -> stored (True) or removed; the last event wins
        for events in items:
            for event in events:
                changes[event.block_hash] = isinstance(event, BlockStored)
        stored = [h for h, is_stored in changes.items() if is_stored]
        removed = [h for h, is_stored in changes.items() if not is_stored]
        if not await self._send_all(stored, removed):
            logger.info("worker %s: prefix index gap; resyncing", self.worker_id)
            self._synced = False
            self.engine.request_kv_snapshot()

    async def _reset(self, block_hashes: list[int]) -> None:
        self._epoch, self._seq = random.getrandbits(62), 0
        self._synced = False
        # Beat first: a peer reaping between the reset and our first beat would purge us.
        await self.index.heartbeat(self.worker_id, self.config.heartbeat_ttl_s)
        step = self.config.max_batch
        await self.index.apply(self.worker_id, self._epoch, 0, block_hashes[:step], [],
                               reset=True)
        self._synced = True
        self.num_resyncs += 1
        if not await self._send_all(block_hashes[step:], []):
            raise RuntimeError("the prefix index lost part of a reset")

    async def _send_all(self, stored: list[int], removed: list[int]) -> bool:
        """Send in batches of at most max_batch hashes; False on a gap. `stored` and `removed`
        are disjoint, so their order does not matter."""
        step = self.config.max_batch
        if len(stored) + len(removed) <= step:
            return not (stored or removed) or await self._send(stored, removed)
        batches = [(stored[i:i + step], []) for i in range(0, len(stored), step)]
        batches += [([], removed[i:i + step]) for i in range(0, len(removed), step)]
        for batch_stored, batch_removed in batches:
            if not await self._send(batch_stored, batch_removed):
                return False
        return True

    async def _send(self, stored: list[int], removed: list[int]) -> bool:
        self._seq += 1
        self.num_batches += 1
        return await self.index.apply(self.worker_id, self._epoch, self._seq, stored, removed)

    # ---- liveness --------------------------------------------------------------------------
    async def _heartbeat_loop(self) -> None:
        beats = 0
        while not self._closing:
            try:
                await self.index.heartbeat(self.worker_id, self.config.heartbeat_ttl_s)
                beats += 1
                if beats % self.config.reap_every == 0:
                    dead = await self.index.reap()
                    if dead:
                        logger.info("worker %s: purged dead workers %s from the prefix index",
                                    self.worker_id, dead)
            except asyncio.CancelledError:
                raise
            except Exception:
                pass  # the publish loop reports outages; keep beating
            await asyncio.sleep(self.config.heartbeat_s)
