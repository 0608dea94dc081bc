"""KV blocks over gRPC between worker replicas: the `KVTransfer` service each worker serves
(proto/kv_transfer.proto) and the prefix pull that calls it. The transfer's logic (pinning,
chunks, checks, import) is worker/kv_transfer.py; this is its gRPC wiring, the security
checks at the door, and the counters.

    router: the chosen worker is not the one holding the prompt's longest cached prefix
            -> generate(..., kv_source={"address", "num_blocks"})
    worker: KVPuller.maybe_pull: pull if the cost model says it is faster than computing
            -> Pull(hashes) on the holder's KVTransferService -> import -> the request then
               finds those blocks as prefix hits; any failure: it computes them

Only the cluster's workers may call a worker's port: every call carries the app's shared
secret (metadata "x-mxserve-kv-secret"), compared in constant time, over TLS when
certificates are configured. Requests are capped (blocks per pull, message sizes).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc

from mxserve.cluster.kv_drain import SECRET_KEY, channel_to, read_file
from mxserve.cluster.kv_socket import (
    TICKET_TTL_S,
    DataPlane,
    close_and_join,
    in_thread,
    recv_frames,
    send_frames,
)
from mxserve.proto import kv_transfer_pb2 as pb
from mxserve.proto import kv_transfer_pb2_grpc as pb_grpc
from mxserve.worker.async_engine import AsyncEngine
from mxserve.worker.kv_transfer import (
    ENCODINGS,
    BlockIO,
    Exporter,
    Importer,
    KVLayout,
    KVPort,
    PullPolicy,
    TransferError,
    checksum_kind,
    encodable,
    engine_block_io,
    leading_verified,
    split,
    wire_bytes_per_block,
)

logger = logging.getLogger(__name__)
_HASH_BYTES = 16
_MAX_MESSAGE = 64 << 20
PEER_RETRY_S = 10.0  # a peer a pull from failed (gone, too slow) is left alone this long


@dataclass(frozen=True)
class TransferOptions:
    """cluster/config.KVTransfer's fields as the replica uses them."""

    secret: str
    chunk_bytes: int = 2 << 20
    max_blocks: int = 8192  # blocks one pull may ask for
    min_pull_blocks: int = 2
    timeout_s: float = 30.0  # the longest a pull may take, whatever the estimate
    probe_bytes: int = 4 << 20  # a link's first measurement
    num_streams: int | None = None  # parallel streams of one pull (over consecutive block
    # ranges); None: default_num_streams()
    tls_cert: str | None = None  # PEM files: this worker's certificate and key, and the CA
    tls_key: str | None = None  # that signed every worker's (then mutual TLS)
    tls_ca: str | None = None
    encoding: str = "raw"  # what this worker's pulls ask for (worker/kv_transfer.ENCODINGS)
    checksum: str = "auto"  # what its exports send (worker/kv_transfer.checksum_kind)
    data_plane: str = "socket"  # how its pulls ask for the chunks: "socket" or "grpc"


