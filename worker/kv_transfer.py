"""KV blocks between workers: the engine's side of a transfer, free of gRPC (the service and
its client are cluster/kv_service.py; the wire format is proto/kv_transfer.proto).

    holder                                      receiver
    KVPort.pin(hashes) (engine thread)          KVPort.reserve(hashes) (engine thread)
    Exporter.chunks(): gather -> bytes + sum    Importer.accept(header), .add(chunk): sum,
                         ----gRPC stream---->           layout and order checked, scatter
    KVPort.release(pin)                         KVPort.commit(reservation, blocks verified):
                                                  registered in the prefix cache (BlockStored
                                                  reaches the index), or released on failure

Blocks are pinned for an export by a transfer's own entry in the block manager (a table that
shares them, `allocate(prefix_block_ids=...)`), so nothing evicts or overwrites them while they
are read; an import's blocks are fresh ones held the same way, written while no request can
see them and registered only once their bytes are verified. The gathers and scatters touch only
those blocks, so they run off the engine's thread while it steps.

Checksums: XXH3-64 of the payload on the host, or WSUM64 (kernels/checksum.py) where the bytes
are: on the GPU for a GPU pool's raw payloads, of the gathered blocks before they are copied
out, and on the receiver's GPU after they are copied in, before they are scattered (a mismatch
writes nothing). The holder picks (`checksum_kind`); its header names the one it sends.

A failed transfer (checksum, truncation, timeout, the peer gone, a layout that differs) keeps
the blocks verified before the failure and releases the rest: the request computes what is
missing, so a transfer can cost time but never change an output.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import xxhash

from mxserve.kernels.checksum import wsum64
from mxserve.worker.kv_cache import KVCacheManager

WIRE_VERSION = 1
_IDS = itertools.count()


class TransferError(Exception):
    """A transfer that cannot go on. `reason` names it for metrics: "checksum", "truncated",
    "layout", "order", "refused", "timeout", "peer"."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class KVLayout:
    """How a worker's cache is laid out. The canonical bytes of a chunk of n blocks: for each
    layer, K then V, each [n, block_size, num_kv_heads, head_dim] in `dtype` (layer-major, so
    each cache is gathered straight into its slice and scattered straight out of it)."""

    model_id: str
    dtype: str  # "float32", "bfloat16", "float16"
    block_size: int
    num_layers: int  # the model's layers, then a local EAGLE head's
    num_kv_heads: int
    head_dim: int
    version: int = WIRE_VERSION

    @property
    def bytes_per_block(self) -> int:
        return (self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim
                * _itemsize(self.dtype))

    def mismatch(self, other: KVLayout) -> str | None:
        """The first field on which the two differ (None: compatible)."""
        for name in ("version", "model_id", "dtype", "block_size", "num_layers", "num_kv_heads",
                     "head_dim"):
            if getattr(self, name) != getattr(other, name):
                return name
        return None


def checksum(payload: bytes) -> int:
    """XXH3-64: a transfer's integrity check on the host, several times faster than CRC-32 on
    a CPU."""
    return xxhash.xxh3_64_intdigest(payload)


def checksum_parts(parts: Sequence) -> int:
    """`checksum` of the parts' concatenation, without making it."""
    h = xxhash.xxh3_64()
    for part in parts:
        h.update(part)
    return h.intdigest()


CHECKSUMS = ("xxh3", "wsum64")


def checksum_kind(device: torch.device, encoding: str, choice: str = "auto") -> str:
    """The checksum a holder sends with `encoding`'s payloads: "auto" is WSUM64 for a GPU
    pool's raw payloads (summed on the GPU, no host pass over the bytes) and XXH3-64 otherwise;
    "wsum64" is WSUM64 for raw payloads on any pool; MX payloads are encoded on the host and
    always take XXH3-64."""
    if choice not in ("auto", *CHECKSUMS):
        raise ValueError(f"checksum: {choice!r} is not one of auto, {', '.join(CHECKSUMS)}")
    if ENCODINGS[encoding] is not None or choice == "xxh3":
        return "xxh3"
    return "wsum64" if choice == "wsum64" or device.type == "cuda" else "xxh3"


# Payload encodings: "raw" sends the cache's own bytes; the MX ones (OCP microscaling, blocks
# of 32 consecutive values of the canonical layout sharing one E8M0 scale, the "ceil" rule so
# nothing clips) send 8 or 6 bits a value plus a scale byte per 32, for slow links. They change
# the numbers, so they are off unless the receiver asks for one (TransferOptions.encoding).
ENCODINGS = {"raw": None, "mxfp8": "e4m3", "mxfp6": "e2m3"}


