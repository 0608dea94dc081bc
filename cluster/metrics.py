"""mxserve's metrics, exported through Ray's Prometheus endpoint (names get Ray's "ray_" prefix;
Serve adds application/deployment/replica tags).

Router (per request): time to first token, time per output token, requests by outcome, output
tokens. Worker (sampled every `interval_s`): running and waiting requests (queue depth), KV blocks
used/free and usage, prefix-cache hit tokens, prompt tokens, generated tokens per second,
speculation's drafts and accepted tokens, and with a draft replica its rounds, failures, the
steps decoded without drafts and the round trip.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from ray.serve import metrics

if TYPE_CHECKING:
    from mxserve.cluster.worker import Worker

_LATENCY_BUCKETS = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0]
_TPOT_BUCKETS = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0]


class RayRouterMetrics:
    """`router.ingress.RouterMetrics` on Ray metrics."""

    def __init__(self) -> None:
        self.ttft = metrics.Histogram("mxserve_time_to_first_token_seconds",
                                      "Request arrival at the router to its first token",
                                      boundaries=_LATENCY_BUCKETS)
        self.tpot = metrics.Histogram("mxserve_time_per_output_token_seconds",
                                      "Mean time between a request's output tokens",
                                      boundaries=_TPOT_BUCKETS)
        self.requests = metrics.Counter("mxserve_requests_total", "Requests by how they ended",
                                        tag_keys=("status",))
        self.tokens = metrics.Counter("mxserve_generation_tokens_total",
                                      "Output tokens streamed to clients (rate() = tokens/s)")

    def on_request_end(self, status: str, ttft_s: float | None, tpot_s: float | None,
                       num_output_tokens: int) -> None:
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)
        self.requests.inc(1, tags={"status": status})
        if num_output_tokens:
            self.tokens.inc(num_output_tokens)


class RoutingMetrics:
    """The routing policy's metrics (router/routing.py's PrefixRouter), wherever it runs:
    Serve's request router (cluster/request_router.py) or the router itself (request intake,
    cluster/intake.py)."""

    def __init__(self) -> None:
        self.lookups = metrics.Counter(
            "mxserve_router_prefix_lookups_total",
            "Prefix index lookups by outcome: ok, error (failed or timed out: routed by load), "
            "skipped (backing off after an error: routed by load)", tag_keys=("outcome",))
        self.lookup_latency = metrics.Histogram(
            "mxserve_router_prefix_lookup_seconds", "Prefix index lookup latency",
            boundaries=[0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1])
        self.cached_tokens = metrics.Counter(
            "mxserve_router_routed_cached_tokens_total",
            "Prompt tokens the chosen worker held in its prefix cache, per the index")

    def on_lookup(self, outcome: str, latency_s: float | None) -> None:
        self.lookups.inc(tags={"outcome": outcome})
        if latency_s is not None and outcome == "ok":
            self.lookup_latency.observe(latency_s)

    def on_routed(self, cached_tokens: int) -> None:
        if cached_tokens:
            self.cached_tokens.inc(cached_tokens)


class WorkerMetricsExporter:
    """Samples a Worker's load and running totals into Ray gauges and counters."""

    def __init__(self, worker: Worker, interval_s: float = 1.0) -> None:
        self.worker, self.interval_s = worker, interval_s
        gauge = metrics.Gauge
        self.running = gauge("mxserve_num_requests_running", "Requests the engine runs")
        self.waiting = gauge("mxserve_num_requests_waiting", "Requests queued in the engine")
        self.kv_used = gauge("mxserve_kv_blocks_used", "KV blocks referenced by requests")
        self.kv_free = gauge("mxserve_kv_blocks_free", "KV blocks free or evictable")
        self.kv_usage = gauge("mxserve_kv_cache_usage", "Fraction of KV blocks in use")
        self.tokens_per_s = gauge("mxserve_generation_tokens_per_second",
                                  "Output tokens per second over the last interval")
        self.prefix_hits = metrics.Counter("mxserve_prefix_cache_hit_tokens_total",
                                           "Prompt tokens served from the prefix cache")
        self.prompt_tokens = metrics.Counter("mxserve_prompt_tokens_total", "Prompt tokens")
        counter = metrics.Counter
        self.spec = (  # speculative decoding, counted as requests finish
            counter("mxserve_spec_decode_num_drafts_total", "Steps that verified drafts"),
            counter("mxserve_spec_decode_num_draft_tokens_total", "Draft tokens verified"),
            counter("mxserve_spec_decode_num_accepted_tokens_total", "Draft tokens accepted"))
        self.remote = (  # a draft replica's channel (draft_placement "replica")
            counter("mxserve_draft_replica_rounds_total", "Draft messages a replica answered"),
            counter("mxserve_draft_replica_failures_total",
                    "Draft messages that failed or missed their deadline"),
            counter("mxserve_draft_replica_fallback_steps_total",
                    "Steps decoded without drafts because no draft replica answered"))
        self.round_trip = gauge("mxserve_draft_replica_round_trip_seconds",
                                "Median draft round trip over the latest messages")
        self.evicted = counter("mxserve_kv_evicted_tokens_total",
                               "Cached tokens dropped by KV eviction (kv_eviction)")
        self._last_evicted = 0
        self.preemptions = counter("mxserve_num_preemptions_total",
                                   "Requests preempted: KV blocks freed, recomputed later")
        self._last_preemptions = 0
        self.kv_pulls = counter("mxserve_kv_pulls_total",
                                "Prefix pulls from peers by outcome: ok, skipped (computing was "
                                "cheaper), checksum, truncated, timeout, peer, layout, refused, "
                                "peer_down, no_blocks", tag_keys=("outcome",))
        self.kv_pulled = (counter("mxserve_kv_pulled_blocks_total", "KV blocks pulled from peers"),
                          counter("mxserve_kv_pulled_bytes_total", "KV bytes pulled from peers"))
        self._last_pulls: dict[str, int] = {}
        self._last = (0, 0, 0)
        self._last_spec = (0, 0, 0)
        self._last_remote = (0, 0, 0)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        last_time = loop.time()
        while True:
            await asyncio.sleep(self.interval_s)
            now = loop.time()
            self.export(now - last_time)
            last_time = now

    def export(self, elapsed_s: float) -> None:
        w = self.worker
        load = w.load()
        self.running.set(load["num_running"])
        self.waiting.set(load["num_waiting"])
        self.kv_used.set(load["num_kv_blocks_used"])
        self.kv_free.set(load["num_kv_blocks_free"])
        total = load["num_kv_blocks_used"] + load["num_kv_blocks_free"]
        self.kv_usage.set(load["num_kv_blocks_used"] / total if total else 0.0)
        totals = (w.num_prefix_hit_tokens, w.num_prompt_tokens, w.num_output_tokens)
        hits, prompts, outputs = (now - before for now, before in zip(totals, self._last))
        self._last = totals
        if hits:
            self.prefix_hits.inc(hits)
        if prompts:
            self.prompt_tokens.inc(prompts)
        self.tokens_per_s.set(outputs / elapsed_s if elapsed_s > 0 else 0.0)
        spec = (w.num_drafts, w.num_draft_tokens, w.num_accepted_tokens)
        for counter, now, before in zip(self.spec, spec, self._last_spec):
            if now > before:
                counter.inc(now - before)
        self._last_spec = spec
        evicted = w.num_evicted_tokens
        if evicted > self._last_evicted:
            self.evicted.inc(evicted - self._last_evicted)
        self._last_evicted = evicted
        if load["num_preemptions"] > self._last_preemptions:
            self.preemptions.inc(load["num_preemptions"] - self._last_preemptions)
        self._last_preemptions = load["num_preemptions"]
        self._export_pulls()
        stats = w.draft_stats()
        if stats:
            remote = (stats["num_rounds"], stats["num_failures"], stats["num_fallback_steps"])
            for counter, now, before in zip(self.remote, remote, self._last_remote):
                if now > before:
                    counter.inc(now - before)
            self._last_remote = remote
            if stats["round_trip_p50_ms"] is not None:
                self.round_trip.set(stats["round_trip_p50_ms"] / 1e3)

    def _export_pulls(self) -> None:
        puller = self.worker.kv_puller
        if puller is None:
            return
        counts = dict(puller.counts)
        for key, now in counts.items():
            delta = now - self._last_pulls.get(key, 0)
            if delta <= 0:
                continue
            if key == "blocks":
                self.kv_pulled[0].inc(delta)
            elif key == "bytes":
                self.kv_pulled[1].inc(delta)
            else:
                self.kv_pulls.inc(delta, tags={"outcome": key})
        self._last_pulls = counts
