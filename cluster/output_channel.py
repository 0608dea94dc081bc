"""Direct output streams (ServeConfig.streaming.direct): a request's outputs go from the worker
to its router over one TCP connection a (worker, router) pair, not as Ray Serve stream messages.

Why: every message of a Serve stream costs Python work in the worker's process (the replica's
event loop wakes the request's task, Serve and Ray core hand the item on), and that process's
GIL is the one the engine thread steps with; served on a GPU the worker's steps waited ~2 ms for
it (bench/results/serve_gpu.engine_loop.md). Here the engine thread itself packs each step's
due outputs (cluster/worker.py's coalescing, unchanged) into one frame a router and writes it
(a sender thread writes what the socket does not take at once): no event-loop wake-up and no
Serve message per output.

The Serve call stays, carrying what it did apart from the tokens: routing (the request router
picks the worker for the `generate` call), admission errors (raised before any output), the
request's lifetime (the router closing it aborts the request; the worker's replica dying breaks
it) and answers made without the engine (a draining worker's hand-back). The call yields
nothing else and returns once the request's last output is handed to the sender.

Wire: each frame is a 4-byte big-endian length and msgpack. The worker's first frame is the
router's token (from the request's `stream_to`, which came over Serve); the router drops a
connection that does not present it. Then each frame is a list of [key, output] pairs, output
an `encode_output`. The router names each request's key, so outputs go only to the call that
asked for them.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import select
import socket
import struct
import threading
from collections.abc import Callable

import msgpack

from mxserve.api.outputs import StepOutput, decode_output, merge_outputs

logger = logging.getLogger(__name__)

FRAME_HEADER = struct.Struct("!I")
MAX_FRAME = 256 << 20
IDLE_CHECK_S = 1.0  # an idle sender looks this often whether its router hung up


def _hung_up(sock: socket.socket) -> bool:
    """The peer closed (the router never writes, so anything readable is its end)."""
    readable, _, _ = select.select([sock], [], [], 0)
    return bool(readable)


def frame(payload: object) -> bytes:
    data = msgpack.packb(payload)
    return FRAME_HEADER.pack(len(data)) + data


class FrameReader:
    """Whole frames out of a byte stream fed piecewise (asyncio.Protocol.data_received)."""

    def __init__(self) -> None:
        self.buffer = bytearray()

    def feed(self, data: bytes) -> list:
        """The payloads of the frames now whole; raises ValueError on an oversized frame."""
        buffer = self.buffer
        buffer += data
        start, payloads = 0, []
        while len(buffer) - start >= FRAME_HEADER.size:
            (n,) = FRAME_HEADER.unpack_from(buffer, start)
            if n > MAX_FRAME:
                raise ValueError(f"frame of {n} bytes")
            if len(buffer) - start - FRAME_HEADER.size < n:
                break
            body = start + FRAME_HEADER.size
            payloads.append(msgpack.unpackb(buffer[body:body + n]))
            start = body + n
        del buffer[:start]
        return payloads


def merge_piled(first: StepOutput, inbox: asyncio.Queue) -> tuple[StepOutput, object]:
    """`first` merged with the outputs that piled up behind it in a request's inbox while its
    consumer was busy (each message costs every later hop the same work), up to its last
    output; also the first non-output item met (an error, an end), else None, for the caller
    to handle next."""
    piled = [first]
    while not piled[-1].finished and not inbox.empty():
        later = inbox.get_nowait()
        if not isinstance(later, StepOutput):
            return merge_outputs(piled), later
        piled.append(later)
    return merge_outputs(piled), None


class OutputReceiver:
    """The router's end: a listening socket on its event loop. `open(key)` before the Serve
    call gives the queue that call's outputs land in; `close(key)` after it.

    Each read off a connection hands on every whole frame it holds at once (`_Connection`):
    frames are not left waiting in the socket while the loop serves other work. A backlog
    there is latency every output behind it pays, and outputs already in a request's queue
    go on to the client merged into one message, so a router that falls behind catches up."""

    def __init__(self) -> None:
        self.token = secrets.token_hex(16)
        self.address: str | None = None  # host:port once started
        self._inboxes: dict[str, asyncio.Queue] = {}
        self._server: asyncio.Server | None = None
        self._transports: set[asyncio.Transport] = set()  # the workers' open connections
        self.num_connections = 0  # workers connected, in all
        self.num_rejected = 0  # connections dropped for a wrong token or a bad frame
        self.num_frames = 0

    async def start(self, host: str = "127.0.0.1") -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, 0)
        port = self._server.sockets[0].getsockname()[1]
        self.address = f"{host}:{port}"

    def close_server(self) -> None:
        """Stop listening and hang up on every worker (their senders see it and forget this
        router)."""
        if self._server is not None:
            self._server.close()
        for transport in list(self._transports):
            transport.close()

    def target(self, key: str) -> dict:
        """The `stream_to` a worker sends this key's outputs by."""
        return {"address": self.address, "token": self.token, "key": key}

    def open(self, key: str) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        self._inboxes[key] = queue
        return queue

    def close(self, key: str) -> None:
        self._inboxes.pop(key, None)

    def _deliver(self, items: list) -> None:
        self.num_frames += 1
        for key, data in items:
            inbox = self._inboxes.get(key)
            if inbox is not None:  # (a closed call's late outputs go nowhere)
                inbox.put_nowait(decode_output(data))


