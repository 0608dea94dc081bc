"""A worker replica's logic, free of Ray (the Serve deployment in deployments.py only wires it):
an `AsyncEngine` (engine loop on its own thread beside the replica's event loop), admission
control, and the load report routing and autoscaling read.

Admission: the engine runs `max_num_seqs` requests at once; up to `max_queued_requests` more may
wait. A request beyond that is rejected at once with RESOURCE_EXHAUSTED rather than queued
without bound.

Outputs go back as this generator's items, or (a request with `stream_to`, from a router with
direct streams) from the engine thread over the router's output channel
(cluster/output_channel.py), the generator then yielding nothing but a hand-back.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import os
import time
from collections.abc import AsyncIterator

from mxserve.api.errors import (
    RESOURCE_EXHAUSTED,
    UNAVAILABLE,
    InvalidRequestError,
    ServeError,
    UnavailableError,
)
from mxserve.api.outputs import ResumeState, StepOutput
from mxserve.api.sampling_params import SamplingParams
from mxserve.cluster.logs import rss_bytes, thread_cpu_s
from mxserve.cluster.output_channel import OutputSender
from mxserve.worker import migration
from mxserve.worker.async_engine import AsyncEngine
from mxserve.worker.engine import Engine


class Worker:
    """Serves one engine. Construct, then `start()`; `shutdown()` stops the engine loop."""

    def __init__(self, engine: Engine, max_queued_requests: int, worker_id: str = "worker",
                 node_id: str = "", stall_timeout_s: float = 60.0,
                 streams_per_token: int = 8, max_tokens_per_message: int = 16) -> None:
        if max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {max_queued_requests}")
        self.engine = engine
        self.async_engine = AsyncEngine(engine, tokens_per_wake=self.tokens_per_message)
        self.capacity = engine.config.max_num_seqs + max_queued_requests
        self.worker_id, self.node_id = worker_id, node_id
        # work pending and no step finished for this long: the engine is wedged (check_health)
        self.stall_timeout_s = stall_timeout_s
        self.num_in_flight = 0  # requests admitted and not yet finished (event-loop side)
        self.num_requests_total = 0  # requests admitted
        self.num_requests_aborted = 0  # admitted, then closed before they finished
        # prompt tokens of admitted requests with no output yet, less the prefix-cache hits each
        # had when admitted: the prefill work queued here, as routing weighs it
        self.num_prefill_tokens_pending = 0
        # Running totals, read by the metrics exporter.
        self.num_prompt_tokens = 0
        self.num_prefix_hit_tokens = 0  # prompt tokens served from the prefix cache
        self.num_output_tokens = 0
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0  # speculation
        self._froze_gc = False  # start(freeze_gc=True) froze the heap; shutdown thaws it
        # Prefix pull from peers (cluster/kv_service.KVPuller), when KV transfer is on.
        self.kv_puller = None
        # drain(): no request runs here any more; each goes on elsewhere (worker/migration.py)
        self.draining = False
        self.num_migrated_out = 0  # requests handed back by drain()
        self.num_resumed = 0  # requests resumed here from another worker
        # Under load a stream's tokens go out several to a message (cluster/config.Streaming;
        # the engine stream wakes its consumer only once they are due): each message costs the
        # same Python work at every hop (worker -> router -> proxy), and each wake-up of a
        # stream's task the worker's event loop, which shares the GIL with the engine thread
        # (bench/results/serve_gpu.md); a lone stream still gets every token at once.
        self.streams_per_token = streams_per_token
        self.max_tokens_per_message = max_tokens_per_message
        # Direct streams: a sender a router's output channel (address, token), made on the
        # first request that names it, and the requests each carries now.
        self._senders: dict[tuple[str, str], OutputSender] = {}
        self._direct_requests: dict[OutputSender, set[str]] = {}

    def start(self, freeze_gc: bool = False) -> None:
        """Start the engine loop. freeze_gc (a process serving this one engine, as a Serve
        replica): move every object alive now (the model, the engine, the libraries) out of the
        cyclic garbage collector's reach (`gc.freeze`), so its full collections scan only what
        requests create. Without it a full collection walks the whole heap while the engine
        thread waits: long pauses every few hundred steps at large batches
        (bench/results/host_overhead.md)."""
        if freeze_gc:
            gc.collect()
            gc.freeze()
        self._froze_gc = freeze_gc
        self.async_engine.start()

    def shutdown(self) -> None:
        for sender in self._senders.values():
            sender.close()
        self.async_engine.shutdown()
        self.engine.shutdown()
        if self._froze_gc:
            gc.unfreeze()  # what was frozen is collectable again (a process may go on)
            self._froze_gc = False

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str, kv_source: dict | None = None,
                       resume: ResumeState | None = None,
                       stream_to: dict | None = None) -> AsyncIterator[StepOutput]:
        """Stream the request's engine outputs. Closing the stream (or cancelling the task
        iterating it) aborts the request in the engine, which frees its KV blocks.

        kv_source: a peer holding the prompt's leading blocks ({"address", "num_blocks"}, from
        routing): they are pulled first when that beats computing them (`kv_puller`).
        resume: the request was running on a worker that drained; it goes on from there. A
        draining worker answers with one output, finish_reason "migrate", for the caller to
        go on elsewhere (so does every request running here when `drain` is called).
        stream_to: {"address", "token", "key"}: the engine's outputs go over that router's
        output channel instead (the module's docstring); this yields only a hand-back, and
        raises UNAVAILABLE when the channel fails.

        Raises ServeError: INVALID_ARGUMENT (bad request), RESOURCE_EXHAUSTED (queue full)."""
        if self.draining:
            yield self._handed_back(request_id, prompt_token_ids, resume)
            return
        held = self.num_in_flight - self.async_engine.num_ending  # (ended ones hold nothing)
        if held >= self.capacity:
            raise ServeError(RESOURCE_EXHAUSTED,
                             f"worker {self.worker_id} is full: {held} requests "
                             f"running or queued (limit {self.capacity}); retry later")
        try:
            request = self.engine.make_request(prompt_token_ids, params, request_id)
            if resume is not None:
                migration.resume(self.engine, request, resume)
        except InvalidRequestError as e:
            raise ServeError.invalid(e) from None
        # (a request wanting prompt logprobs computes its whole prompt: pulled blocks go unused)
        if kv_source and self.kv_puller is not None and not request.needs_prompt_logprobs:
            await self.kv_puller.maybe_pull(request.block_hashes, request.num_tokens, kv_source)
        if self.draining:  # drained while it pulled
            yield self._handed_back(request_id, prompt_token_ids, resume)
            return
        self.num_resumed += resume is not None
        sender = direct = None
        if stream_to is not None:
            sender = self._sender(stream_to)
            direct = (sender, stream_to["key"])
            self._direct_requests[sender].add(request_id)
        # (a resumed request computes its prompt + output so far, less what it finds cached)
        pending = max(0, request.num_tokens - self.engine.num_prefix_hit_tokens(request))
        self.num_in_flight += 1
        self.num_requests_total += 1
        self.num_prefill_tokens_pending += pending
        first, finished, counted = True, False, True
        try:  # (closed with this stream, not when collected: the abort goes out at once)
            async with contextlib.aclosing(self.async_engine.stream(request, direct)) as stream:
                async for out in stream:
                    finished = out.finished
                    if finished:  # counted out before its last output leaves: a router
                        self.num_in_flight -= 1  # admitting the next one finds room here
                        counted = False
                    if first:
                        self.num_prompt_tokens += out.num_prompt_tokens
                        self.num_prefix_hit_tokens += out.num_cached_tokens
                        self.num_prefill_tokens_pending -= pending
                        first = False
                    self.num_output_tokens += len(out.new_token_ids)
                    if out.finished:
                        self.num_drafts += out.num_drafts
                        self.num_draft_tokens += out.num_draft_tokens
                        self.num_accepted_tokens += out.num_accepted_tokens
                    if sender is None:
                        yield out
        except InvalidRequestError as e:
            finished = True  # rejected, not aborted
            raise ServeError.invalid(e) from None
        except UnavailableError as e:
            raise ServeError(UNAVAILABLE, f"worker {self.worker_id}: {e}") from None
        finally:
            self.num_in_flight -= counted
            self.num_requests_aborted += not finished
            if first:  # ended before its first output
                self.num_prefill_tokens_pending -= pending
            if sender is not None:
                self._direct_requests.get(sender, set()).discard(request_id)

    def _sender(self, stream_to: dict) -> OutputSender:
        """The sender to a router's output channel (a new one where the last failed)."""
        where = (stream_to["address"], stream_to["token"])
        sender = self._senders.get(where)
        if sender is None or sender.failed is not None:
            loop = asyncio.get_running_loop()
            sender = OutputSender(*where)
            sender.on_failure = lambda e, s=sender: loop.call_soon_threadsafe(
                self._channel_failed, s, e)
            self._senders[where] = sender
            self._direct_requests[sender] = set()
            sender.start()
        return sender

    def _channel_failed(self, sender: OutputSender, error: Exception) -> None:
        """A router's output channel broke: its requests end UNAVAILABLE (their generators
        raise; closing them aborts each in the engine, freeing its blocks)."""
        where = (sender.address, sender.token)
        if self._senders.get(where) is sender:
            del self._senders[where]
        for request_id in self._direct_requests.pop(sender, ()):
            self.async_engine.fail_stream(request_id, UnavailableError(
                f"the output channel to its router {sender.address} failed: {error!r}"))

    def tokens_per_message(self, num_streams: int) -> int:
        """How many tokens a stream's message carries with num_streams open (see __init__);
        called on the engine thread."""
        return max(1, min(self.max_tokens_per_message, num_streams // self.streams_per_token))

    async def drain(self) -> int:
        """Take no more requests and hand every one here back to go on elsewhere: each stream
        ends with finish_reason "migrate" and the state a peer resumes from, its blocks left
        in the prefix cache for the peer to pull. Returns how many were handed back."""
        self.draining = True
        moved = await self.async_engine.suspend_all(self._where_from)
        self.num_migrated_out += moved
        return moved

    def _where_from(self, out: StepOutput) -> StepOutput:
        """A suspended request's output, its resume state naming this worker."""
        address = self.kv_puller.own_address if self.kv_puller is not None else None
        return dataclasses.replace(out, resume=dataclasses.replace(
            out.resume, worker_id=self.worker_id, kv_address=address))

    def _handed_back(self, request_id: str, prompt_token_ids: list[int],
                     resume: ResumeState | None) -> StepOutput:
        """The answer of a draining worker to a new request: go on elsewhere, as it came."""
        state = resume or ResumeState("", None, 0, [], None, 0)
        state = dataclasses.replace(state, worker_id=self.worker_id, num_blocks=0,
                                    worker_lost=False)
        return StepOutput(request_id, [], None, True, "migrate", len(prompt_token_ids),
                          state.num_cached_tokens, len(state.output_token_ids), resume=state)

    async def audit(self) -> dict:
        """What this worker holds for requests: the engine's requests and used KV blocks (read
        on the engine thread between steps, after `check_integrity`, which raises on a broken
        block table), its streams and admission counts. Once idle, all are zero: the cancel
        and fault tests read it."""
        def inspect(engine: Engine) -> dict:
            engine.kv.check_integrity()
            return dict(engine_requests=len(engine.requests),
                        kv_blocks_used=engine.stats().num_kv_blocks_used)

        state = await self.async_engine.call(inspect)
        return dict(state, worker_id=self.worker_id, in_flight=self.num_in_flight,
                    streams=self.async_engine.num_streams,
                    prefill_tokens_pending=self.num_prefill_tokens_pending,
                    tasks=len(asyncio.all_tasks()), rss_bytes=rss_bytes(),
                    engine_loop=self.async_engine.loop_stats(),
                    process_cpu_s=sum(os.times()[:2]), thread_cpu_s=thread_cpu_s(),
                    pid=os.getpid())

    def check_health(self) -> None:
        """Raise when this worker can serve no more (Serve then replaces the replica, and the
        routers move its streams on): its engine failed (a tensor-parallel rank died or hung),
        its engine thread is gone, or the engine is wedged: work pending and no step finished
        for `stall_timeout_s`."""
        if self.async_engine.fatal is not None:
            raise RuntimeError(f"worker {self.worker_id}: {self.async_engine.fatal}")
        self.engine.check_health()
        if not self.async_engine.running:
            raise RuntimeError(f"worker {self.worker_id}: the engine thread has stopped")
        stalled = self.async_engine.stalled_s()
        if stalled > self.stall_timeout_s:
            raise RuntimeError(f"worker {self.worker_id}: the engine has had work and finished "
                               f"no step for {stalled:.0f} s (limit {self.stall_timeout_s:g} s)")

    def load(self) -> dict:
        """The engine's load now; fields as in the proto's WorkerLoad. Waiting counts requests
        admitted and not yet handed to the engine's scheduler too."""
        stats = self.engine.stats()  # read from the event loop while the engine thread runs:
        # each number is current, together they may straddle a step
        waiting = max(stats.num_waiting, self.num_in_flight - stats.num_running)
        return dict(worker_id=self.worker_id, node_id=self.node_id,
                    num_running=stats.num_running, num_waiting=waiting,
                    num_kv_blocks_used=stats.num_kv_blocks_used,
                    num_kv_blocks_free=stats.num_kv_blocks_free,
                    num_requests_total=self.num_requests_total,
                    num_requests_aborted=self.num_requests_aborted,
                    num_prefill_tokens_pending=self.num_prefill_tokens_pending,
                    reported_at=time.time(), draining=self.draining, capacity=self.capacity,
                    num_preemptions=self.engine.scheduler.num_preemptions)

    @property
    def num_evicted_tokens(self) -> int:
        """Cached tokens KV eviction has dropped (0 with it off)."""
        evictor = self.engine.evictor
        return evictor.num_evicted_tokens if evictor is not None else 0

    def draft_stats(self) -> dict | None:
        """The draft replica channel's counters (worker/draft_channel.RemoteDrafter), or None
        when this engine drafts locally or not at all."""
        drafter = self.engine.drafter
        if not hasattr(drafter, "num_fallback_steps"):
            return None
        return dict(worker_id=self.worker_id, num_rounds=drafter.num_rounds,
                    num_failures=drafter.num_failures,
                    num_fallback_steps=drafter.num_fallback_steps,
                    round_trip_p50_ms=drafter.round_trip_p50_ms)

    async def wait_idle(self, timeout_s: float = 10.0) -> bool:
        """Wait until no request holds KV blocks or waits; True if it happened in time."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            load = self.load()
            if load["num_running"] == load["num_waiting"] == 0:
                return True
            await asyncio.sleep(0.02)
        return False
