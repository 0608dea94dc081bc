"""The channel between target workers and a draft replica: one TCP connection a (target, draft)
pair, made once, each round one framed message each way. A Ray Serve handle call per round costs
about a millisecond (routing, the replica's event loop, pickling); a socket round trip on one
node costs tens of microseconds (bench/spec_replica.py measures both).

Frame: 8 bytes (header length, payload length, big-endian uint32), a JSON header, then the
payload. A target sends

    {"model_id", "dtype", "hidden", "rounds": [{"key", "start", "tokens", "n", "prefix"?}],
     "release": [keys]}  + the features, [rows, hidden] raw in dtype

and the replica answers {"drafts": [[ids], ...]} or {"error": message}; {"stats": true} gets
{"stats": DraftServer.stats()}.

DraftService (the replica's side) reads every connection on its own thread and drafts on one
more: rounds that arrive while a batch runs are drafted together in the next, whichever target
sent them. When no message waits it runs ahead (DraftServer.run_ahead), and a message whose
every round run-ahead prepared for is answered before its rounds are caught up on.
RemoteDrafter (the target's side) is a Drafter (worker/drafters.py): a round that
fails or misses its deadline gives no drafts (the step decodes plainly), and the replica is
left alone for `retry_after_s` before the next try: speculation degrades, outputs never change.
"""

from __future__ import annotations

import json
import logging
import queue
import socket
import statistics
import struct
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from mxserve.worker.draft_server import DraftRound, DraftServer
from mxserve.worker.eagle import kept_offsets, kept_spans

logger = logging.getLogger(__name__)

_FRAME = struct.Struct("!II")
_DTYPES = {"float32": (torch.float32, np.float32), "bfloat16": (torch.bfloat16, np.int16),
           "float16": (torch.float16, np.float16)}
MAX_HEADER = 64 << 20


def send_frame(sock: socket.socket, header: dict, payload: bytes | memoryview = b"") -> None:
    head = json.dumps(header, separators=(",", ":")).encode()
    sock.sendall(_FRAME.pack(len(head), len(payload)) + head)
    if len(payload):
        sock.sendall(payload)


def recv_frame(sock: socket.socket) -> tuple[dict, bytearray]:
    n_head, n_payload = _FRAME.unpack(_recv_exact(sock, _FRAME.size))
    if n_head > MAX_HEADER or n_payload > MAX_HEADER * 16:
        raise ConnectionError(f"frame too large: header {n_head}, payload {n_payload} bytes")
    header = json.loads(_recv_exact(sock, n_head))
    return header, _recv_exact(sock, n_payload)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise ConnectionError("the peer closed the connection")
        got += k
    return buf


def features_to_bytes(features: torch.Tensor) -> tuple[str, memoryview]:
    """(dtype name, raw bytes) of a [rows, hidden] tensor, copied to the host."""
    name = str(features.dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"features of dtype {features.dtype} cannot be sent")
    host = features.detach().contiguous().cpu()
    if host.dtype == torch.bfloat16:
        host = host.view(torch.int16)
    return name, memoryview(host.numpy()).cast("B")


def features_from_bytes(payload: bytearray, dtype: str, hidden: int) -> torch.Tensor:
    if dtype not in _DTYPES:
        raise ValueError(f"unknown features dtype {dtype!r}")
    torch_dtype, np_dtype = _DTYPES[dtype]
    array = np.frombuffer(payload, dtype=np_dtype).reshape(-1, hidden)
    tensor = torch.from_numpy(array.copy())
    return tensor.view(torch.bfloat16) if torch_dtype == torch.bfloat16 else tensor


