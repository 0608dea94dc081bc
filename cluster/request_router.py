"""The worker deployment's Ray Serve request router: wiring for router/routing.py's policy.

Serve runs it inside each caller of the worker deployment (the router ingress replicas), on its
routing event loop; `choose_replicas` must not block. It reads each replica's load from Serve's
queue-length cache and the worker's routing stats (`record_routing_stats`), the hashing
parameters from the worker's replica metadata (`record_replica_metadata`), and the prompt from
the pending `generate` call's first argument. It records each choice in the policy's
`Dispatched` as it makes it (Serve's hooks then say where the request went and when it ended),
so the next choice counts it.

Serve hands the replica chosen for a request to that same request (the default matching, not
FIFOMixin's oldest-first): the choice was made for its prompt.
"""

from __future__ import annotations

import asyncio
import time

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from mxserve.api.block_hash import block_hashes
from mxserve.api.prefix_index import PrefixIndex
from mxserve.cluster.kv_drain import request_drain
from mxserve.cluster.metrics import RoutingMetrics
from mxserve.router.routing import PrefixRouter, ReplicaLoad, RoutingConfig

# How long a worker a request was lost on stays out of routing when Serve keeps listing it
# (Serve replaces a dead replica within a few health checks; one that answers again returns).
LOST_HOLD_S = 60.0