def wire_bytes_per_block(layout: KVLayout, encoding: str) -> int:
    """Bytes a block takes on the wire in `encoding`."""
    fmt = ENCODINGS[encoding]
    if fmt is None:
        return layout.bytes_per_block
    from mxserve.kernels.mx import get_format

    values = layout.bytes_per_block // _itemsize(layout.dtype)
    return values * get_format(fmt).bits // 8 + values // 32


def encodable(layout: KVLayout, encoding: str) -> bool:
    """Whether `encoding` is one of ENCODINGS that blocks of this layout can take (MX: whole
    groups of 32 values)."""
    if encoding not in ENCODINGS:
        return False
    return ENCODINGS[encoding] is None or \
        (layout.bytes_per_block // _itemsize(layout.dtype)) % 32 == 0


def encode(payload: bytes, dtype: str, encoding: str) -> bytes:
    """The canonical bytes of whole blocks as `encoding`'s: MX element codes, then scales."""
    fmt = ENCODINGS[encoding]
    if fmt is None:
        return payload
    values = _tensor(payload, getattr(torch, dtype)).view(-1, 32)
    if fmt == "e4m3":  # torch's float8_e4m3fn is OCP E4M3: a cast does the rounding
        data, scales = _quantize_e4m3(values.float())
    else:
        from mxserve.kernels.mx import quantize_mx

        mx = quantize_mx(values, fmt, scale_mode="ceil")
        data, scales = mx.data, mx.scales
    return data.numpy().tobytes() + scales.numpy().tobytes()


def _quantize_e4m3(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.mx.quantize_mx(values, "e4m3", scale_mode="ceil"), bit for bit, in a few torch
    passes: the smallest scale 2^s with amax <= 1.75 * 2^(8 + s) (amax = m * 2^e, m in
    [0.5, 1): s = e - 9, one more when m > 0.875), then a round-to-nearest-even cast (nothing
    exceeds the largest code, so nothing saturates)."""
    mantissa, exponent = torch.frexp(values.abs().amax(-1, keepdim=True))
    s = (exponent - 9 + (mantissa > 0.875).to(exponent.dtype)).clamp_(-127, 127)
    codes = torch.ldexp(values, -s).to(torch.float8_e4m3fn).view(torch.uint8)
    return codes, (s + 127).to(torch.uint8)


def decode(payload: bytes, dtype: str, encoding: str) -> bytes:
    """`encode`'s inverse: the canonical bytes (in the cache dtype) the codes stand for."""
    fmt = ENCODINGS[encoding]
    if fmt is None:
        return payload
    from mxserve.kernels.mx import MXTensor, dequantize_mx, get_format

    bits = get_format(fmt).bits
    num_groups = len(payload) // (4 * bits + 1)  # 32 values of `bits` and a scale byte each
    raw = _tensor(payload, torch.uint8)
    data = raw[:num_groups * 4 * bits].view(num_groups, 4 * bits)
    scales = raw[num_groups * 4 * bits:].view(num_groups, 1)
    if fmt == "e4m3":  # exact in fp32: a code's value times a power of two
        values = torch.ldexp(data.view(torch.float8_e4m3fn).float(), scales.int() - 127)
        values = values.to(getattr(torch, dtype))
    else:
        values = dequantize_mx(MXTensor(data, scales, fmt, (num_groups, 32)),
                               getattr(torch, dtype))
    return values.view(torch.uint8).numpy().tobytes()


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


class BlockIO:
    """Reads and writes whole blocks of a pool in the canonical layout. caches: every layer's K
    and V, in order, each [num_blocks, block_size, num_kv_heads, head_dim]."""

    def __init__(self, caches: Sequence[torch.Tensor]) -> None:
        self.caches = list(caches)
        self.device = self.caches[0].device
        self.block_shape = self.caches[0].shape[1:]  # [block_size, num_kv_heads, head_dim]
        self._buffers: list[torch.Tensor] = []  # host staging buffers, reused (`_take`)
        self._lock = threading.Lock()
        # a host pool's caches as flat byte views: `views` slices these (a slice of a
        # memoryview costs far less than a torch or numpy index a block and cache)
        self._flat = [memoryview(c.view(torch.uint8).numpy().reshape(-1)) for c in self.caches] \
            if self.device.type == "cpu" and all(c.is_contiguous() for c in self.caches) \
            else None
        self._block_bytes = self.caches[0][0].numel() * self.caches[0].element_size()

    def read(self, block_ids: Sequence[int]) -> bytes:
        return self._read(block_ids, False)[0]

    @property
    def has_views(self) -> bool:
        """Whether `views` can show the blocks in place (a pool in host memory)."""
        return self._flat is not None

    def views(self, block_ids: Sequence[int]) -> list[memoryview] | None:
        """The blocks' bytes in the canonical order as views of the cache itself (each cache's
        blocks in turn), for a socket to send from or receive into without a copy; None for a
        pool not in host memory."""
        if self._flat is None:
            return None
        size = self._block_bytes
        runs, start = [], 0  # consecutive block ids: one view of each cache for the run
        for i in range(1, len(block_ids) + 1):
            if i == len(block_ids) or block_ids[i] != block_ids[i - 1] + 1:
                runs.append((block_ids[start] * size, (block_ids[i - 1] + 1) * size))
                start = i
        return [flat[lo:hi] for flat in self._flat for lo, hi in runs]

    def read_summed(self, block_ids: Sequence[int]) -> tuple[bytes, int]:
        """`read`'s bytes and their WSUM64, summed on the pool's device before the copy out."""
        return self._read(block_ids, True)

    def _read(self, block_ids: Sequence[int], summed: bool) -> tuple[bytes, int | None]:
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        cache = self.caches[0]
        shape = (len(self.caches), len(block_ids), *self.block_shape)
        num_bytes = math.prod(shape) * cache.element_size()
        host = self._take(num_bytes)
        try:
            # [2 * layers, n, block_size, num_kv_heads, head_dim]
            staged = host[:num_bytes].view(cache.dtype).view(shape)
            gathered = staged if self.device.type != "cuda" else \
                torch.empty(shape, dtype=cache.dtype, device=self.device)
            with torch.inference_mode():
                for i, c in enumerate(self.caches):
                    torch.index_select(c, 0, ids, out=gathered[i])
                digest = wsum64(gathered) if summed else None
                if gathered is not staged:
                    staged.copy_(gathered)
            return host[:num_bytes].numpy().tobytes(), digest
        finally:
            with self._lock:
                self._buffers.append(host)

    def _take(self, num_bytes: int) -> torch.Tensor:
        """A host buffer of at least num_bytes (pinned for a GPU pool), reused across reads:
        fresh host memory (its page faults) was the slow part of a read."""
        with self._lock:
            for i, buf in enumerate(self._buffers):
                if buf.numel() >= num_bytes:
                    return self._buffers.pop(i)
        return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")

    def write(self, block_ids: Sequence[int], payload: bytes, wsum: int | None = None) -> bool:
        """Scatter the blocks' bytes into the pool; with `wsum`, only if the bytes' WSUM64,
        taken on the pool's device once they are there, equals it (False: nothing written)."""
        cache = self.caches[0]
        data = _tensor(payload, cache.dtype).view(len(self.caches), len(block_ids),
                                                  *self.block_shape)
        data = data.to(self.device)
        if wsum is not None and wsum64(data) != wsum:
            return False
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            for i, c in enumerate(self.caches):
                c.index_copy_(0, ids, data[i])
        if self.device.type == "cuda":  # written before a step may read them
            torch.cuda.current_stream(self.device).synchronize()
        return True


def _tensor(payload: bytes, dtype: torch.dtype) -> torch.Tensor:
    """The bytes as a flat tensor of dtype, without a copy (read-only: only read)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(payload, dtype=torch.uint8).view(dtype)


class TPBlockIO:
    """BlockIO for rank 0 of a tensor-parallel group. The wire carries every KV head, as from
    one rank, so workers of any tensor-parallel size exchange blocks: a read gathers rank 0's
    shard here and the other ranks' over their block channels (tp_executor.RankGroup) and lays
    them side by side by head; a write hands each rank its heads. With fewer KV heads than
    ranks, each head is read from the first rank holding it and written to every one. Rank 0's
    extra caches (a local EAGLE head's layer, unsharded) go whole."""

    def __init__(self, runner, num_kv_heads: int) -> None:
        from mxserve.worker.model.tp import TPGroup

        self.group = runner.followers
        self.local = BlockIO([c for pair in runner.kv_caches for c in pair])
        extra = [c for pair in runner.extra_kv_caches for c in pair]
        self.extra = BlockIO(extra) if extra else None
        self.num_model_caches = len(self.local.caches)
        self.heads = [TPGroup(r, runner.tp.size).kv_heads(num_kv_heads)
                      for r in range(runner.tp.size)]  # each rank's [start, stop)
        self.sources = {}  # head range -> the first rank holding it
        for rank, heads in enumerate(self.heads):
            self.sources.setdefault(heads, rank)
        block_size, _, head_dim = self.local.block_shape
        self.block_shape = (block_size, num_kv_heads, head_dim)
        self.dtype = self.local.caches[0].dtype
        self.device = torch.device("cpu")  # where the wire's payload is put together
        self.has_views = False  # the payload is put together from the ranks' shards

    def _shard(self, payload: bytes, rank: int, n: int) -> torch.Tensor:
        start, stop = self.heads[rank]
        return _tensor(payload, self.dtype).view(self.num_model_caches, n, self.block_shape[0],
                                                 stop - start, self.block_shape[2])

    def read(self, block_ids: Sequence[int]) -> bytes:
        return self._read(block_ids).view(torch.uint8).numpy().tobytes()

    def read_summed(self, block_ids: Sequence[int]) -> tuple[bytes, int]:
        out = self._read(block_ids)
        return out.view(torch.uint8).numpy().tobytes(), wsum64(out)

    def _read(self, block_ids: Sequence[int]) -> torch.Tensor:
        n = len(block_ids)
        shards = [self.local.read(block_ids), *self.group.read_blocks(block_ids)]
        num_caches = self.num_model_caches + (len(self.extra.caches) if self.extra else 0)
        out = torch.empty((num_caches, n, *self.block_shape), dtype=self.dtype)
        for (start, stop), rank in self.sources.items():
            out[:self.num_model_caches, :, :, start:stop] = self._shard(shards[rank], rank, n)
        if self.extra is not None:
            out[self.num_model_caches:] = _tensor(self.extra.read(block_ids), self.dtype).view(
                out[self.num_model_caches:].shape)
        return out

    def write(self, block_ids: Sequence[int], payload: bytes, wsum: int | None = None) -> bool:
        """As BlockIO.write; WSUM64 checked on the host, before any rank gets its heads."""
        data = _tensor(payload, self.dtype).view(-1, len(block_ids), *self.block_shape)
        if wsum is not None and wsum64(data) != wsum:
            return False
        shards = [data[:self.num_model_caches, :, :, start:stop].contiguous()
                  .view(torch.uint8).numpy().tobytes() for start, stop in self.heads]
        self.group.write_blocks(block_ids, shards[1:])
        self.local.write(block_ids, shards[0])
        if self.extra is not None:
            self.extra.write(block_ids, data[self.num_model_caches:].contiguous()
                             .view(torch.uint8).numpy().tobytes())
        return True


def engine_block_io(engine) -> tuple[BlockIO | TPBlockIO, KVLayout]:
    """The engine's pool as transfers read and write it, and its layout (every KV head, as
    one rank holds them, whatever the tensor-parallel size)."""
    runner = engine.runner
    caches = [c for pair in runner.kv_caches + runner.extra_kv_caches for c in pair]
    layout = engine_layout(engine.model_config.model_id, caches)
    if runner.followers is None:
        return BlockIO(caches), layout
    num_kv_heads = engine.model_config.num_key_value_heads
    return TPBlockIO(runner, num_kv_heads), dataclasses.replace(layout,
                                                                num_kv_heads=num_kv_heads)


@dataclass
class Pinned:
    """Blocks held for an export: `block_ids` are the leading run of the asked hashes."""

    entry: str  # the transfer's entry in the block manager
    block_ids: list[int]


@dataclass
class Reservation:
    """Fresh blocks held for an import: blocks [num_local, num_local + len(block_ids)) of the
    prefix `block_hashes`, the first num_local being hits in the receiver's own cache."""

    entry: str
    block_hashes: list[int]
    num_local: int
    block_ids: list[int]


class KVPort:
    """The block manager's side of transfers. Every method runs on the engine's thread."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv

    def pin(self, block_hashes: Sequence[int]) -> Pinned | None:
        """Hold the leading run of `block_hashes` this cache has (None: not even the first)."""
        block_ids = self.kv.lookup_prefix(list(block_hashes))
        if not block_ids:
            return None
        entry = f"kv-transfer:{next(_IDS)}"
        self.kv.allocate(entry, len(block_ids) * self.kv.block_size, block_ids)
        return Pinned(entry, block_ids)

    def reserve(self, block_hashes: Sequence[int], max_blocks: int) -> Reservation | None:
        """Fresh blocks for up to `max_blocks` of the prefix's blocks after those this cache
        already has (which are held too, so the prefix stays whole). None: nothing to fetch, or
        no block free."""
        block_hashes = list(block_hashes)
        local = self.kv.lookup_prefix(block_hashes)
        num_new = min(max_blocks, len(block_hashes) - len(local))
        while num_new > 0:
            entry = f"kv-transfer:{next(_IDS)}"
            if self.kv.allocate(entry, (len(local) + num_new) * self.kv.block_size, local):
                block_ids = self.kv.get_block_ids(entry)[len(local):]
                return Reservation(entry, block_hashes[:len(local) + num_new], len(local),
                                   block_ids)
            num_new //= 2  # short of blocks: fetch less
        return None

    def commit(self, reservation: Reservation, num_verified: int) -> None:
        """Register the first num_verified imported blocks in the prefix cache (the index hears
        BlockStored) and release the entry: they stay cached, the rest go back to the pool."""
        bs = self.kv.block_size
        num_tokens = (reservation.num_local + num_verified) * bs
        if num_verified < len(reservation.block_ids):
            self.kv.trim(reservation.entry, num_tokens)
        if num_tokens:
            self.kv.cache_blocks(reservation.entry, reservation.block_hashes, num_tokens)
        self.kv.free(reservation.entry)

    def release(self, held: Pinned | Reservation | None) -> None:
        if held is not None:  # (None: a pin or reservation that got nothing)
            self.kv.free(held.entry)


class Exporter:
    """The holder's stream: the pinned blocks in chunks of about `chunk_bytes`, each with its
    checksum (`checksum`: one of CHECKSUMS, from checksum_kind). `faults` is a test hook:
    {"corrupt_chunk": i} flips a byte of chunk i after its checksum is taken,
    {"truncate_after": i} stops after chunk i."""

    def __init__(self, io: BlockIO, layout: KVLayout, pinned: Pinned, chunk_bytes: int,
                 faults: dict | None = None, encoding: str = "raw",
                 checksum: str = "xxh3") -> None:
        self.io, self.layout, self.pinned, self.encoding = io, layout, pinned, encoding
        self.checksum = checksum
        self.blocks_per_chunk = max(1, chunk_bytes // wire_bytes_per_block(layout, encoding))
        self.faults = faults or {}

    def chunks(self) -> Iterator[tuple[int, int, bytes, int]]:
        """(first block, number of blocks, payload, checksum) per chunk, gathered as they go."""
        for first, n, parts, digest in self.frames(in_place=False):
            yield first, n, parts[0], digest

    def frames(self, in_place: bool = True) -> Iterator[tuple[int, int, list, int | None]]:
        """`chunks` with each payload as a list of parts to send in order: with in_place, a
        host pool's raw XXH3 chunks are views of the cache itself (no gather; the blocks are
        pinned while they are sent) and their checksum None, for the sender to take as it
        sends them (each part hashed while it is in cache, not in a pass of its own); any
        other payload is one bytes object with its checksum."""
        ids = self.pinned.block_ids
        views = in_place and self.checksum == "xxh3" and ENCODINGS[self.encoding] is None
        for i, first in enumerate(range(0, len(ids), self.blocks_per_chunk)):
            if i > self.faults.get("truncate_after", len(ids)):
                return
            block_ids = ids[first:first + self.blocks_per_chunk]
            parts = self.io.views(block_ids) if views and self.io.has_views else None
            if parts is not None:
                digest = None
                if self.faults.get("corrupt_chunk") == i:  # the checksum of the true bytes
                    digest = checksum_parts(parts)
            elif self.checksum == "wsum64":  # raw payloads only (checksum_kind)
                payload, digest = self.io.read_summed(block_ids)
                parts = [payload]
            else:
                payload = encode(self.io.read(block_ids), self.layout.dtype, self.encoding)
                parts, digest = [payload], checksum(payload)
            if self.faults.get("corrupt_chunk") == i:
                parts = [bytes([parts[0][0] ^ 0x01]) + bytes(parts[0][1:]), *parts[1:]]
            yield first, len(block_ids), parts, digest


class WriteGate:
    """Shared by the streams of one pull: `close` waits for a write in progress and refuses
    later ones, so the blocks are committed or released only after every write, whatever
    thread a stale one runs on."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.closed = False

    def close(self) -> None:
        with self.lock:
            self.closed = True


@dataclass
class Importer:
    """The receiver's side of one stream of a pull, for blocks [lo, hi) of the reservation:
    checks the header against its layout, then each chunk (order, size, checksum) before
    writing it into the reserved blocks. `num_verified` counts the blocks written so far, from
    lo. A pull may run several streams over consecutive ranges (`split`)."""

    io: BlockIO
    layout: KVLayout
    reservation: Reservation
    lo: int = 0
    hi: int | None = None  # None: to the reservation's end
    gate: WriteGate = field(default_factory=WriteGate)
    encoding: str = "raw"  # the payload's (asked by the receiver)
    checksum: str = "xxh3"  # the chunks' (the sender's header)
    num_blocks: int = 0  # what the sender will send (its header)
    num_verified: int = 0
    num_bytes: int = 0

    @property
    def size(self) -> int:
        hi = len(self.reservation.block_ids) if self.hi is None else self.hi
        return hi - self.lo

    def accept(self, layout: KVLayout, num_blocks: int, bytes_per_block: int,
               checksum: str = "xxh3") -> None:
        if checksum not in CHECKSUMS or (checksum == "wsum64" and self.encoding != "raw"):
            raise TransferError("layout", f"the peer's checksum {checksum!r} is not one of "
                                          f"{CHECKSUMS} ({self.encoding} payloads: xxh3)")
        self.checksum = checksum
        name = self.layout.mismatch(layout)
        if name is not None:
            raise TransferError("layout", f"the peer's {name} is {getattr(layout, name)!r}, "
                                          f"ours {getattr(self.layout, name)!r}")
        want = wire_bytes_per_block(self.layout, self.encoding)
        if bytes_per_block != want:
            raise TransferError("layout", f"the peer sends {bytes_per_block} bytes a block, "
                                          f"{self.encoding} blocks of ours are {want}")
        if not 0 <= num_blocks <= self.size:
            raise TransferError("order", f"the peer sends {num_blocks} blocks, {self.size} "
                                         "were asked")
        self.num_blocks = num_blocks

    def add(self, first: int, num_blocks: int, payload: bytes, digest: int) -> None:
        self._check_chunk(first, num_blocks, len(payload))
        mismatch = TransferError("checksum", f"blocks {first}..{first + num_blocks}: "
                                             f"{self.checksum} mismatch")
        if self.checksum == "xxh3" and checksum(payload) != digest:
            raise mismatch
        start = self.lo + first
        values = decode(payload, self.layout.dtype, self.encoding)
        with self.gate.lock:
            if self.gate.closed:
                raise TransferError("timeout", "the pull ended before this chunk was written")
            if not self.io.write(self.reservation.block_ids[start:start + num_blocks], values,
                                 digest if self.checksum == "wsum64" else None):
                raise mismatch
            self.num_verified += num_blocks
            self.num_bytes += len(payload)

    @property
    def in_place(self) -> bool:
        """Whether chunks can be received straight into the reserved blocks (`add_into`): a
        host pool, raw payloads, XXH3."""
        return self.checksum == "xxh3" and self.encoding == "raw" and self.io.has_views

    def add_into(self, first: int, num_blocks: int, num_bytes: int,
                 receive: Callable[[list[memoryview]], tuple[int, int]]) -> None:
        """`add` for a chunk received in place: receive(views) writes its bytes straight into
        the reserved blocks (they are no one's until commit) and returns (the XXH3 of what it
        wrote, the sender's); a chunk whose two differ is not counted (its blocks are
        released)."""
        self._check_chunk(first, num_blocks, num_bytes)
        start = self.lo + first
        with self.gate.lock:
            if self.gate.closed:
                raise TransferError("timeout", "the pull ended before this chunk was written")
            got, sent = receive(self.io.views(self.reservation.block_ids[start:start + num_blocks]))
            if got != sent:
                raise TransferError("checksum", f"blocks {first}..{first + num_blocks}: "
                                                "xxh3 mismatch")
            self.num_verified += num_blocks
            self.num_bytes += num_bytes

    def _check_chunk(self, first: int, num_blocks: int, num_bytes: int) -> None:
        if first != self.num_verified or num_blocks <= 0 \
                or first + num_blocks > self.num_blocks:
            raise TransferError("order", f"chunk of blocks {first}..{first + num_blocks} "
                                         f"after {self.num_verified} of {self.num_blocks}")
        if num_bytes != num_blocks * wire_bytes_per_block(self.layout, self.encoding):
            raise TransferError("truncated", f"chunk of {num_blocks} blocks has "
                                             f"{num_bytes} bytes")

    def close(self) -> int:
        """No more writes; returns the blocks verified and written."""
        self.gate.close()
        return self.num_verified

    def finish(self) -> None:
        if self.num_verified != self.num_blocks:
            raise TransferError("truncated", f"the stream ended after {self.num_verified} of "
                                             f"{self.num_blocks} blocks")


def split(io: BlockIO, layout: KVLayout, reservation: Reservation, num_streams: int,
          encoding: str = "raw") -> list[Importer]:
    """One Importer per stream, over consecutive ranges of the reservation, sharing a gate."""
    n = len(reservation.block_ids)
    num_streams = max(1, min(num_streams, n))
    gate = WriteGate()
    bounds = [n * i // num_streams for i in range(num_streams + 1)]
    return [Importer(io, layout, reservation, lo, hi, gate, encoding)
            for lo, hi in zip(bounds, bounds[1:])]


def leading_verified(importers: list[Importer]) -> int:
    """Blocks verified from the reservation's first without a gap: what may be kept. Close the
    gate first."""
    total = 0
    for importer in importers:
        total += importer.num_verified
        if importer.num_verified < importer.size:
            break
    return total


@dataclass
class PullPolicy:
    """Pull a prefix's blocks from a peer only when that beats computing them:

        pull_s = latency_s + bytes / link_bytes_per_s   <   tokens / prefill_tokens_per_s

    The prefill rate is measured at start-up (`measure_prefill_rate`); each peer's link is
    probed at first contact and kept current from every pull (an exponential average)."""

    prefill_tokens_per_s: float
    min_blocks: int = 2  # fewer blocks are never worth a round trip
    latency_s: float = 0.002
    smoothing: float = 0.3
    encoding: str = "raw"  # what pulls ask for: the bytes on the wire a block
    # peer -> seconds a byte (averaged as time, not rate, so one slow pull counts fully)
    links: dict[str, float] = field(default_factory=dict)

    def estimate(self, peer: str, num_blocks: int, layout: KVLayout) -> tuple[float, float]:
        """(seconds to pull, seconds to compute) for num_blocks blocks."""
        num_bytes = num_blocks * wire_bytes_per_block(layout, self.encoding)
        pull = self.latency_s + num_bytes * self.links[peer]
        return pull, num_blocks * layout.block_size / self.prefill_tokens_per_s

    def should_pull(self, peer: str, num_blocks: int, layout: KVLayout) -> bool:
        if num_blocks < self.min_blocks:
            return False
        pull_s, compute_s = self.estimate(peer, num_blocks, layout)
        return pull_s < compute_s

    def observe_link(self, peer: str, num_bytes: int, seconds: float) -> None:
        if num_bytes <= 0 or seconds <= 0:
            return
        cost = seconds / num_bytes
        old = self.links.get(peer)
        self.links[peer] = cost if old is None else old + self.smoothing * (cost - old)


def engine_layout(model_id: str, caches: Sequence[torch.Tensor]) -> KVLayout:
    block_size, num_kv_heads, head_dim = caches[0].shape[1:]
    return KVLayout(model_id, str(caches[0].dtype).removeprefix("torch."), block_size,
                    len(caches) // 2, num_kv_heads, head_dim)


def measure_prefill_rate(engine, num_tokens: int = 512) -> float:
    """Prompt tokens per second of this engine's prefill, timed on a throwaway prompt before the
    engine serves (a short one first warms it up); the prefix cache is emptied after."""
    from mxserve.api.sampling_params import SamplingParams

    num_tokens = max(16, min(num_tokens, engine.max_model_len - 2))
    gen = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    rate = 0.0
    for n in (16, num_tokens):
        ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
        engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0.0))
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        rate = n / (time.perf_counter() - start)
    engine.kv.reset_prefix_cache()
    return rate