class DraftService:
    """A DraftServer behind a listening socket (host, port 0: a free port)."""

    def __init__(self, server: DraftServer, host: str = "127.0.0.1", port: int = 0) -> None:
        self.server = server
        self._listener = socket.create_server((host, port))
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self._queue: queue.Queue = queue.Queue()
        self._closed = threading.Event()
        self.batch_sizes: list[int] = []  # target messages drafted together, a batch each
        self.busy_s = 0.0  # time spent drafting (the replica's load, for autoscaling)
        threading.Thread(target=self._accept, daemon=True, name="draft-accept").start()
        self._drafter = threading.Thread(target=self._drafting, daemon=True,
                                         name="draft-batch")
        self._drafter.start()

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        self._queue.put(None)

    def check(self) -> None:
        """Raise unless the service is listening and its drafting thread alive."""
        if self._closed.is_set() or not self._drafter.is_alive():
            raise RuntimeError("the draft service has stopped")

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name="draft-conn").start()

    def _serve(self, conn: socket.socket) -> None:
        """Read a connection's messages; each waits for its batch's answer."""
        with conn:
            while not self._closed.is_set():
                try:
                    header, payload = recv_frame(conn)
                except (ConnectionError, OSError, ValueError):
                    return
                done: queue.Queue = queue.Queue(maxsize=1)
                self._queue.put((header, payload, done))
                answer = done.get()
                try:
                    send_frame(conn, answer)
                except OSError:
                    return

    def _drafting(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch = [item]
            while True:  # everything that arrived meanwhile joins this batch
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._queue.put(None)
                    break
                batch.append(more)
            self.batch_sizes.append(len(batch))
            del self.batch_sizes[:-1000]
            t0 = time.perf_counter()
            self._draft_batch(batch)
            self.busy_s += time.perf_counter() - t0
            if self._queue.empty():  # idle: prepare the next rounds (not counted as load)
                try:
                    self.server.run_ahead(stop=lambda: not self._queue.empty())
                except Exception:
                    logger.exception("run-ahead failed")  # the next rounds draft as usual

    def _draft_batch(self, batch: list) -> None:
        """Draft every message of the batch in one DraftServer call per model id (a bad
        message gets its own error and leaves the others alone)."""
        parsed = []
        for header, payload, done in batch:
            if header.get("stats"):  # {"stats": true}: the replica's counters, nothing drafted
                done.put({"stats": self.server.stats()})
                continue
            try:
                self.server.release(list(header.get("release", ())))
                rounds = [DraftRound(r["key"], int(r["start"]), list(r["tokens"]), int(r["n"]),
                                     r.get("prefix")) for r in header.get("rounds", ())]
                feats = features_from_bytes(payload, header.get("dtype", "float32"),
                                            int(header["hidden"])) if rounds else None
                parsed.append((header.get("model_id", ""), rounds, feats, done))
            except (KeyError, TypeError, ValueError) as e:
                done.put({"error": f"bad draft request: {e!r}"})
        by_model: dict[str, list] = {}
        for item in parsed:
            by_model.setdefault(item[0], []).append(item)
        for model_id, group in by_model.items():
            for *_, done in (it for it in group if not it[1]):
                done.put({"drafts": []})  # releases only
            items = [it for it in group if it[1]]
            if not items:
                continue
            answered = set()
            for n, (_, rounds, _, done) in enumerate(items):  # run-ahead's: answered at once
                ready = self.server.prepared(rounds)
                if ready is not None:
                    done.put({"drafts": ready})
                    answered.add(n)
            try:
                drafts = self.server.draft([r for it in items for r in it[1]],
                                           torch.cat([it[2] for it in items]), model_id)
            except Exception as e:  # a bad round (shape, ids): every sender of the batch hears
                logger.exception("draft batch failed")
                for n, (*_, done) in enumerate(items):
                    if n not in answered:
                        done.put({"error": f"drafting failed: {e!r}"})
                continue
            at = 0
            for n, (_, rounds, _, done) in enumerate(items):
                if n not in answered:
                    done.put({"drafts": drafts[at:at + len(rounds)]})
                at += len(rounds)


class RemoteDrafter:
    """The target worker's side: drafts come from a draft replica over one connection.

    address: a callable giving the replica's "host:port" (asked again after each failure: a
    replica that restarted may listen elsewhere), or None when there is none. target_id:
    unique among the targets sharing the replica. timeout_s: a round's deadline."""

    needs_hidden = True
    num_lookahead_tokens = 0  # the head's KV lives in the replica

    def __init__(self, address: Callable[[], str | None], target_id: str, model_id: str,
                 block_size: int, timeout_s: float = 0.5, retry_after_s: float = 1.0) -> None:
        self.address, self.target_id, self.model_id = address, target_id, model_id
        self.block_size = block_size
        self.timeout_s, self.retry_after_s = timeout_s, retry_after_s
        self._sock: socket.socket | None = None
        self._known: set[str] = set()  # keys the replica has had a round of, this connection
        self._release: list[str] = []
        self._down_until = 0.0
        self.num_rounds = 0  # messages answered
        self.num_failures = 0  # messages that failed or timed out
        self.num_fallback_steps = 0  # steps that decoded without drafts: the replica was down
        self.round_trip_ms: list[float] = []  # the latest answered messages' (bounded)

    def propose(self, plan, hidden: torch.Tensor, num_drafts: dict) -> None:
        kept = kept_spans(plan)
        if time.monotonic() < self._down_until:
            self.num_fallback_steps += bool(kept)
            return
        if not kept:
            if self._release:  # the last requests ended: nothing else will carry these
                if self._exchange({"rounds": [], "release": self._release}, b"") is not None:
                    self._release = []
            return
        rounds, keys = [], []
        for s, n in kept:
            key = f"{self.target_id}/{s.request.request_id}"
            start = s.start_position + s.position_offset  # the replica keeps every position
            r = {"key": key, "start": start, "n": num_drafts.get(s.request, 0),
                 "tokens": s.request.all_token_ids[start:start + n + 1]}
            if key not in self._known and start:
                r["prefix"] = s.request.block_hashes[:start // self.block_size]
            rounds.append(r)
            keys.append(key)
        features = torch.cat([hidden[off:off + n] for (s, n), off
                              in zip(kept, kept_offsets(plan, kept))])
        dtype, payload = features_to_bytes(features)
        header = {"model_id": self.model_id, "dtype": dtype, "hidden": features.shape[1],
                  "rounds": rounds, "release": self._release}
        drafts = self._exchange(header, payload)
        if drafts is None:
            self.num_fallback_steps += 1
            return
        self._release = []
        self._known.update(keys)
        for (s, _), d in zip(kept, drafts):
            if s.request in num_drafts:
                s.request.draft_token_ids = [int(t) for t in d[:num_drafts[s.request]]]

    def release(self, request) -> None:
        """The request ended here: the replica forgets it with the next message."""
        key = f"{self.target_id}/{request.request_id}"
        if key in self._known:
            self._known.discard(key)
            self._release.append(key)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    @property
    def round_trip_p50_ms(self) -> float | None:
        return statistics.median(self.round_trip_ms) if self.round_trip_ms else None

    def _exchange(self, header: dict, payload) -> list[list[int]] | None:
        t0 = time.perf_counter()
        try:
            sock = self._connect()
            sock.settimeout(self.timeout_s)
            send_frame(sock, header, payload)
            answer, _ = recv_frame(sock)
            if "error" in answer:
                raise ConnectionError(answer["error"])
            drafts = answer["drafts"]
            if len(drafts) != len(header["rounds"]):
                raise ConnectionError("the replica answered another number of rounds")
        except (OSError, ConnectionError, ValueError, KeyError) as e:
            self._fail(e)
            return None
        self.num_rounds += 1
        self.round_trip_ms.append((time.perf_counter() - t0) * 1e3)
        del self.round_trip_ms[:-1000]
        return drafts

    def _connect(self) -> socket.socket:
        if self._sock is None:
            address = self.address()
            if not address:
                raise ConnectionError("no draft replica")
            host, port = address.rsplit(":", 1)
            self._sock = socket.create_connection((host, int(port)), timeout=self.timeout_s)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._known.clear()  # a new connection may be a new replica: send prefixes again
        return self._sock

    def _fail(self, error: Exception) -> None:
        """Drop the connection (a late answer must not be read as the next one's) and leave
        the replica alone for retry_after_s."""
        self.num_failures += 1
        if self.num_failures == 1 or self.num_failures % 100 == 0:
            logger.warning("draft replica unavailable (%r): decoding without speculation, "
                           "retrying every %.1f s", error, self.retry_after_s)
        self.close()
        self._known.clear()
        self._release = []
        self._down_until = time.monotonic() + self.retry_after_s
