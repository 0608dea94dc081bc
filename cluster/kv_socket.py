"""The KV transfer's data plane: a pull's chunks over a plain TCP connection instead of gRPC
messages. Python gRPC copies every payload into and out of protobuf and tops out well below
what the link carries (bench/results/kv_transfer.md); a socket sends a host pool's blocks
straight from the cache (sendmsg over views of the pinned blocks) and receives them straight
into the reserved ones (recv_into), so the bytes are copied only by the kernel.

    receiver                                      holder
    Pull(socket=True) over gRPC (secret, checks)  pin; header + (port, one-time ticket)
    connect to the port, send the ticket   --->   DataPlane matches the ticket
                                           <---   frames: FRAME, payload, TRAILER (checksum)
    receive (in place when it can), verify        the gRPC stream ends once all are sent

The checksum trails its payload so that both sides can hash a host pool's chunk piece by piece
as it goes through the socket (each piece read or written moments before, still in cache),
not in a pass over the chunk of their own.

gRPC keeps the call, the secret, the layout checks and the header; the ticket (16 random
bytes, handed out on that authenticated stream, good for one connection within
TICKET_TTL_S) is what opens the socket. Workers with TLS configured do not serve sockets
(their pulls stream over gRPC, encrypted). Failures map to the transfer's reasons: a
connection closed early is "truncated", a checksum "checksum"; either side closing the socket
unblocks the other, so nothing waits past the pull's deadline.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import secrets
import socket
import struct
import threading
import time
from collections.abc import Iterator

import xxhash

from mxserve.worker.async_engine import settle
from mxserve.worker.kv_transfer import Importer, TransferError

logger = logging.getLogger(__name__)
FRAME = struct.Struct("<iiq")  # first block, number of blocks, payload bytes
TRAILER = struct.Struct("<Q")  # the payload's checksum
PIECE_BYTES = 256 << 10  # hashed, then sent or received, a piece at a time
TICKET_BYTES = 16
TICKET_TTL_S = 10.0
MAX_ADMITTING = 64  # connections waiting to send their ticket; more are closed at once
_MAX_FRAME_BYTES = 64 << 20


class DataPlane:
    """The holder's listener: accepts connections and hands each to the pull whose ticket it
    sends (an unknown or late ticket: closed)."""

    def __init__(self, host: str) -> None:
        self.sock = socket.create_server((host, 0))
        self.port = self.sock.getsockname()[1]
        self._pending: dict[bytes, tuple[float, concurrent.futures.Future]] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._admitting = 0
        threading.Thread(target=self._accept, name="kv-data-plane", daemon=True).start()

    def expect(self) -> tuple[bytes, concurrent.futures.Future]:
        """A fresh ticket and the future its connection (a socket) will be set on."""
        ticket, future = secrets.token_bytes(TICKET_BYTES), concurrent.futures.Future()
        now = time.monotonic()
        with self._lock:
            for stale in [t for t, (at, _) in self._pending.items() if now - at > TICKET_TTL_S]:
                self._pending.pop(stale)[1].cancel()
            self._pending[ticket] = (now, future)
        return ticket, future

    def forget(self, ticket: bytes) -> None:
        with self._lock:
            entry = self._pending.pop(ticket, None)
        if entry is not None:
            entry[1].cancel()

    def close(self) -> None:
        self._closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self._lock:
                full = self._admitting >= MAX_ADMITTING
                self._admitting += not full
            if full:
                conn.close()
                continue
            threading.Thread(target=self._admit, args=(conn,), daemon=True).start()

    def _admit(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(TICKET_TTL_S)
            ticket = _recv_exact(conn, TICKET_BYTES)
            with self._lock:
                entry = self._pending.pop(ticket, None)
            if entry is None or not entry[1].set_running_or_notify_cancel():
                raise TransferError("refused", "an unknown ticket")
            conn.settimeout(None)
            entry[1].set_result(conn)
        except (OSError, TransferError) as e:
            logger.warning("KV data plane: a connection refused (%s)", e)
            conn.close()
        finally:
            with self._lock:
                self._admitting -= 1


def send_frames(conn: socket.socket, frames: Iterator[tuple[int, int, list, int]],
                stop: threading.Event, delay_s: float = 0.0) -> tuple[int, int]:
    """Send Exporter.frames() over conn until they end or `stop` is set; (blocks, bytes) sent.
    Blocking (a thread of its own). delay_s: a test hook, a pause after each frame."""
    num_blocks = num_bytes = 0
    for first, n, parts, digest in frames:
        if stop.is_set():
            break
        parts = [_bytes_view(p) for p in parts]
        size = sum(len(p) for p in parts)
        if digest is not None:
            _send_all(conn, [FRAME.pack(first, n, size), *parts, TRAILER.pack(digest)])
        else:  # views of the cache: each piece hashed, then sent while it is in cache
            _send_all(conn, [FRAME.pack(first, n, size)])
            h = xxhash.xxh3_64()
            for piece in _pieces(parts):
                for part in piece:
                    h.update(part)
                _send_all(conn, piece)
            _send_all(conn, [TRAILER.pack(h.intdigest())])
        num_blocks, num_bytes = num_blocks + n, num_bytes + size
        if delay_s:
            stop.wait(delay_s)
    return num_blocks, num_bytes


def recv_frames(conn: socket.socket, importer: Importer) -> None:
    """Receive the importer's blocks (its header accepted) from conn, each chunk checked
    before it counts: in place into the reserved blocks when the importer can, else into a
    buffer handed to Importer.add. Blocking (a worker thread). TransferError on a frame out of
    order, a checksum, or the connection closing before the last block."""
    buffer = bytearray()

    def receive(views: list[memoryview]) -> tuple[int, int]:
        h = xxhash.xxh3_64()
        for piece in _pieces(views):
            _recv_into(conn, piece)
            for part in piece:
                h.update(part)
        return h.intdigest(), TRAILER.unpack(_recv_exact(conn, TRAILER.size))[0]

    try:
        while importer.num_verified < importer.num_blocks:
            first, n, size = FRAME.unpack(_recv_exact(conn, FRAME.size))
            if not 0 < size <= _MAX_FRAME_BYTES:
                raise TransferError("order", f"a frame of {size} bytes")
            if importer.in_place:
                importer.add_into(first, n, size, receive)
            else:
                if len(buffer) != size:
                    buffer = bytearray(size)
                _recv_into(conn, [memoryview(buffer)])
                digest = TRAILER.unpack(_recv_exact(conn, TRAILER.size))[0]
                importer.add(first, n, buffer, digest)
    except BaseException:
        try:  # the holder's sends fail at once instead of filling the socket
            conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        raise


def in_thread(fn, *args) -> asyncio.Future:
    """fn(*args) on a thread of its own, as a future of the running loop. The frames block for
    a whole transfer, so they stay out of the loop's default executor (a handful of threads
    that a worker's pulls and exports at once could fill, each waiting for another)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def run() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as e:
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, future, result, error)
        except RuntimeError:  # the loop is closed: no one waits for this any more
            pass

    threading.Thread(target=run, name=f"kv-{fn.__name__}", daemon=True).start()
    return future


