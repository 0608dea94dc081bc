"""Request intake (ServeConfig.streaming.intake): requests go from each router to the worker it
chooses over one TCP connection a (router, worker) pair, not as one Ray Serve call each.

Why: a Serve call costs ~1.8 ms of Python in the worker's process (Ray's task thread takes the
call, Serve's replica wraps it and hops it onto the replica's loop), and that process's GIL is
the one the engine thread steps with: on the GPU the served mix lost ~11% of the engine's
speed to it (bench/results/serve_gpu.gil_bound.md). Here a request costs the worker one frame
read on its event loop and one task running `Worker.generate`, as a Serve call's would.

What the Serve call carried moves here, on the router's side (`IntakeWorkers`, a
`router.ingress.Workers`):
- routing: the router scores the workers itself with router/routing.py's `PrefixRouter` (the
  policy Serve's request router wraps), from the load reports and metadata it polls every
  replica for (`directory`, cluster/handles.py's `ReplicaDirectory` in the cluster);
- admission errors, a draining worker's hand-back, a failed stream: the worker writes them
  back on the same connection, with an "end" frame once the request's last output is handed
  to the output channel;
- the request's lifetime: the router closing a stream sends "abort" (the worker cancels the
  request's task, which aborts it in the engine and frees its blocks); the router hanging up
  aborts everything it sent; the worker's process dying breaks the connection, and every
  request on it fails with WorkerLostError, for router/ingress.py to move on as before.
The engine's outputs still go over the router's output channel (cluster/output_channel.py).

Wire: each frame is a 4-byte big-endian length and msgpack, as on the output channel. The
router's first frame is the worker's token (from the worker's replica metadata, read over
Ray); the worker drops a connection that does not present it. Router -> worker: ["g", key,
prompt ids, SamplingParams' fields by name, request id, kv_source, `resume_fields` or None,
stream_to] (`_request_frame`: plain msgpack, no pickle on the socket) or ["a", key]. A request
whose fields do not make a SamplingParams (or ResumeState) is answered with an error for its
key alone; a frame of another shape drops the connection. Worker -> router:
[key, "error", code, message, field, retry_after_s], [key, "out", encode_output bytes] (an
answer made without the engine: a hand-back) or [key, "end"].
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import msgpack

from mxserve.api.block_hash import block_hashes
from mxserve.api.errors import (
    INTERNAL,
    INVALID_ARGUMENT,
    RESOURCE_EXHAUSTED,
    InvalidRequestError,
    ServeError,
    WorkerLostError,
)
from mxserve.api.outputs import (
    ResumeState,
    StepOutput,
    decode_output,
    encode_output,
    resume_fields,
)
from mxserve.api.sampling_params import SamplingParams
from mxserve.cluster.output_channel import (
    FRAME_HEADER,
    MAX_FRAME,
    FrameReader,
    OutputReceiver,
    frame,
    merge_piled,
)
from mxserve.router.routing import PrefixRouter, ReplicaLoad

logger = logging.getLogger(__name__)

END_TAIL_S = 30.0  # after the worker's "end", the longest the last output may take to come
LOST_HOLD_S = 60.0  # a worker whose connection broke stays out of routing this long, unless
# the directory stops listing it first (Serve replaced it)


# --------------------------------------------------------------------------- worker side

class IntakeServer:
    """The worker's end: a listening socket on the replica's event loop. Each request a router
    sends runs as a task over `worker.generate` with its outputs on the router's output
    channel."""

    def __init__(self, worker) -> None:
        self.worker = worker  # cluster/worker.Worker
        self.token = secrets.token_hex(16)
        self.address: str | None = None
        self._server: asyncio.Server | None = None
        self._connections: set[_IntakeConnection] = set()
        self.num_requests = 0
        self.num_rejected = 0  # connections dropped for a wrong token or a bad frame

    async def start(self, host: str = "127.0.0.1") -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _IntakeConnection(self), host, 0)
        self.address = f"{host}:{self._server.sockets[0].getsockname()[1]}"

    def target(self) -> dict:
        """What a router needs to connect (the worker's replica metadata carries it)."""
        return {"address": self.address, "token": self.token}

    def close(self) -> None:
        """Stop listening and hang up on every router: the requests still here are aborted,
        and their routers move them on (WorkerLostError)."""
        if self._server is not None:
            self._server.close()
        for connection in list(self._connections):
            connection.hang_up()


class _IntakeConnection(asyncio.Protocol):
    def __init__(self, server: IntakeServer) -> None:
        self.server = server
        self.reader = FrameReader()
        self.transport: asyncio.Transport | None = None
        self.authenticated = False
        self.tasks: dict[str, asyncio.Task] = {}  # key -> the request's task

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server._connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        """The router is gone (or hung up): what it sent here is aborted."""
        self.server._connections.discard(self)
        for task in list(self.tasks.values()):
            task.cancel()

    def hang_up(self) -> None:
        self.transport.close()
        self.connection_lost(None)

    def data_received(self, data: bytes) -> None:
        try:
            payloads = self.reader.feed(data)
        except Exception as e:
            return self._reject(e)
        for payload in payloads:
            if not self.authenticated:
                if payload != self.server.token:
                    return self._reject(ValueError("a wrong token"))
                self.authenticated = True
                continue
            try:
                if payload[0] == "g":
                    self._start(*payload[1:])
                elif payload[0] == "a":
                    task = self.tasks.get(payload[1])
                    if task is not None:
                        task.cancel()
                else:
                    raise ValueError(f"unknown command {payload[0]!r}")
            except Exception as e:
                return self._reject(e)

    def _reject(self, error: Exception) -> None:
        self.server.num_rejected += 1
        logger.warning("request intake: dropped a connection (%r)", error)
        self.hang_up()

    def _start(self, key: str, prompt: list[int], params: dict, request_id: str,
               kv_source: dict | None, resume: list | None, stream_to: dict) -> None:
        try:
            hints = dict(kv_source=kv_source,
                         resume=None if resume is None else ResumeState(*resume))
            params = SamplingParams(**params)
        except InvalidRequestError as e:
            return self._write([key, "error", INVALID_ARGUMENT, str(e), e.field, None])
        except TypeError as e:  # a field unknown here or missing (a router of another version)
            return self._write([key, "error", INTERNAL, f"worker: a request it cannot read "
                                f"({e})", None, None])
        self.server.num_requests += 1
        task = asyncio.get_running_loop().create_task(
            self._serve(key, prompt, params, request_id, hints, stream_to))
        self.tasks[key] = task
        task.add_done_callback(lambda _t: self.tasks.pop(key, None))

    async def _serve(self, key: str, prompt: list[int], params: SamplingParams,
                     request_id: str, hints: dict, stream_to: dict) -> None:
        try:
            async for out in self.server.worker.generate(prompt, params, request_id,
                                                         stream_to=stream_to, **hints):
                self._write([key, "out", encode_output(out)])  # a hand-back
            self._write([key, "end"])
        except asyncio.CancelledError:  # aborted (closing generate freed its blocks)
            pass
        except ServeError as e:
            self._write([key, "error", e.code, e.message, e.field, e.retry_after_s])
        except Exception as e:
            logger.exception("request %s failed on the worker", request_id)
            self._write([key, "error", INTERNAL, f"worker: {e!r}", None, None])

    def _write(self, payload: list) -> None:
        if not self.transport.is_closing():
            self.transport.write(frame(payload))


# --------------------------------------------------------------------------- router side

# The replicas as the directory lists them: {"worker_id", "meta" (record_replica_metadata:
# model_id, block_size, kv_address, intake), "load" (Worker.load())}.
Directory = Callable[[], Awaitable[list[dict]]]


class _Link:
    """The router's connection to one worker: requests out, the worker's answers in."""

    def __init__(self, worker_id: str, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.worker_id = worker_id
        self.reader, self.writer = reader, writer
        self.inboxes: dict[str, asyncio.Queue] = {}  # key -> the request's queue
        self.broken: Exception | None = None
        self.on_broken: Callable[[_Link], None] = lambda link: None
        self._task = asyncio.get_running_loop().create_task(self._read())

    def send(self, payload: list) -> None:
        if self.broken is None:
            self.writer.write(frame(payload))

    async def _read(self) -> None:
        try:
            while True:
                (n,) = FRAME_HEADER.unpack(await self.reader.readexactly(FRAME_HEADER.size))
                if n > MAX_FRAME:
                    raise ValueError(f"frame of {n} bytes")
                item = msgpack.unpackb(await self.reader.readexactly(n))
                inbox = self.inboxes.get(item[0])
                if inbox is None:
                    continue  # (a closed stream's late answer)
                kind = item[1]
                if kind == "out":
                    inbox.put_nowait(decode_output(item[2]))
                elif kind == "error":
                    inbox.put_nowait(ServeError(item[2], item[3], item[4], item[5]))
                else:
                    inbox.put_nowait(_END)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # EOF (the worker's process is gone, or it hung up), reset
            self.broken = e
        self.writer.close()
        self.on_broken(self)
        lost = WorkerLostError(f"its worker {self.worker_id} is gone (its intake connection "
                               f"ended: {self.broken!r})", self.worker_id)
        for inbox in self.inboxes.values():
            inbox.put_nowait(lost)

    def fail(self, error: Exception) -> None:
        """Its worker is gone by another account (the directory no longer lists it): every
        request on it fails with `error`, and it takes no more."""
        if self.broken is None:
            self.broken = error
            for inbox in self.inboxes.values():
                inbox.put_nowait(error)
        self.close()

    def close(self) -> None:
        self._task.cancel()
        self.writer.close()


_END = object()


class _Refused(Exception):
    """A worker answered a request first with RESOURCE_EXHAUSTED (it is full)."""

    def __init__(self, error: ServeError) -> None:
        super().__init__(error.message)
        self.error = error


class IntakeWorkers:
    """`router.ingress.Workers` over request intake: this router routes each request itself and
    writes it to the chosen worker; the outputs come over `receiver`."""

    def __init__(self, receiver: OutputReceiver, directory: Directory, policy: PrefixRouter,
                 period_s: float = 0.5, on_routed: Callable[[int], None] | None = None) -> None:
        self.receiver, self.directory, self.policy = receiver, directory, policy
        self.on_routed = on_routed or (lambda cached_tokens: None)  # metrics
        self.period_s = period_s
        self.replicas: dict[str, dict] = {}  # worker id -> its directory entry
        self._first_listing: asyncio.Task | None = None
        self._polling: asyncio.Task | None = None
        self._links: dict[str, _Link] = {}
        self._connecting: dict[str, asyncio.Task] = {}
        self._lost: dict[str, float] = {}  # worker id -> when its connection broke
        self.num_routed = 0
        self.num_refused = 0  # requests a worker refused as full (each then tried on the next)

    async def loads(self) -> list[dict]:
        """The workers' reports, asked for now (a replica that does not answer within the
        directory's timeout keeps its last one)."""
        return [e["load"] for e in await self.refresh()]

    async def refresh(self) -> list[dict]:
        entries = await self.directory()
        self.replicas = {e["worker_id"]: e for e in entries}
        for worker_id in [w for w in self._links if w not in self.replicas]:
            # Serve stopped it or found it dead: a silent process may keep its socket open
            self._links.pop(worker_id).fail(WorkerLostError(
                f"its worker {worker_id} left the replica set", worker_id))
        self._lost = {w: t for w, t in self._lost.items() if w in self.replicas}
        return entries

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            try:
                await self.refresh()
            except Exception as e:  # (the GCS or a replica briefly unreachable)
                logger.warning("listing the worker replicas failed: %r", e)

    async def _current(self) -> dict[str, dict]:
        """The replicas as last listed: listed every period_s in the background from the
        first call on, which waits for the first listing (until it names one)."""
        if self._polling is None:
            self._polling = asyncio.create_task(self._poll())
        while not self.replicas:
            if self._first_listing is None or self._first_listing.done():
                self._first_listing = asyncio.create_task(self.refresh())
            await asyncio.shield(self._first_listing)
            if not self.replicas:
                await asyncio.sleep(self.period_s)
        return self.replicas

    async def _choose(self, prompt: list[int], hints: dict) -> tuple[list[str], dict]:
        """The workers for this prompt, the preferred first (the rest in the order to try when
        one refuses: `generate`), and the prompt tokens each holds."""
        replicas = await self._current()
        resume = hints.get("resume")
        left = resume.worker_id if resume is not None else None
        now = time.monotonic()
        if resume is not None and resume.worker_lost and left:
            self._lost[left] = now
        lost = {w for w, t in self._lost.items() if now - t < LOST_HOLD_S}
        candidates = [e for w, e in replicas.items() if w != left and w not in lost
                      and not e["load"].get("draining")] or list(replicas.values())
        loads = [_replica_load(e) for e in candidates]
        meta = candidates[0]["meta"]
        hashes = block_hashes(prompt, meta["block_size"], meta["model_id"])
        decision = await self.policy.route(loads, hashes, meta["block_size"], len(prompt))
        self.on_routed(decision.cached_tokens)
        held = decision.held_tokens
        if "kv_source" not in hints and held:
            holder = max(held, key=held.get)
            address = replicas.get(holder, {}).get("meta", {}).get("kv_address")
            if address:
                hints["kv_source"] = {"address": address,
                                      "num_blocks": held[holder] // meta["block_size"]}
        return decision.order, held

    async def _link(self, worker_id: str, entry: dict) -> _Link:
        link = self._links.get(worker_id)
        if link is not None and link.broken is None:
            return link
        connecting = self._connecting.get(worker_id)
        if connecting is None:  # one connection a worker, however many requests wait for it
            connecting = asyncio.create_task(self._connect(worker_id, entry["meta"]))
            self._connecting[worker_id] = connecting
            connecting.add_done_callback(lambda _t: self._connecting.pop(worker_id, None))
        return await asyncio.shield(connecting)

    async def _connect(self, worker_id: str, target: dict) -> _Link:
        host, port = target["address"].rsplit(":", 1)
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)),
                                                    5.0)
        except (OSError, TimeoutError) as e:
            self._lost[worker_id] = time.monotonic()
            raise WorkerLostError(f"its worker {worker_id} does not answer on its intake "
                                  f"({e!r})", worker_id) from None
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        writer.write(frame(target["token"]))
        link = _Link(worker_id, reader, writer)
        link.on_broken = self._broken
        self._links[worker_id] = link
        return link

    def _broken(self, link: _Link) -> None:
        self._lost[link.worker_id] = time.monotonic()
        if self._links.get(link.worker_id) is link:
            del self._links[link.worker_id]
        self.policy.dispatched.drop_replica(link.worker_id)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str, **hints) -> AsyncIterator[StepOutput]:
        """The chosen worker's outputs for this request. A worker that refuses it as full
        (RESOURCE_EXHAUSTED: its load report was behind, or the routers' shares of the
        capacity add up to more than it holds) passes it to the next in the policy's order,
        each worker once. Raises what the worker raised (ServeError: the last refusal when
        every one refused), or WorkerLostError when its connection breaks first."""
        order, held = await self._choose(prompt_token_ids, hints)
        refusal: ServeError | None = None
        for worker_id in order:
            entry = self.replicas.get(worker_id)
            if entry is None:  # (left the listing while routing)
                continue
            uncached = max(0, len(prompt_token_ids) - held.get(worker_id, 0))
            attempt = self._attempt(worker_id, entry, prompt_token_ids, params, request_id,
                                    hints, uncached)
            try:  # (closed with this stream, not when collected: the abort goes out at once)
                async with contextlib.aclosing(attempt) as outs:
                    async for out in outs:
                        yield out
                return
            except _Refused as e:
                refusal = e.error
        if refusal is None:
            raise WorkerLostError("no worker is listed")
        raise refusal

    async def _attempt(self, worker_id: str, entry: dict, prompt_token_ids: list[int],
                       params: SamplingParams, request_id: str, hints: dict,
                       uncached: int) -> AsyncIterator[StepOutput]:
        """The request on one worker; raises _Refused when the worker answers first that it
        is full."""
        key = uuid.uuid4().hex
        # recorded at once: the next choice counts it, however soon
        self.policy.dispatched.add(key, worker_id, uncached)
        try:
            link = await self._link(worker_id, entry)
        except BaseException:
            self.policy.dispatched.done(key)
            raise
        inbox = self.receiver.open(key)
        link.inboxes[key] = inbox
        self.num_routed += 1
        link.send(_request_frame(key, prompt_token_ids, params, request_id, hints,
                                 self.receiver.target(key)))
        finished, ended, first = False, False, True
        held = None  # taken from the inbox while merging, handled next
        try:
            while True:
                if held is not None:
                    item, held = held, None
                elif ended:  # the last output was handed on before "end": it comes
                    try:
                        item = await asyncio.wait_for(inbox.get(), END_TAIL_S)
                    except TimeoutError:
                        raise WorkerLostError(f"its outputs stopped coming over the output "
                                              f"channel ({END_TAIL_S:g} s)", worker_id) from None
                else:
                    item = await inbox.get()
                if item is _END:
                    ended = True
                    continue
                if isinstance(item, BaseException):
                    if (first and isinstance(item, ServeError)
                            and item.code == RESOURCE_EXHAUSTED):
                        finished = True  # (refused: nothing to abort there)
                        self.num_refused += 1
                        raise _Refused(item)
                    raise item
                item, held = merge_piled(item, inbox)
                finished, first = item.finished, False
                yield item
                if finished:
                    return
        finally:
            self.receiver.close(key)
            link.inboxes.pop(key, None)
            self.policy.dispatched.done(key)
            if not finished:  # closed early: abort there
                link.send(["a", key])

    def close(self) -> None:
        if self._polling is not None:
            self._polling.cancel()
        for link in self._links.values():
            link.close()
        self._links.clear()


def _request_frame(key: str, prompt: list[int], params: SamplingParams, request_id: str,
                   hints: dict, stream_to: dict) -> list:
    resume = hints.get("resume")
    params = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    return ["g", key, prompt, params, request_id, hints.get("kv_source"),
            None if resume is None else resume_fields(resume), stream_to]


def _replica_load(entry: dict) -> ReplicaLoad:
    load = entry["load"]
    used, free = load.get("num_kv_blocks_used", 0), load.get("num_kv_blocks_free", 0)
    return ReplicaLoad(entry["worker_id"], load.get("num_running", 0) + load.get("num_waiting", 0),
                       used / (used + free) if used + free else 0.0,
                       load.get("num_prefill_tokens_pending", 0), load.get("reported_at"))