def default_num_streams() -> int:
    """One stream a pull for every 4 cores this process may run on, 1 to 4."""
    return max(1, min(4, len(os.sched_getaffinity(0)) // 4))


def layout_to_pb(layout: KVLayout) -> pb.KVLayout:
    return pb.KVLayout(version=layout.version, model_id=layout.model_id, dtype=layout.dtype,
                       block_size=layout.block_size, num_layers=layout.num_layers,
                       num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim)


def layout_from_pb(msg: pb.KVLayout) -> KVLayout:
    return KVLayout(msg.model_id, msg.dtype, msg.block_size, msg.num_layers, msg.num_kv_heads,
                    msg.head_dim, msg.version)


class KVTransferService(pb_grpc.KVTransferServicer):
    """Serves this worker's cached blocks to its peers."""

    def __init__(self, engine: AsyncEngine, port: KVPort, io: BlockIO, layout: KVLayout,
                 options: TransferOptions) -> None:
        self.engine, self.port, self.io, self.layout = engine, port, io, layout
        self.options = options
        self.faults: dict = {}  # test hook (Exporter's), set through the deployment
        self.counts: Counter = Counter()  # pulls served by outcome; blocks and bytes sent
        self.on_drain: Callable[[], Awaitable[int]] | None = None  # Worker.drain
        self.num_active = 0  # pulls being served now
        self.last_active = time.monotonic()  # when the last one ended
        self.data_plane: DataPlane | None = None  # sockets for the chunks (none under TLS)

    async def _check_secret(self, context) -> None:
        secret = dict(context.invocation_metadata()).get(SECRET_KEY, "")
        if not hmac.compare_digest(secret.encode(), self.options.secret.encode()):
            self.counts["refused"] += 1
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                f"metadata {SECRET_KEY}: missing or wrong")

    async def _check(self, request: pb.PullRequest, context) -> list[int]:
        """The caller's secret, layout and hashes; aborts the call with the status naming
        what is wrong."""
        await self._check_secret(context)
        name = self.layout.mismatch(layout_from_pb(request.layout))
        if name is not None:
            self.counts["refused"] += 1
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"layout.{name}: {getattr(request.layout, name)!r} differs "
                                f"from this worker's {getattr(self.layout, name)!r}")
        if len(request.block_hashes) > self.options.max_blocks:
            self.counts["refused"] += 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"block_hashes: {len(request.block_hashes)} asked, at most "
                                f"{self.options.max_blocks} a pull")
        if not request.block_hashes or any(len(h) != _HASH_BYTES for h in request.block_hashes):
            self.counts["refused"] += 1
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"block_hashes: need one or more of {_HASH_BYTES} bytes each")
        encoding = request.encoding or "raw"
        if not encodable(self.layout, encoding):
            self.counts["refused"] += 1
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"encoding: {request.encoding!r} is not one of "
                                f"{sorted(ENCODINGS)} this worker's blocks can take")
        return [int.from_bytes(h, "big") for h in request.block_hashes]

    async def Pull(self, request: pb.PullRequest, context) -> AsyncIterator[pb.KVMessage]:  # noqa: N802
        hashes = await self._check(request, context)
        encoding = request.encoding or "raw"
        pinned = await self.engine.call(lambda engine: self.port.pin(hashes),
                                        self.port.release)
        self.num_active += 1
        ticket = future = None
        try:
            num_blocks = len(pinned.block_ids) if pinned else 0
            kind = checksum_kind(self.io.device, encoding, self.options.checksum)
            if request.socket and self.data_plane is not None and pinned is not None:
                ticket, future = self.data_plane.expect()
            yield pb.KVMessage(header=pb.KVHeader(
                layout=layout_to_pb(self.layout), num_blocks=num_blocks,
                bytes_per_block=wire_bytes_per_block(self.layout, encoding), encoding=encoding,
                checksum=kind, socket_port=self.data_plane.port if ticket else 0,
                ticket=ticket or b""))
            if pinned is None:
                return
            exporter = Exporter(self.io, self.layout, pinned, self.options.chunk_bytes,
                                self.faults, encoding, kind)
            if ticket is not None:
                await self._send_over_socket(future, exporter)
                return
            chunks = exporter.chunks()
            while (chunk := await asyncio.to_thread(next, chunks, None)) is not None:
                if self.faults.get("delay_s"):
                    await asyncio.sleep(self.faults["delay_s"])
                first, n, payload, digest = chunk
                self.counts["blocks"] += n
                self.counts["bytes"] += len(payload)
                yield pb.KVMessage(data=pb.KVData(first_block=first, num_blocks=n,
                                                  payload=payload, checksum=digest))
            self.counts["served"] += 1
        finally:
            self.num_active -= 1
            self.last_active = time.monotonic()
            if ticket is not None:
                self.data_plane.forget(ticket)
            if pinned is not None:  # not awaited: the call may be ending by cancellation
                self.engine.submit(lambda engine: self.port.release(pinned))

    async def _send_over_socket(self, future, exporter: Exporter) -> None:
        """The chunks as frames on the connection that brings the ticket. The frames read the
        pinned blocks in place, so the sending thread is waited for (its socket shut first
        when the call ends early) before the caller releases them."""
        try:
            conn = await asyncio.wait_for(asyncio.wrap_future(future), TICKET_TTL_S)
        except TimeoutError:
            self.counts["socket_unclaimed"] += 1
            return
        stop = threading.Event()
        sender = in_thread(send_frames, conn, exporter.frames(), stop,
                           self.faults.get("delay_s", 0.0))
        try:
            num_blocks, num_bytes = await asyncio.shield(sender)  # (waited for below)
            self.counts["blocks"] += num_blocks
            self.counts["bytes"] += num_bytes
            self.counts["served"] += 1
            self.counts["served_by_socket"] += 1
        except OSError:  # the receiver went away (or refused a chunk): its pull has failed
            self.counts["socket_failed"] += 1
        finally:
            stop.set()
            await close_and_join(conn, sender)

    async def Drain(self, request: pb.DrainRequest, context) -> pb.DrainReply:  # noqa: N802
        await self._check_secret(context)
        if self.on_drain is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this worker cannot drain")
        return pb.DrainReply(num_requests=await self.on_drain())

    async def Probe(self, request: pb.ProbeRequest, context) -> AsyncIterator[pb.KVMessage]:  # noqa: N802
        await self._check_secret(context)
        if not 0 < request.num_bytes <= _MAX_MESSAGE or not 0 < request.chunk_bytes <= 8 << 20:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"num_bytes (1..{_MAX_MESSAGE}) or chunk_bytes (1..8 MiB)")
        filler = bytes(request.chunk_bytes)
        for start in range(0, request.num_bytes, request.chunk_bytes):
            n = min(request.chunk_bytes, request.num_bytes - start)
            yield pb.KVMessage(data=pb.KVData(payload=filler[:n]))