async def close_and_join(conn: socket.socket, frames: asyncio.Future) -> None:
    """Shut conn (the thread sending or receiving frames on it returns) and wait for that
    thread (`in_thread`'s future): the blocks it reads or writes in place are not given back
    before it is done. Its error, if any, is taken here: the caller has its own reason."""
    shut(conn)
    if not frames.done():
        await asyncio.wait([frames])
    if not frames.cancelled():
        frames.exception()


def shut(conn: socket.socket) -> None:
    """End the connection both ways (a thread blocked on it returns), then close it."""
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    conn.close()


def _pieces(views: list[memoryview]) -> Iterator[list[memoryview]]:
    """The views in order, cut and grouped into pieces of about PIECE_BYTES."""
    piece, size = [], 0
    for view in views:
        parts = [view] if len(view) <= PIECE_BYTES else \
            [view[lo:lo + PIECE_BYTES] for lo in range(0, len(view), PIECE_BYTES)]
        for part in parts:
            piece.append(part)
            size += len(part)
            if size >= PIECE_BYTES:
                yield piece
                piece, size = [], 0
    if piece:
        yield piece


def _bytes_view(part) -> memoryview:
    """part as a flat view of bytes (a byte view already: itself, not another view of it)."""
    return part if type(part) is memoryview and part.format == "B" else memoryview(part).cast("B")


def _send_all(conn: socket.socket, parts: list) -> None:
    views = [v for v in map(_bytes_view, parts) if len(v)]
    while views:
        views = _drop_front(views, conn.sendmsg(views[:512]))  # (512: under IOV_MAX)


def _recv_into(conn: socket.socket, views: list[memoryview]) -> None:
    views = [v for v in views if len(v)]
    while views:
        got = conn.recvmsg_into(views[:512])[0]
        if not got:
            raise TransferError("truncated", "the holder closed the connection early")
        views = _drop_front(views, got)


def _drop_front(views: list[memoryview], n: int) -> list[memoryview]:
    """The views less their first n bytes (what a sendmsg / recvmsg_into moved)."""
    i = 0
    while i < len(views) and n >= len(views[i]):
        n -= len(views[i])
        i += 1
    rest = views[i:]
    if n:
        rest[0] = rest[0][n:]
    return rest


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(conn, [memoryview(buf)])
    return bytes(buf)