class _Connection(asyncio.Protocol):
    """One worker's connection: its token frame, then frames of [key, output] pairs."""

    def __init__(self, receiver: OutputReceiver) -> None:
        self.receiver = receiver
        self.transport: asyncio.Transport | None = None
        self.reader = FrameReader()
        self.authenticated = False

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.receiver._transports.add(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.receiver._transports.discard(self.transport)  # the worker's Serve calls say why

    def data_received(self, data: bytes) -> None:
        try:
            for payload in self.reader.feed(data):
                if self.authenticated:
                    self.receiver._deliver(payload)
                elif payload == self.receiver.token:
                    self.authenticated = True
                    self.receiver.num_connections += 1
                else:
                    self.receiver.num_rejected += 1
                    self._drop()
                    return
        except Exception as e:  # a malformed frame: drop the connection
            self.receiver.num_rejected += 1
            logger.warning("output channel: dropped a connection (%r)", e)
            self._drop()

    def _drop(self) -> None:
        self.reader.buffer.clear()
        self.transport.close()


class OutputSender:
    """The worker's end for one router: a thread (from `start()`) that connects, presents the
    token, then writes what `send` could not. `send` (called on the engine thread; it never
    blocks there) writes a frame itself when nothing waits before it and the socket takes it
    whole at once, else queues it for the thread, in order: a frame waits for no hand-over to
    another thread (which, under the GIL the engine thread holds while it steps, may take up
    to the interpreter's switch interval). When the connection fails, or the router hangs up
    (seen within IDLE_CHECK_S while idle), `on_failure(error)` is called once (on the sender's
    thread) and later sends are dropped: the worker fails the requests bound to it and forgets
    the sender."""

    def __init__(self, address: str, token: str,
                 on_failure: Callable[[Exception], None] | None = None,
                 connect_timeout_s: float = 5.0) -> None:
        self.address, self.token = address, token
        self.on_failure = on_failure
        self.connect_timeout_s = connect_timeout_s
        self.failed: Exception | None = None
        self._pending: list[bytes] = []  # for the thread to write, in order
        self._cond = threading.Condition()
        self._closing = False
        self._sock: socket.socket | None = None  # once the token is sent, until the thread ends
        self._writing = False  # the thread is writing what it took from _pending
        self.num_frames = 0
        self.num_written_by_caller = 0  # frames `send` wrote itself
        self._thread = threading.Thread(target=self._run, name=f"mxserve-out-{address}",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def send(self, items: list) -> None:
        """Write (or queue) one frame of [key, encoded output] pairs."""
        if self.failed is not None:
            return
        data = frame(items)
        with self._cond:
            self.num_frames += 1
            if self._sock is not None and not self._pending and not self._writing:
                try:
                    written = self._sock.send(data, _DONTWAIT)
                except OSError:  # full (BlockingIOError), or broken: the thread's write
                    written = 0  # then fails the channel
                if written == len(data):
                    self.num_written_by_caller += 1
                    return
                data = data[written:]
            self._pending.append(data)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify()

    def _run(self) -> None:
        sock = None
        try:
            host, port = self.address.rsplit(":", 1)
            sock = socket.create_connection((host, int(port)), timeout=self.connect_timeout_s)
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(frame(self.token))
            with self._cond:
                self._sock = sock if _DONTWAIT else None  # (no per-call non-blocking: queue)
            while True:
                with self._cond:
                    while not self._pending and not self._closing:
                        if not self._cond.wait(timeout=IDLE_CHECK_S) and _hung_up(sock):
                            raise ConnectionError("the router closed the output channel")
                    if not self._pending:  # closing, everything sent
                        return
                    batch, self._pending = self._pending, []
                    self._writing = True
                try:
                    sock.sendall(b"".join(batch))
                finally:
                    with self._cond:
                        self._writing = False
        except Exception as e:  # refused, reset, timed out
            self.failed = e
            logger.warning("output channel to %s failed: %r", self.address, e)
            if self.on_failure is not None:
                self.on_failure(e)
        finally:
            with self._cond:
                self._sock = None
            if sock is not None:
                sock.close()


_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)  # a send that never blocks (Linux, macOS)