async def start_server(service: KVTransferService, host: str, port: int = 0
                       ) -> tuple[grpc.aio.Server, str]:
    """Serve `service` on host:port (0: a free port); returns the server and its address."""
    server = grpc.aio.server(options=[("grpc.max_send_message_length", _MAX_MESSAGE),
                                      ("grpc.max_receive_message_length", 1 << 20)])
    pb_grpc.add_KVTransferServicer_to_server(service, server)
    o = service.options
    if o.tls_cert:
        credentials = grpc.ssl_server_credentials(
            [(read_file(o.tls_key), read_file(o.tls_cert))], root_certificates=read_file(o.tls_ca),
            require_client_auth=o.tls_ca is not None)
        bound = server.add_secure_port(f"{host}:{port}", credentials)
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    return server, f"{host}:{bound}"


class KVPuller:
    """A worker's prefix pulls from its peers: decide by the cost model, fetch, verify,
    import. A pull that fails for any reason leaves the request to compute what is missing."""

    def __init__(self, engine: AsyncEngine, port: KVPort, io: BlockIO, layout: KVLayout,
                 policy: PullPolicy, options: TransferOptions, own_address: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.engine, self.port, self.io, self.layout = engine, port, io, layout
        self.policy, self.options, self.own_address = policy, options, own_address
        self.clock = clock
        self.counts: Counter = Counter()  # pulls by outcome ("ok", a TransferError's reason,
        # "skipped" by the cost model); "blocks" and "bytes" imported
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._inflight: dict[int, asyncio.Future] = {}  # last hash asked -> that pull
        # peers that failed (gone, or too slow): left alone until then, so a stale hint costs
        # no request a connection attempt
        self._down_until: dict[str, float] = {}

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = channel_to(address, dataclasses.asdict(self.options),
                                 **{"grpc.max_receive_message_length": _MAX_MESSAGE})
            self._channels[address] = channel
        return channel

    @property
    def _metadata(self) -> tuple:
        return ((SECRET_KEY, self.options.secret),)

    async def maybe_pull(self, block_hashes: list[int], num_tokens: int,
                         source: dict) -> int:
        """Pull from source["address"] what it holds of the first source["num_blocks"] of a
        prompt's blocks that this cache lacks, when that beats computing them. Returns the
        blocks imported (0 when skipped or failed: the request computes them)."""
        address = source.get("address")
        usable = (num_tokens - 1) // self.layout.block_size  # a full hit keeps one block back
        want = block_hashes[:min(int(source.get("num_blocks", 0)), usable)]
        if not address or address == self.own_address or not want:
            return 0
        num_missing = len(want) - len(self.port.kv.lookup_prefix(want))
        if num_missing < self.policy.min_blocks:
            return 0
        if self._down_until.get(address, 0.0) > self.clock():
            self.counts["peer_down"] += 1
            return 0
        if address not in self.policy.links and not await self._probe(address):
            return 0
        if not self.policy.should_pull(address, num_missing, self.layout):
            self.counts["skipped"] += 1
            return 0
        key = want[-1]
        if key in self._inflight:  # the same prefix is being pulled for another request
            return await asyncio.shield(self._inflight[key])
        future = asyncio.get_running_loop().create_future()
        self._inflight[key] = future
        try:
            got = await self._pull(address, want, num_missing)
            future.set_result(got)
            return got
        except BaseException:
            future.set_result(0)
            raise
        finally:
            del self._inflight[key]

    async def _probe(self, address: str) -> bool:
        """Time a filler stream from the peer: its link's first measurement."""
        start = self.clock()
        try:
            stream = pb_grpc.KVTransferStub(self._channel(address)).Probe(
                pb.ProbeRequest(num_bytes=self.options.probe_bytes, chunk_bytes=1 << 20),
                metadata=self._metadata, timeout=2.0)
            num_bytes = sum([len(m.data.payload) async for m in stream])
        except grpc.aio.AioRpcError as e:
            self._failed(address, TransferError("peer", f"probe failed: {e.code().name} "
                                                        f"{e.details()}"))
            return False
        self.policy.observe_link(address, num_bytes, self.clock() - start)
        return True

    async def _pull(self, address: str, want: list[int], num_missing: int) -> int:
        reservation = await self.engine.call(lambda e: self.port.reserve(want, num_missing),
                                             self.port.release)
        if reservation is None:
            self.counts["no_blocks"] += 1
            return 0
        num_blocks = len(reservation.block_ids)
        # several streams over one channel, over consecutive block ranges: one range is
        # gathered or scattered while another is on the wire
        encoding = self.options.encoding
        blocks_per_chunk = max(1, self.options.chunk_bytes
                               // wire_bytes_per_block(self.layout, encoding))
        streams = split(self.io, self.layout, reservation,
                        min(self.options.num_streams or default_num_streams(),
                            -(-num_blocks // blocks_per_chunk)),
                        encoding)
        pull_s, _ = self.policy.estimate(address, num_blocks, self.layout)
        timeout = min(self.options.timeout_s, max(1.0, 4 * pull_s))
        start, failed = self.clock(), False
        try:
            async with asyncio.timeout(timeout), asyncio.TaskGroup() as group:
                for importer in streams:
                    group.create_task(self._stream(address, reservation, importer))
        except* (TransferError, grpc.aio.AioRpcError, TimeoutError) as errors:
            failed = True
            self._failed(address, _as_transfer_error(errors.exceptions[0]))
        finally:  # keep what was verified, release the rest (also when cancelled)
            streams[0].gate.close()
            num_verified = leading_verified(streams)
            self.engine.submit(lambda e: self.port.commit(reservation, num_verified))
        num_bytes = sum(importer.num_bytes for importer in streams)
        if not failed and num_verified:
            self.counts["ok"] += 1
            self.policy.observe_link(address, num_bytes, self.clock() - start)
        self.counts["blocks"] += num_verified
        self.counts["bytes"] += num_bytes
        return num_verified

    async def _stream(self, address: str, reservation, importer: Importer) -> None:
        lo = reservation.num_local + importer.lo
        hashes = [h.to_bytes(_HASH_BYTES, "big") for h in
                  reservation.block_hashes[lo:lo + importer.size]]
        stream = pb_grpc.KVTransferStub(self._channel(address)).Pull(
            pb.PullRequest(layout=layout_to_pb(self.layout), block_hashes=hashes,
                           encoding=importer.encoding,
                           socket=self.options.data_plane == "socket"),
            metadata=self._metadata)
        try:
            header = None
            async for message in stream:
                if header is None:
                    if not message.HasField("header"):
                        raise TransferError("order", "the stream did not start with a header")
                    header = message.header
                    if (header.encoding or "raw") != importer.encoding:
                        raise TransferError("layout", f"the peer sends {header.encoding!r}, "
                                                      f"{importer.encoding!r} was asked")
                    importer.accept(layout_from_pb(header.layout), header.num_blocks,
                                    header.bytes_per_block, header.checksum or "xxh3")
                    if header.socket_port:
                        await self._receive_over_socket(address, header, importer, stream)
                        break
                    continue
                d = message.data
                await asyncio.to_thread(importer.add, d.first_block, d.num_blocks, d.payload,
                                        d.checksum)
            importer.finish()
        finally:
            stream.cancel()

    async def _receive_over_socket(self, address: str, header: pb.KVHeader,
                                   importer: Importer, stream) -> None:
        """The chunks as frames on a connection to the holder's data plane. Its gRPC stream
        ends once every frame is sent (or fails if the holder goes away); then what the
        socket brought is checked to the last block."""
        host = address.rsplit(":", 1)[0].strip("[]")

        def connect():
            conn = socket.create_connection((host, header.socket_port), timeout=5.0)
            conn.settimeout(None)
            conn.sendall(header.ticket)
            return conn

        try:
            conn = await asyncio.to_thread(connect)
        except OSError as e:
            raise TransferError("peer", f"the holder's data port: {e}") from None
        receiver = in_thread(recv_frames, conn, importer)
        try:
            async for _ in stream:
                raise TransferError("order", "a chunk on the stream of a socket pull")
            await asyncio.shield(receiver)  # (waited for below when this is cancelled)
        finally:  # (a stream's error, if any, is the pull's, not the receiving thread's)
            await close_and_join(conn, receiver)

    def _failed(self, address: str, error: TransferError) -> None:
        self.counts[error.reason] += 1
        if error.reason in ("peer", "timeout"):
            self._down_until[address] = self.clock() + PEER_RETRY_S
        logger.warning("KV pull from %s failed (%s: %s); computing the prefix instead",
                       address, error.reason, error)


def _as_transfer_error(e: BaseException) -> TransferError:
    if isinstance(e, TransferError):
        return e
    if isinstance(e, TimeoutError):
        return TransferError("timeout", "the pull missed its deadline")
    code = e.code()
    reason = {grpc.StatusCode.UNAUTHENTICATED: "refused",
              grpc.StatusCode.FAILED_PRECONDITION: "layout",
              grpc.StatusCode.INVALID_ARGUMENT: "refused",
              grpc.StatusCode.RESOURCE_EXHAUSTED: "refused",
              grpc.StatusCode.DEADLINE_EXCEEDED: "timeout"}.get(code, "peer")
    return TransferError(reason, f"{code.name}: {e.details()}")


@dataclass
class KVNode:
    """A worker's transfer service and its puller, started together (`start`)."""

    service: KVTransferService
    puller: KVPuller
    server: grpc.aio.Server
    address: str

    @classmethod
    async def start(cls, worker, options: TransferOptions, host: str,
                    prefill_tokens_per_s: float, port: int = 0) -> KVNode:
        """Serve `worker`'s (cluster/worker.Worker, started) blocks on host:port and let it
        pull from peers. prefill_tokens_per_s: `measure_prefill_rate`'s, before it started."""
        engine = worker.engine
        (io, layout), port_ = engine_block_io(engine), KVPort(engine.kv)
        if not encodable(layout, options.encoding):
            raise ValueError(f"kv_transfer.encoding: {options.encoding!r} does not fit this "
                             f"model's KV blocks (MX needs whole groups of 32 values)")
        service = KVTransferService(worker.async_engine, port_, io, layout, options)
        server, address = await start_server(service, host, port)
        if options.tls_cert is None:  # a plain socket would carry the KV unencrypted
            service.data_plane = DataPlane(host)
        policy = PullPolicy(prefill_tokens_per_s, min_blocks=options.min_pull_blocks,
                            encoding=options.encoding)
        puller = KVPuller(worker.async_engine, port_, io, layout, policy, options, address)
        worker.kv_puller = puller
        return cls(service, puller, server, address)

    async def linger(self, quiet_s: float = 1.0, timeout_s: float = 10.0) -> None:
        """Wait until no peer has pulled from here for quiet_s (at most timeout_s): after a
        drain, the peers going on with its requests pull their blocks from here."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            service = self.service
            if not service.num_active and time.monotonic() - service.last_active >= quiet_s:
                return
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        await self.puller.close()
        await self.server.stop(grace=1.0)
        if self.service.data_plane is not None:
            self.service.data_plane.close()