class PrefixAwareRequestRouter(RequestRouter):
    def initialize_state(self, redis_url: str | None = None, namespace: str = "mxserve",
                         kv_transfer: dict | None = None, **routing) -> None:
        self._redis_url, self._namespace = redis_url, namespace
        # the workers' KV transfer options: a worker Serve stops is asked to drain over its
        # transfer port (None: KV transfer off)
        self._kv_transfer = kv_transfer
        self._config = RoutingConfig(**routing)
        # worker id -> when a request came back from it lost (died, stopped answering): left
        # out of every choice until Serve drops it from the replica set, or for LOST_HOLD_S
        # should it answer again (a network blip)
        self._lost: dict[str, float] = {}
        self._policy: PrefixRouter | None = None  # built on the routing loop, on first use
        # request id -> (prompt tokens, tokens each replica holds), until it is dispatched
        self._prompts: dict[str, tuple[int, dict[str, int]]] = {}
        self._metrics = RoutingMetrics()

    def _get_policy(self) -> PrefixRouter:
        if self._policy is None:
            index = (PrefixIndex.from_url(self._redis_url, self._namespace)
                     if self._redis_url else None)
            self._policy = PrefixRouter(index, self._config, on_lookup=self._metrics.on_lookup)
        return self._policy

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        candidate_replicas = self._serving(candidate_replicas, pending_request)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = [self._load(r) for r in candidate_replicas]
        prompt = self._prompt(pending_request)
        hashes, block_size = self._prompt_hashes(candidate_replicas, prompt)
        prompt_len = len(prompt) if prompt is not None else 0
        policy = self._get_policy()
        decision = await policy.route(loads, hashes, block_size, prompt_len)
        self._metrics.on_routed(decision.cached_tokens)
        if pending_request is not None and decision.order:
            request_id = pending_request.metadata.internal_request_id
            self._prompts[request_id] = (prompt_len, decision.held_tokens)
            while len(self._prompts) > policy.dispatched.max_entries:
                del self._prompts[next(iter(self._prompts))]  # never dispatched
            self._record(request_id, decision.order[0])
            source = self._kv_source(by_id, decision.held_tokens, block_size)
            if source is not None and "kv_source" not in pending_request.kwargs:
                pending_request.kwargs["kv_source"] = source
        return [[by_id[replica_id]] for replica_id in decision.order]

    def _serving(self, replicas: list[RunningReplica], pending: PendingRequest | None
                 ) -> list[RunningReplica]:
        """For a `generate` call, the candidates less those draining, those lost and the one a
        handed-back request left (all of them when that leaves none: a draining worker hands
        the request back at once; a lost one fails fast). A request whose worker was lost
        tells this router so before Serve's controller notices (its next health check): the
        next choices leave that worker out at once. Other calls (stats, drain) may go to
        any."""
        if pending is None or pending.metadata.call_method != "generate":
            return replicas
        resume = pending.kwargs.get("resume")
        left = resume.worker_id if resume is not None else None
        if resume is not None and resume.worker_lost and left:
            self._lost[left] = time.monotonic()
        lost = self._lost_now()
        serving = [r for r in replicas if r.replica_id.unique_id != left
                   and r.replica_id.unique_id not in lost
                   and not (r.routing_stats or {}).get("draining")]
        return serving or replicas

    def _lost_now(self) -> set[str]:
        now = time.monotonic()
        for worker_id in [w for w, t in self._lost.items() if now - t > LOST_HOLD_S]:
            del self._lost[worker_id]
        return set(self._lost)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Serve's new set of worker replicas. One that left it while this router knew its
        transfer port is being stopped (or died): it is asked to drain, so its running
        requests go on elsewhere instead of holding up its shutdown."""
        kept_ids = {r.replica_id.unique_id for r in replicas}
        self._lost = {w: t for w, t in self._lost.items() if w in kept_ids}
        if self._kv_transfer is not None:
            kept = {r.replica_id for r in replicas}
            for replica_id, replica in self.curr_replicas.items():
                meta = replica.replica_metadata or {}
                if replica_id not in kept and meta.get("kv_address"):
                    asyncio.run_coroutine_threadsafe(
                        request_drain(meta["kv_address"], self._kv_transfer), self._event_loop)
        super().update_replicas(replicas)

    @staticmethod
    def _kv_source(by_id: dict[str, RunningReplica], held_tokens: dict[str, int],
                   block_size: int) -> dict | None:
        """The worker holding most of the prompt's prefix, for whichever worker takes the
        request to pull from (cluster/kv_service.py; the holder itself ignores it). None when
        no candidate holds any or KV transfer is off."""
        holder = max(held_tokens, key=held_tokens.get, default=None)
        replica = by_id.get(holder)
        meta = replica.replica_metadata if replica is not None else None
        if not meta or not meta.get("kv_address") or not block_size:
            return None
        return {"address": meta["kv_address"], "num_blocks": held_tokens[holder] // block_size}

    def _record(self, request_id: str, replica_id: str) -> None:
        prompt_len, held = self._prompts.get(request_id, (0, {}))
        self._get_policy().dispatched.add(request_id, replica_id,
                                          max(0, prompt_len - held.get(replica_id, 0)))

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result) -> None:
        request_id = pending_request.metadata.internal_request_id
        if self._get_policy().dispatched.replica_of(request_id) != replica_id.unique_id:
            self._record(request_id, replica_id.unique_id)  # a later choice took it
        self._prompts.pop(request_id, None)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._get_policy().dispatched.done(internal_request_id)
        self._prompts.pop(internal_request_id, None)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._get_policy().dispatched.drop_replica(replica_id.unique_id)

    @staticmethod
    def _load(replica: RunningReplica) -> ReplicaLoad:
        """The worker's last report (nothing before its first: the policy then counts every
        request this router has in flight there)."""
        stats = replica.routing_stats or {}
        used, free = stats.get("num_kv_blocks_used", 0), stats.get("num_kv_blocks_free", 0)
        return ReplicaLoad(replica.replica_id.unique_id,
                           stats.get("num_running", 0) + stats.get("num_waiting", 0),
                           used / (used + free) if used + free else 0.0,
                           stats.get("num_prefill_tokens_pending", 0), stats.get("reported_at"))

    @staticmethod
    def _prompt(pending: PendingRequest | None) -> list[int] | None:
        """The pending `generate` call's prompt token ids (None for other calls)."""
        if pending is None or pending.metadata.call_method != "generate" or not pending.args:
            return None
        return pending.args[0]

    @staticmethod
    def _prompt_hashes(replicas: list[RunningReplica],
                       prompt: list[int] | None) -> tuple[list[int], int]:
        """The prompt's block hashes as the workers compute them ([] when unknown)."""
        meta = next((r.replica_metadata for r in replicas if r.replica_metadata), None)
        if prompt is None or meta is None:
            return [], 0
        block_size = meta["block_size"]
        return block_hashes(prompt, block_size, meta["model_id"]), block_size


class RoundRobinRequestRouter(FIFOMixin, RequestRouter):
    """Each request to the next replica in turn (by replica id), the rest as fallbacks: the
    baseline that bench/routing.py compares against."""

    def initialize_state(self) -> None:
        self._next = 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        if not ordered:
            return []
        start = self._next % len(ordered)
        self._next += 1
        return [[r] for r in ordered[start:] + ordered[:start]]
