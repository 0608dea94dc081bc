"""Drives an Engine from a background thread and streams each request's outputs to asyncio.

The engine is single-threaded: only the loop thread touches it. Callers on the event loop hand
it new requests and aborts through a command queue. Each request's outputs go to its stream
(`_Stream`): the loop thread appends them and wakes the consumer (one `call_soon_threadsafe` per
event loop per step, for every stream woken) when a message is due; the consumer takes all
that piled up as one (`merge_outputs`). The KV cache's events (for the global prefix index)
leave the loop thread through a sink (`watch_kv_events`).

When a message is due: by default at every output, so a consumer slower than the engine (a
Serve stream, a gRPC client) gets what piled up merged, and no token is delayed. With
`tokens_per_wake` (the Worker's streaming policy) a stream is woken once that many tokens are
due, and always for its first output, its last and an error: under load each wake-up of a
consumer task costs the event loop more than a step's share per token, and the event loop
holds the GIL the loop thread steps with (bench/results/serve_gpu.engine_loop.md). vLLM's
`--stream-interval` is the same trade.

A direct stream (`stream(request, direct=(sender, key))`, cluster/output_channel.py) sends its
messages from the loop thread: each step's due messages go to their sender as one batch of
(key, encode_output) pairs, and the consumer is woken only for the first, the last and one in
DIRECT_WAKE_EVERY (it takes every message sent, merged, as before: the caller counts tokens
as it always did).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from mxserve.api.errors import UnavailableError
from mxserve.api.outputs import StepOutput, encode_output, merge_outputs
from mxserve.api.sampling_params import SamplingParams
from mxserve.worker.engine import Engine
from mxserve.worker.kv_cache import KVEvent
from mxserve.worker.migration import suspend
from mxserve.worker.request import Request

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVSnapshot:
    """Every block hash in the prefix cache at one moment, in the event stream's order: events
    delivered after it are changes since."""

    block_hashes: list[int]


KVSink = Callable[[list[KVEvent] | KVSnapshot], None]


class _Stream:
    """A request's outputs (or the error that ends it) on their way to its consumer. The loop
    thread `put`s each at once and sets `ready` on the consumer's loop when a message is due;
    the consumer `take`s everything put so far as one message, so one that lags gets all
    that piled up, not only what was due."""

    __slots__ = ("loop", "ready", "_lock", "_items", "_tokens", "_wake_pending", "_woken",
                 "direct", "held", "held_tokens", "sent_unwoken")

    def __init__(self, loop: asyncio.AbstractEventLoop, direct: tuple | None = None) -> None:
        self.loop = loop
        # (sender, key): messages leave from the loop thread (the module's docstring); `held`
        # are outputs not yet due (loop thread only)
        self.direct = direct
        self.held: list[StepOutput] = []
        self.held_tokens = 0
        self.sent_unwoken = 0  # messages sent since the consumer was last woken
        self.ready = asyncio.Event()
        self._lock = threading.Lock()
        self._items: list = []
        self._tokens = 0  # tokens put and not yet taken
        self._wake_pending = False  # a wake-up is on its way and nothing was taken since
        self._woken = False  # the first output went

    def put(self, item: object, num_tokens: int, due: int | None) -> bool:
        """Add an output (loop thread); True when the consumer is to be woken now: always
        for the first, for due None (the last output, a stop, an error), else once due
        tokens wait and no wake-up is on its way."""
        with self._lock:
            self._items.append(item)
            self._tokens += num_tokens
            if due is not None and self._woken and (self._wake_pending or self._tokens < due):
                return False
            self._woken = self._wake_pending = True
            return True

    def take(self) -> list:
        """Everything put so far (consumer)."""
        with self._lock:
            items, self._items = self._items, []
            self._tokens, self._wake_pending = 0, False
            return items


class AsyncEngine:
    def __init__(self, engine: Engine,
                 tokens_per_wake: Callable[[int], int] | None = None) -> None:
        """tokens_per_wake(number of streams) -> how many tokens a stream's wake-up waits for
        (the module's docstring); None: every output wakes its stream."""
        self.engine = engine
        self.tokens_per_wake = tokens_per_wake
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        # Requests whose last output the loop thread has handed on and whose consumer has not
        # taken it yet (`num_ending`); set.add / discard are atomic across the two threads
        self._ending: set[str] = set()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        # Why the engine can step no more (a tensor-parallel rank failed), once it can't:
        # requests in flight and later ones then fail with UnavailableError.
        self.fatal: str | None = None
        self._kv_sink: KVSink | None = None
        # time.monotonic() when the loop thread last finished a step or found nothing to do:
        # with work pending and this old, the engine is wedged (`stalled_s`)
        self.progress_at = time.monotonic()
        # The loop thread's steps so far: how many, their wall time and the thread's CPU time
        # in them (each step with its hand-over of outputs), and of those the hand-over's
        # (KV events and outputs to their streams). Wall well over CPU plus the device's time
        # is the thread waiting for the GIL (`loop_stats`).
        self.num_steps, self.step_wall_s, self.step_cpu_s = 0, 0.0, 0.0
        self.deliver_wall_s = self.deliver_cpu_s = 0.0

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mxserve-engine", daemon=True)
            self._thread.start()

    @property
    def num_streams(self) -> int:
        """Requests with an open output stream here."""
        return len(self._streams)

    @property
    def num_ending(self) -> int:
        """Streams whose request is over in the engine (its last output handed on) and whose
        consumer has not yet taken that output: a caller counting its requests in flight on the
        event loop still counts these, though they hold no place in the engine. The loop may
        take a socket's data before an earlier wake-up from this thread (uvloop runs I/O
        callbacks before the callbacks queued for the next turn), so a router answered with
        the last output can have its next request here first."""
        return len(self._ending)

    @property
    def running(self) -> bool:
        """The loop thread was started and has not stopped."""
        return self._thread is not None and self._thread.is_alive()

    def stalled_s(self) -> float:
        """How long the engine has had work without finishing a step (0 when idle or
        stepping): a step that never returns (a hung kernel or collective) grows it without
        bound. Read from any thread."""
        if not self.engine.has_unfinished_requests():
            return 0.0
        return max(0.0, time.monotonic() - self.progress_at)

    def loop_stats(self) -> dict:
        """The loop thread's steps so far (see __init__); read from any thread."""
        return dict(num_steps=self.num_steps, step_wall_s=self.step_wall_s,
                    step_cpu_s=self.step_cpu_s, deliver_wall_s=self.deliver_wall_s,
                    deliver_cpu_s=self.deliver_cpu_s)

    def shutdown(self) -> None:
        self._stopping.set()
        self._commands.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout=30)

    async def generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[StepOutput]:
        """Stream a request's outputs; closing the iterator early (cancel) aborts the request.

        Raises InvalidRequestError before anything streams if the request is bad.
        """
        request = self.engine.make_request(prompt_token_ids, sampling_params, request_id)
        async for out in self.stream(request):
            yield out

    async def stream(self, request: Request,
                     direct: tuple | None = None) -> AsyncIterator[StepOutput]:
        """`generate` for a request built by `engine.make_request` (safe on any thread).
        direct: (sender, key): every message goes as (key, encode_output) in a batch to
        sender.send(list) from the loop thread; this yields the first message, then what was
        sent since, merged, once in DIRECT_WAKE_EVERY messages and at the end."""
        if self.fatal is not None:
            raise UnavailableError(self.fatal)
        rid = request.request_id
        if rid in self._streams:
            from mxserve.api.errors import InvalidRequestError
            raise InvalidRequestError("request_id", f"{rid!r} is already running")
        stream = _Stream(asyncio.get_running_loop(), direct)
        self._streams[rid] = stream
        self._commands.put(("add", request))
        finished, error = False, None
        try:
            while not finished:
                await stream.ready.wait()
                stream.ready.clear()
                items = stream.take()
                if not items:  # taken with an earlier wake-up
                    continue
                if isinstance(items[0], BaseException):
                    raise items[0]
                for i, later in enumerate(items):  # piled up: one message
                    if isinstance(later, BaseException):
                        error, items = later, items[:i]  # after what came before it
                        break
                item = merge_outputs(items)
                finished = item.finished
                if finished:
                    self._ending.discard(rid)
                yield item
                if error is not None:
                    raise error
        finally:
            self._streams.pop(rid, None)
            self._ending.discard(rid)
            if not finished:  # its output goes nowhere: a new stream may have taken its id
                self._commands.put(("drop", rid))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def fail_stream(self, request_id: str, error: BaseException) -> None:
        """End a request's stream with error (any thread; the consumer raises it, and closing
        the stream aborts the request): its direct sender failed."""
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put(error, 0, None)
            stream.loop.call_soon_threadsafe(stream.ready.set)

    async def call(self, fn: Callable[[Engine], object],
                   undo: Callable[[object], object] | None = None) -> object:
        """Run fn(engine) on the loop thread between two steps; its result (or exception).
        `undo(result)` runs on the loop thread when the caller is cancelled before the result
        arrives: what fn took (blocks pinned or reserved) is given back, not leaked."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._commands.put(("call", (fn, loop, future)))
        if undo is None:
            return await future
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            def give_back(done: asyncio.Future) -> None:
                if not done.cancelled() and done.exception() is None:
                    result = done.result()
                    self.submit(lambda engine: undo(result))
            future.add_done_callback(give_back)
            raise

    async def suspend_all(self, fill: Callable[[StepOutput], StepOutput]) -> int:
        """Hand every request back to go on elsewhere (worker/migration.py): each stream gets
        its last output, finish_reason "migrate", passed through `fill` first (the caller adds
        where it was). Returns how many."""
        def run(engine: Engine) -> int:
            self._deliver_all(engine.complete_inflight())
            request_ids = list(engine.requests)
            for request_id in request_ids:
                self._deliver(request_id, fill(suspend(engine, request_id)))
            return len(request_ids)
        return await self.call(run)

    def submit(self, fn: Callable[[Engine], object]) -> None:
        """Run fn(engine) on the loop thread between two steps, not waiting for it (a failure
        is logged)."""
        self._commands.put(("call", (fn, None, None)))

    def watch_kv_events(self, sink: KVSink) -> None:
        """Turn on the KV cache's events. The loop thread calls `sink` (quickly; it must not
        block) with each batch of events in the order the cache changed, and with a `KVSnapshot`
        in its place in that order whenever `request_kv_snapshot()` asks."""
        self._kv_sink = sink
        self._commands.put(("watch", None))

    def request_kv_snapshot(self) -> None:
        self._commands.put(("snapshot", None))

    # ---- the loop thread ---------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping.is_set():
            idle = self.fatal is not None or not self.engine.has_unfinished_requests()
            if idle:
                self.progress_at = time.monotonic()
            self._drain_commands(block=idle)
            if self.fatal is not None or not self.engine.has_unfinished_requests():
                continue
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                outputs = self.engine.step()
            except BaseException as e:  # fail every stream; keep the thread alive for aborts
                self._fail_all(e)
                continue
            self.progress_at = time.monotonic()
            stepped_wall, stepped_cpu = time.perf_counter(), time.thread_time()
            self._flush_kv_events()
            self._deliver_all(outputs)
            self.num_steps += 1
            done_wall, done_cpu = time.perf_counter(), time.thread_time()
            self.step_wall_s += done_wall - wall
            self.step_cpu_s += done_cpu - cpu
            self.deliver_wall_s += done_wall - stepped_wall
            self.deliver_cpu_s += done_cpu - stepped_cpu

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, arg = command
            if kind == "add":
                try:
                    if self.fatal is not None:
                        raise UnavailableError(self.fatal)
                    self.engine.add(arg)
                except Exception as e:
                    self._deliver(arg.request_id, e)
            elif kind == "abort":
                out = self.engine.abort(arg)
                if out is not None:
                    self._deliver(arg, out)
            elif kind == "drop":  # a closed stream's request
                self.engine.abort(arg)
            elif kind == "call":
                self._call(*arg)
            elif kind == "watch":
                self.engine.kv.record_events = True
            elif kind == "snapshot" and self._kv_sink is not None:
                self._flush_kv_events()
                self._kv_sink(KVSnapshot(self.engine.kv.cached_block_hashes()))
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _call(self, fn: Callable[[Engine], object], loop: asyncio.AbstractEventLoop | None,
              future: asyncio.Future | None) -> None:
        try:
            result, error = fn(self.engine), None
        except Exception as e:
            result, error = None, e
            if future is None:
                logger.exception("engine call %r failed", fn)
        if future is not None:
            loop.call_soon_threadsafe(settle, future, result, error)

    def _flush_kv_events(self) -> None:
        if self._kv_sink is not None:
            events = self.engine.kv.take_events()
            if events:
                self._kv_sink(events)

    def _mark_ending(self, request_id: str, stream: _Stream) -> None:
        """(loop thread) The request's last output is on its way to `stream`. Undone at once
        when the consumer closed the stream meanwhile (it discards after it pops)."""
        self._ending.add(request_id)
        if self._streams.get(request_id) is not stream:
            self._ending.discard(request_id)

    def _deliver(self, request_id: str, item: object) -> None:
        """One output or error for a stream, its consumer woken at once (a direct stream's
        output goes to its sender at once, with what it held)."""
        stream = self._streams.get(request_id)
        if stream is None:
            return
        batches: dict = {}
        if isinstance(item, StepOutput) and item.finished:
            self._mark_ending(request_id, stream)
        if stream.direct is not None and isinstance(item, StepOutput):
            stream.held.append(item)
            _send_direct(stream, None, batches)
        else:
            stream.put(item, 0, None)
        stream.loop.call_soon_threadsafe(stream.ready.set)  # before the send: see _deliver_all
        _send_batches(batches)

    def _deliver_all(self, outputs: list[StepOutput]) -> None:
        """A step's outputs, the streams a message is due for woken with one hand-over per
        event loop. A call_soon_threadsafe per output (a wake-up of the loop each, and the loop
        thread contending for the GIL) cost the engine thread milliseconds a step at large
        batches (bench/results/host_overhead.md, "deliver")."""
        due = 1 if self.tokens_per_wake is None else self.tokens_per_wake(len(self._streams))
        by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Event]] = {}
        batches: dict = {}  # direct streams' sender -> this step's (key, message) pairs
        streams = self._streams
        for out in outputs:
            stream = streams.get(out.request_id)
            if stream is None:
                continue
            last = out.finished or out.finish_reason
            if out.finished:
                self._mark_ending(out.request_id, stream)
            if stream.direct is not None:
                # (inline, the common case of a step's output: a direct stream holds it)
                stream.held.append(out)
                stream.held_tokens += len(out.new_token_ids)
                if last or not stream._woken or stream.held_tokens >= due:
                    if _send_direct(stream, None if last else due, batches):
                        by_loop.setdefault(stream.loop, []).append(stream.ready)
            elif stream.put(out, len(out.new_token_ids), None if last else due):
                by_loop.setdefault(stream.loop, []).append(stream.ready)
        # A router that gets a request's last output can send this worker the next request at
        # once: the finished ones are in `_ending` (above) before the frames leave, and the
        # wake-ups are queued first, so a worker at its limit counts them out (Worker.generate
        # admits against num_in_flight - num_ending) and takes the request its router
        # admitted into the freed place.
        for loop, events in by_loop.items():
            loop.call_soon_threadsafe(_set_all, events)
        _send_batches(batches)

    def _fail_all(self, error: BaseException) -> None:
        """A step raised: every request ends with an error. A bug fails those requests; a
        failed tensor-parallel group (engine.check_health raises) fails the engine for good."""
        try:
            self.engine.check_health()
        except Exception as e:
            self.fatal = f"engine failed: {e}"
        for rid in list(self.engine.requests):
            self.engine.abort(rid)
            self._deliver(rid, UnavailableError(self.fatal) if self.fatal else
                          RuntimeError(f"engine step failed: {error!r}"))


DIRECT_WAKE_EVERY = 64  # a direct stream's consumer is woken at least once this many messages


def _send_direct(stream: _Stream, due: int | None, batches: dict) -> bool:
    """A direct stream's held outputs (loop thread; the caller appended the newest, and found
    due tokens held, or due None: now, or the stream not yet woken) go out merged as one
    message, into batches[sender]. True when its consumer is to be woken: the first message
    and the last."""
    item = merge_outputs(stream.held)
    stream.held, stream.held_tokens = [], 0
    sender, key = stream.direct
    batches.setdefault(sender, []).append((key, encode_output(item)))
    # the consumer takes every message sent (merged) to count them: woken for the first, the
    # last, and every DIRECT_WAKE_EVERY messages so that what it holds stays small
    stream.sent_unwoken += 1
    if not stream._woken or due is None or stream.sent_unwoken >= DIRECT_WAKE_EVERY:
        stream.sent_unwoken = 0
        return stream.put(item, 0, None)
    return stream.put(item, 0, 1 << 62)


def _send_batches(batches: dict) -> None:
    """Each direct sender's (key, message) pairs, one frame a sender."""
    for sender, batch in batches.items():
        sender.send(batch)


def settle(future: asyncio.Future, result: object, error: BaseException | None) -> None:
    """Set a loop's future from another thread's outcome (call_soon_threadsafe), unless its
    waiter has gone."""
    if future.done():  # its caller was cancelled
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _set_all(events: list[asyncio.Event]) -> None:
    for event in events:
        event.set()
