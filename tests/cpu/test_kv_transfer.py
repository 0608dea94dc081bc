"""KV blocks between workers (worker/kv_transfer.py, cluster/kv_service.py): the block moves
themselves, then real gRPC over loopback between two workers in this process, with faults.
The two-node Ray cluster's prefix pull is in test_serve_cluster.py."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading

import grpc
import pytest
import torch

from mxserve import LLM, SamplingParams
from mxserve.cluster import kv_socket
from mxserve.cluster.kv_service import SECRET_KEY, KVNode, TransferOptions, layout_to_pb
from mxserve.cluster.worker import Worker
from mxserve.kernels.checksum import wsum64_torch
from mxserve.proto import kv_transfer_pb2 as pb
from mxserve.proto import kv_transfer_pb2_grpc as pb_grpc
from mxserve.worker.kv_transfer import (
    BlockIO,
    Exporter,
    Importer,
    KVLayout,
    KVPort,
    PullPolicy,
    TransferError,
    checksum_kind,
    decode,
    encode,
    engine_block_io,
    engine_layout,
    wire_bytes_per_block,
)

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SECRET = "s3cret"
ENGINE = dict(dtype="float32", num_kv_blocks=64, load_progress=False)


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PREFIX = _ids(96, 1)  # 6 blocks
PROMPTS = [PREFIX + _ids(9, s) for s in (2, 3, 4)]


@pytest.fixture(scope="module")
def reference(ckpt):
    """Each prompt's greedy tokens, computed alone with no cache."""
    llm = LLM(model=ckpt, enable_prefix_caching=False, **ENGINE)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def _parts(llm: LLM):
    engine = llm.engine
    caches = [c for pair in engine.runner.kv_caches for c in pair]
    return KVPort(engine.kv), BlockIO(caches), engine_layout(engine.model_config.model_id, caches)


def _no_transfer_entries(llm: LLM) -> None:
    kv = llm.engine.kv
    kv.check_integrity()
    assert not any(e.startswith("kv-transfer") for e in kv._tables), "a transfer held blocks"


@pytest.mark.parametrize("checksum", ["xxh3", "wsum64"])
def test_blocks_moved_between_engines_give_the_same_tokens_and_count_as_cached(ckpt, reference,
                                                                              checksum):
    holder, receiver = LLM(model=ckpt, **ENGINE), LLM(model=ckpt, **ENGINE)
    holder.generate(PROMPTS[:1], GREEDY)
    h_port, h_io, layout = _parts(holder)
    r_port, r_io, r_layout = _parts(receiver)
    assert layout == r_layout and layout.num_layers == 2
    request = receiver.engine.make_request(PROMPTS[1], GREEDY)
    hashes = request.block_hashes[:6]
    pinned = h_port.pin(hashes)
    assert len(pinned.block_ids) == 6
    reservation = r_port.reserve(hashes, 6)
    importer = Importer(r_io, r_layout, reservation)
    importer.accept(layout, 6, layout.bytes_per_block, checksum)
    exporter = Exporter(h_io, layout, pinned, chunk_bytes=2 * layout.bytes_per_block + 1,
                        checksum=checksum)
    for chunk in exporter.chunks():
        if checksum == "wsum64":  # summed on the pool's device: the payload's WSUM64
            assert chunk[3] == wsum64_torch(torch.frombuffer(bytearray(chunk[2]),
                                                             dtype=torch.uint8))
        importer.add(*chunk)
    importer.finish()
    h_port.release(pinned)
    r_port.commit(reservation, importer.close())
    _no_transfer_entries(holder)
    _no_transfer_entries(receiver)
    out = receiver.generate(PROMPTS[1:], GREEDY)
    assert [o.token_ids for o in out] == reference[1:]
    assert [o.num_cached_tokens for o in out] == [96, 96]
    receiver.engine.kv.check_integrity()


@pytest.mark.parametrize("holder_tp, receiver_tp, kv_heads, checksum", [
    (2, 1, 2, "xxh3"), (1, 2, 2, "xxh3"), (2, 2, 1, "xxh3"), (2, 2, 2, "wsum64")])
def test_blocks_move_between_workers_of_any_tensor_parallel_size(tiny_checkpoint, holder_tp,
                                                                 receiver_tp, kv_heads,
                                                                 checksum):
    """The wire carries every KV head: a TP=2 worker's blocks (each rank's shard, gathered
    over the ranks' block channels) serve a TP=1 worker and the other way round, and with one
    KV head held by both ranks (kv_heads 1); greedy tokens equal a cold run's, the pulled blocks
    count as cached, and both pools stay consistent. WSUM64 is summed and checked on the host
    where the payload is put together."""
    path = str(tiny_checkpoint("llama", num_key_value_heads=kv_heads))
    with LLM(model=path, enable_prefix_caching=False, **ENGINE) as cold:
        want = [o.token_ids for o in cold.generate(PROMPTS[1:], GREEDY)]
    with LLM(model=path, tensor_parallel_size=holder_tp, **ENGINE) as holder, \
            LLM(model=path, tensor_parallel_size=receiver_tp, **ENGINE) as receiver:
        holder.generate(PROMPTS[:1], GREEDY)
        (h_io, layout), (r_io, r_layout) = (engine_block_io(x.engine) for x in (holder,
                                                                                receiver))
        assert layout == r_layout and layout.num_kv_heads == kv_heads
        hashes = receiver.engine.make_request(PROMPTS[1], GREEDY).block_hashes[:6]
        h_port, r_port = KVPort(holder.engine.kv), KVPort(receiver.engine.kv)
        pinned, reservation = h_port.pin(hashes), r_port.reserve(hashes, 6)
        importer = Importer(r_io, r_layout, reservation)
        importer.accept(layout, 6, layout.bytes_per_block, checksum)
        for chunk in Exporter(h_io, layout, pinned, chunk_bytes=4 * layout.bytes_per_block,
                              checksum=checksum).chunks():
            importer.add(*chunk)
        importer.finish()
        h_port.release(pinned)
        r_port.commit(reservation, importer.close())
        out = receiver.generate(PROMPTS[1:], GREEDY)
        assert [o.token_ids for o in out] == want
        assert [o.num_cached_tokens for o in out] == [96, 96]
        _no_transfer_entries(holder)
        _no_transfer_entries(receiver)


def test_importer_checks_layout_order_size_and_checksum(ckpt):
    llm = LLM(model=ckpt, **ENGINE)
    port, io, layout = _parts(llm)
    hashes = llm.engine.make_request(PROMPTS[0]).block_hashes[:4]
    reservation = port.reserve(hashes, 4)
    importer = Importer(io, layout, reservation)
    other = KVLayout(**{**layout.__dict__, "block_size": 32})
    with pytest.raises(TransferError, match="block_size") as e:
        importer.accept(other, 4, layout.bytes_per_block)
    assert e.value.reason == "layout"
    with pytest.raises(TransferError) as e:
        importer.accept(layout, 5, layout.bytes_per_block)
    assert e.value.reason == "order"
    importer.accept(layout, 4, layout.bytes_per_block)
    payload = bytes(2 * layout.bytes_per_block)
    with pytest.raises(TransferError) as e:
        importer.add(1, 2, payload, 0)  # not the next block
    assert e.value.reason == "order"
    with pytest.raises(TransferError) as e:
        importer.add(0, 2, payload[:-1], 0)
    assert e.value.reason == "truncated"
    with pytest.raises(TransferError) as e:
        importer.add(0, 2, payload, 12345)
    assert e.value.reason == "checksum"
    for bad in ("crc32", "wsum64"):  # unknown; WSUM64 with MX payloads
        mx = Importer(io, layout, reservation, encoding="mxfp8")
        with pytest.raises(TransferError, match="checksum") as e:
            mx.accept(layout, 4, wire_bytes_per_block(layout, "mxfp8"), bad)
        assert e.value.reason == "layout"
    importer.accept(layout, 4, layout.bytes_per_block, "wsum64")
    with pytest.raises(TransferError, match="wsum64 mismatch") as e:
        importer.add(0, 2, payload, 12345)  # checked on the device, before any write
    assert e.value.reason == "checksum"
    with pytest.raises(TransferError) as e:
        importer.finish()
    assert e.value.reason == "truncated" and importer.num_verified == 0
    port.commit(reservation, importer.close())
    _no_transfer_entries(llm)
    assert not llm.engine.kv.cached_block_hashes(), "an unverified block was registered"


def _send_and_close(conn: socket.socket, exporter: Exporter) -> None:
    try:
        kv_socket.send_frames(conn, exporter.frames(), threading.Event())
    except OSError:  # the receiver refused a chunk and shut the connection
        pass
    kv_socket.shut(conn)


@pytest.mark.parametrize("checksum", ["xxh3", "wsum64"])
def test_frames_over_a_socket_land_in_the_reserved_blocks(ckpt, reference, checksum):
    """cluster/kv_socket without gRPC, over a socket pair: a host pool's XXH3 frames go from
    the holder's cache (views of the pinned blocks) into the receiver's reserved blocks
    (add_into); WSUM64 frames are staged. A corrupted frame is refused, the frames before it
    are kept, and a connection closed early is a truncation."""
    holder, receiver = LLM(model=ckpt, **ENGINE), LLM(model=ckpt, **ENGINE)
    holder.generate(PROMPTS[:1], GREEDY)
    (h_port, h_io, layout), (r_port, r_io, _) = _parts(holder), _parts(receiver)
    hashes = receiver.engine.make_request(PROMPTS[1], GREEDY).block_hashes[:6]
    for faults, verified in (({"corrupt_chunk": 1}, 2), ({"truncate_after": 0}, 2), ({}, 6)):
        receiver.engine.kv.reset_prefix_cache()  # what an earlier round kept
        pinned, reservation = h_port.pin(hashes), r_port.reserve(hashes, 6)
        importer = Importer(r_io, layout, reservation)
        importer.accept(layout, 6, layout.bytes_per_block, checksum)
        assert importer.in_place == (checksum == "xxh3")
        exporter = Exporter(h_io, layout, pinned, 2 * layout.bytes_per_block, faults,
                            checksum=checksum)
        a, b = socket.socketpair()
        sender = threading.Thread(target=_send_and_close, args=(a, exporter))
        sender.start()
        try:
            if verified == 6:
                kv_socket.recv_frames(b, importer)
            else:
                with pytest.raises(TransferError) as e:
                    kv_socket.recv_frames(b, importer)
                assert e.value.reason == ("checksum" if faults.get("corrupt_chunk")
                                          else "truncated")
        finally:
            sender.join(10)
            kv_socket.shut(b)
        assert importer.close() == verified
        h_port.release(pinned)
        r_port.commit(reservation, verified)
    _no_transfer_entries(holder)
    _no_transfer_entries(receiver)
    out = receiver.generate(PROMPTS[1:], GREEDY)
    assert [o.token_ids for o in out] == reference[1:]
    assert [o.num_cached_tokens for o in out] == [96, 96]


def test_checksum_kind_sums_a_gpu_pools_raw_payloads_on_the_gpu():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert checksum_kind(cpu, "raw") == "xxh3" and checksum_kind(gpu, "raw") == "wsum64"
    assert checksum_kind(gpu, "mxfp8") == "xxh3"  # encoded on the host
    assert checksum_kind(cpu, "raw", "wsum64") == "wsum64"
    assert checksum_kind(gpu, "raw", "xxh3") == "xxh3"
    assert checksum_kind(cpu, "mxfp6", "wsum64") == "xxh3"
    with pytest.raises(ValueError, match="checksum"):
        checksum_kind(cpu, "raw", "crc32")


def test_pull_policy_compares_link_time_with_prefill_time():
    layout = KVLayout("m", "float32", 16, 30, 3, 64)  # 737,280 bytes a block
    policy = PullPolicy(prefill_tokens_per_s=1000.0)
    policy.observe_link("peer", 10 * layout.bytes_per_block, 0.01)  # 1 ms a block
    assert policy.should_pull("peer", 8, layout)  # 10 ms vs 128 ms
    assert not policy.should_pull("peer", 1, layout)  # under min_blocks
    policy.observe_link("slow", layout.bytes_per_block, 0.5)  # 0.5 s a block vs 16 ms
    assert not policy.should_pull("slow", 8, layout)
    policy.observe_link("peer", layout.bytes_per_block, 1.0)  # the link got slower
    pull_s, compute_s = policy.estimate("peer", 8, layout)
    assert pull_s > 2.0 and compute_s == pytest.approx(0.128)


# ---- two workers over real gRPC on loopback --------------------------------------------------


@contextlib.asynccontextmanager
async def _workers(ckpt, tp: tuple[int, int] = (1, 1), **options):
    """Two started Workers (holder, receiver), each serving its blocks on 127.0.0.1; tp: their
    tensor-parallel sizes."""
    opts = TransferOptions(**{"secret": SECRET, "chunk_bytes": 20_000, **options})
    llms = [LLM(model=ckpt, tensor_parallel_size=size, **ENGINE) for size in tp]
    workers = [Worker(llm.engine, max_queued_requests=8, worker_id=f"w{i}")
               for i, llm in enumerate(llms)]
    nodes = []
    try:
        for w in workers:
            w.start()
            # a slow prefill rate: every pull of 2 or more blocks beats computing them
            nodes.append(await KVNode.start(w, opts, "127.0.0.1", prefill_tokens_per_s=10.0))
        yield workers, nodes
    finally:
        for node in nodes:
            await node.stop()
        for w in workers:
            w.shutdown()
        for llm in llms:
            llm.shutdown()


async def _generate(worker: Worker, prompt: list[int], source=None) -> tuple[list[int], int]:
    tokens, cached = [], 0
    async for out in worker.generate(prompt, GREEDY, f"r{id(prompt)}-{len(tokens)}", source):
        tokens += out.new_token_ids
        cached = out.num_cached_tokens
    return tokens, cached


def _source(node: KVNode) -> dict:
    return {"address": node.address, "num_blocks": 6}


def _check_pools(workers) -> None:
    for w in workers:
        kv = w.engine.kv
        kv.check_integrity()
        assert not kv._tables, f"{w.worker_id} still holds blocks: {list(kv._tables)}"


@pytest.mark.parametrize("checksum, data_plane", [
    ("auto", "socket"), ("auto", "grpc"), ("wsum64", "socket")])
def test_prefix_pulled_over_grpc_gives_the_same_tokens_and_later_requests_hit_it(ckpt, reference,
                                                                                checksum,
                                                                                data_plane):
    """The chunks over the holder's data port (socket: in place, from cache to cache, or
    staged where WSUM64 is asked) or in the gRPC stream."""
    async def main():
        async with _workers(ckpt, checksum=checksum, data_plane=data_plane, num_streams=4) as (
                (holder, receiver), (h_node, r_node)):
            assert (await _generate(holder, PROMPTS[0]))[0] == reference[0]
            got = await _generate(receiver, PROMPTS[1], _source(h_node))
            assert got == (reference[1], 96)
            assert r_node.puller.counts["ok"] == 1 and r_node.puller.counts["blocks"] == 6
            assert h_node.service.counts["served"] == 3  # 3 chunks of 2 blocks: 3 streams
            assert h_node.service.counts["served_by_socket"] == (3 if data_plane == "socket"
                                                                 else 0)
            assert r_node.puller.policy.links[h_node.address] > 0  # probed, then measured
            # the pulled blocks serve this worker's later requests without another pull
            assert await _generate(receiver, PROMPTS[2]) == (reference[2], 96)
            # a source naming this very worker, or holding nothing new, pulls nothing
            assert await _generate(receiver, PROMPTS[2], _source(r_node)) == (reference[2], 96)
            assert r_node.puller.counts["ok"] == 1
            await asyncio.sleep(0.05)  # the holder's unpin is queued to its engine thread
            _check_pools((holder, receiver))
    asyncio.run(asyncio.wait_for(main(), 120))


@pytest.mark.parametrize("fault, reason, streams, checksum", [
    ({"corrupt_chunk": 1}, "checksum", 1, "auto"), ({"truncate_after": 0}, "truncated", 1, "auto"),
    ({"delay_s": 0.3}, "peer", 1, "auto"), ({"corrupt_chunk": 1}, "checksum", 2, "auto"),
    ({"corrupt_chunk": 1}, "checksum", 1, "wsum64")])
def test_a_failed_pull_is_detected_and_the_receiver_computes_the_rest(ckpt, reference, fault,
                                                                     reason, streams, checksum):
    """One stream of 3 chunks of 2 blocks; or 2 streams of 3 one-block chunks, each failing at
    its second (the blocks kept are those verified from the first without a gap). "wsum64": the
    holder sums its raw payloads with WSUM64 (what a GPU pool does), the receiver checks it."""
    chunk = 20_000 if streams == 1 else 8192

    async def main():
        async with _workers(ckpt, num_streams=streams, chunk_bytes=chunk, checksum=checksum) as (
                (holder, receiver), (h_node, r_node)):
            await _generate(holder, PROMPTS[0])
            h_node.service.faults = fault
            if "delay_s" in fault:  # the holder goes away after its first chunk
                async def kill():
                    await asyncio.sleep(0.15)
                    await h_node.server.stop(grace=None)
                killer = asyncio.create_task(kill())
            got = await _generate(receiver, PROMPTS[1], _source(h_node))
            assert got[0] == reference[1]
            counts = r_node.puller.counts
            assert counts[reason] == 1 and counts["ok"] == 0, dict(counts)
            # what arrived verified before the failure is kept: whole chunks only
            assert got[1] == 16 * counts["blocks"]
            assert counts["blocks"] in ((0, 2) if streams == 1 else (0, 1))
            if "delay_s" in fault:
                await killer  # a peer gone is left alone: the next request does not try it
                _, cached = await _generate(receiver, _ids(105, 77), _source(h_node))
                assert cached == 0
                assert counts["peer_down"] == 1 and counts["peer"] == 1, dict(counts)
            await asyncio.sleep(0.05)
            _check_pools((holder, receiver))
    asyncio.run(asyncio.wait_for(main(), 120))


@pytest.mark.parametrize("encoding, bits", [("mxfp8", 8), ("mxfp6", 6)])
def test_mx_encodings_are_the_mx_round_trip_of_the_blocks(encoding, bits):
    """An MX payload is each 32 values' codes then the scales ("ceil" rule: nothing clips);
    decoded, it is exactly the MX quantize-dequantize of the canonical bytes, in the cache's
    dtype, and the wire carries bits / 8 + 1 / 32 bytes a value."""
    from mxserve.kernels.mx import dequantize_mx, quantize_mx

    layout = KVLayout("m", "bfloat16", 16, 2, 2, 64)
    n = 3 * layout.bytes_per_block // 2  # three blocks of bf16 values
    scale = torch.logspace(-3, 3, n // 32).repeat_interleave(32)  # a range per group of 32
    values = (torch.randn(n, generator=torch.Generator().manual_seed(0)) * scale).bfloat16()
    values[:32] = 0  # a group of zeros
    raw = values.view(torch.uint8).numpy().tobytes()
    wire = encode(raw, "bfloat16", encoding)
    assert len(wire) == 3 * wire_bytes_per_block(layout, encoding)
    num_values = layout.bytes_per_block // 2
    assert wire_bytes_per_block(layout, encoding) * 32 == num_values * (4 * bits + 1)
    want = dequantize_mx(quantize_mx(values.view(-1, 32), ENCODING_FORMATS[encoding],
                                     scale_mode="ceil"), torch.bfloat16)
    assert decode(wire, "bfloat16", encoding) == want.view(torch.uint8).numpy().tobytes()
    error = (want.view(-1).float() - values.float()).abs() / values.float().abs().clamp(min=1e-3)
    assert error.median() < (0.07 if bits == 8 else 0.13)  # (3 mantissa bits; e2m3 less range)
    assert encode(raw, "bfloat16", "raw") is raw and decode(raw, "bfloat16", "raw") is raw


ENCODING_FORMATS = {"mxfp8": "e4m3", "mxfp6": "e2m3"}


def test_a_worker_asking_for_an_unknown_encoding_does_not_start_its_port(ckpt):
    async def main():
        worker = Worker(LLM(model=ckpt, **ENGINE).engine, 8, "w")
        worker.start()
        try:
            with pytest.raises(ValueError, match="kv_transfer.encoding"):
                await KVNode.start(worker, TransferOptions(secret=SECRET, encoding="zip"),
                                   "127.0.0.1", prefill_tokens_per_s=10.0)
            assert worker.kv_puller is None
        finally:
            worker.shutdown()
    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_pull_asking_for_mxfp8_imports_the_mx_round_trip_of_the_holders_blocks(ckpt):
    """Both sides in fp32: the receiver's pulled blocks are exactly the holder's after MX
    encoding and decoding, the wire carried about a quarter of the raw bytes, the blocks count
    as cached and the request completes."""
    async def main():
        async with _workers(ckpt, encoding="mxfp8") as ((holder, receiver), (h_node, r_node)):
            await _generate(holder, PROMPTS[0])
            tokens, cached = await _generate(receiver, PROMPTS[1], _source(h_node))
            assert len(tokens) == 12 and cached == 96
            layout = r_node.puller.layout
            assert r_node.puller.counts["ok"] == 1
            assert r_node.puller.counts["bytes"] == 6 * wire_bytes_per_block(layout, "mxfp8")
            assert 3.5 < layout.bytes_per_block / wire_bytes_per_block(layout, "mxfp8") < 4
            hashes = receiver.engine.make_request(PROMPTS[1]).block_hashes[:6]
            held = h_node.service.io.read(holder.engine.kv.lookup_prefix(hashes))
            pulled = r_node.puller.io.read(receiver.engine.kv.lookup_prefix(hashes))
            assert pulled != held
            assert pulled == decode(encode(held, "float32", "mxfp8"), "float32", "mxfp8")
            await asyncio.sleep(0.05)
            _check_pools((holder, receiver))
    asyncio.run(asyncio.wait_for(main(), 120))


def test_the_transfer_port_refuses_bad_calls_with_a_clear_status(ckpt):
    async def call(node: KVNode, request: pb.PullRequest, secret: str | None = SECRET):
        async with grpc.aio.insecure_channel(node.address) as channel:
            metadata = ((SECRET_KEY, secret),) if secret is not None else None
            stream = pb_grpc.KVTransferStub(channel).Pull(request, metadata=metadata)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in stream:
                    pass
            return e.value.code(), e.value.details()

    async def main():
        async with _workers(ckpt, max_blocks=16) as ((holder, _), (h_node, _)):
            await _generate(holder, PROMPTS[0])
            layout = h_node.service.layout
            hashes = [h.to_bytes(16, "big") for h in
                      holder.engine.make_request(PROMPTS[0]).block_hashes]
            good = pb.PullRequest(layout=layout_to_pb(layout), block_hashes=hashes)
            code, details = await call(h_node, good, secret=None)
            assert code == grpc.StatusCode.UNAUTHENTICATED and SECRET_KEY in details
            assert (await call(h_node, good, secret="wrong"))[0] == \
                grpc.StatusCode.UNAUTHENTICATED
            for field, value in (("model_id", "other"), ("block_size", 32), ("dtype", "float16"),
                                 ("version", 9)):
                bad = pb.PullRequest(block_hashes=hashes)
                bad.layout.CopyFrom(layout_to_pb(layout))
                setattr(bad.layout, field, value)
                code, details = await call(h_node, bad)
                assert code == grpc.StatusCode.FAILED_PRECONDITION and field in details
            code, details = await call(h_node, pb.PullRequest(
                layout=layout_to_pb(layout), block_hashes=hashes * 3))  # 18 > 16
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "block_hashes" in details
            code, details = await call(h_node, pb.PullRequest(
                layout=layout_to_pb(layout), block_hashes=[b"short"]))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "block_hashes" in details
            code, details = await call(h_node, pb.PullRequest(
                layout=layout_to_pb(layout), block_hashes=hashes, encoding="zip"))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("encoding")
            huge = pb.PullRequest(layout=layout_to_pb(layout), block_hashes=[bytes(16)] * 9)
            huge.layout.model_id = "x" * (2 << 20)  # past the port's message cap
            assert (await call(h_node, huge))[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert h_node.service.counts["served"] == 0
            # the data port: a connection without a ticket it handed out gets nothing
            port = h_node.service.data_plane.port
            with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
                conn.sendall(bytes(16))
                assert conn.recv(64) == b""  # closed
            await asyncio.sleep(0.05)
            holder.engine.kv.check_integrity()
            assert not holder.engine.kv._tables
    asyncio.run(asyncio.wait_for(main(), 120))


def test_a_pull_cancelled_while_its_blocks_are_being_pinned_leaves_none_pinned(ckpt):
    """The receiver cancels a stream (another stream of its pull failed) while the holder's
    engine thread has not yet run the pin: the pin, when it runs, is given back."""
    async def main():
        async with _workers(ckpt) as ((holder, receiver), (h_node, _)):
            await _generate(holder, PROMPTS[0])
            hashes = [h.to_bytes(16, "big") for h in
                      holder.engine.make_request(PROMPTS[0]).block_hashes]
            busy = threading.Event()
            holder.async_engine.submit(lambda engine: busy.wait(10))  # the pin waits behind
            async with grpc.aio.insecure_channel(h_node.address) as channel:
                stream = pb_grpc.KVTransferStub(channel).Pull(
                    pb.PullRequest(layout=layout_to_pb(h_node.service.layout),
                                   block_hashes=hashes), metadata=((SECRET_KEY, SECRET),))
                first = asyncio.ensure_future(stream.read())
                await asyncio.sleep(0.5)  # the service is waiting on the pin
                assert not first.done()
                stream.cancel()
                with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                    await first
            await asyncio.sleep(0.2)  # the server sees the cancel
            busy.set()
            await asyncio.sleep(0.2)  # the pin runs, then its release
            _check_pools((holder, receiver))
    asyncio.run(asyncio.wait_for(main(), 120))


def test_a_receiver_with_another_layout_imports_nothing(ckpt, tiny_checkpoint, reference):
    other = str(tiny_checkpoint("llama", num_hidden_layers=3))

    async def main():
        opts = TransferOptions(secret=SECRET)
        holder = Worker(LLM(model=ckpt, **ENGINE).engine, 8, "holder")
        receiver = Worker(LLM(model=other, **ENGINE).engine, 8, "receiver")
        nodes = []
        try:
            for w in (holder, receiver):
                w.start()
                nodes.append(await KVNode.start(w, opts, "127.0.0.1", 10.0))
            await _generate(holder, PROMPTS[0])
            # same prompt, another model: its hashes differ, so look the holder's up by hand
            source = {"address": nodes[0].address, "num_blocks": 6}
            await _generate(receiver, PROMPTS[1], source)
            counts = nodes[1].puller.counts
            assert counts["layout"] == 1 and counts["blocks"] == 0, dict(counts)
            assert receiver.engine.kv.num_free_blocks == receiver.engine.kv.num_blocks
        finally:
            for node in nodes:
                await node.stop()
            for w in (holder, receiver):
                w.shutdown()
    asyncio.run(asyncio.wait_for(main(), 120))


def test_worker_without_transfer_ignores_a_source(ckpt, reference):
    async def main():
        worker = Worker(LLM(model=ckpt, **ENGINE).engine, 8, "alone")
        worker.start()
        try:
            got = await _generate(worker, PROMPTS[1], {"address": "127.0.0.1:1", "num_blocks": 6})
            assert got == (reference[1], 0)
        finally:
            worker.shutdown()
    asyncio.run(asyncio.wait_for(main(), 60))


# ---- drain: running requests handed on to a peer through the router ---------------------------


class _LocalWorkers:
    """router.ingress.Workers over in-process Workers: a new request goes to `first`; one
    handed back goes to another worker (as the request router does)."""

    def __init__(self, workers: dict[str, Worker], first: str) -> None:
        self.workers, self.first = workers, first
        self.calls: list[tuple[str, dict]] = []

    def generate(self, prompt, params, request_id, **hints):
        resume = hints.get("resume")
        target = self.first if resume is None else \
            next(w for w in self.workers if w != resume.worker_id)
        self.calls.append((target, hints))
        return self.workers[target].generate(prompt, params, request_id,
                                             hints.get("kv_source"), resume)

    async def loads(self):
        return [w.load() for w in self.workers.values()]


def _router(ckpt, workers):
    from mxserve.router.ingress import Router
    from mxserve.router.requests import ModelCard
    from mxserve.worker.model.loader import open_checkpoint

    checkpoint = open_checkpoint(ckpt)
    card = ModelCard("tiny", 512, 256, tuple(checkpoint.config.eos_token_ids))
    return Router(checkpoint.tokenizer, card, workers)


async def _routed(router, prompt: list[int], max_tokens: int, **sampling) -> list[int]:
    request = pb_generate(prompt, max_tokens, **sampling)
    tokens = []
    async for response in router.generate(request):
        tokens += list(response.token_ids)
    return tokens


def pb_generate(prompt: list[int], max_tokens: int, **sampling):
    from mxserve.proto import mxserve_pb2 as mpb

    return mpb.GenerateRequest(
        token_ids=mpb.TokenIds(ids=prompt),
        sampling_params=mpb.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling))


@pytest.mark.parametrize("tp", [(1, 1), (2, 1)])
def test_drain_hands_running_streams_to_the_peer_with_identical_output(ckpt, tp):
    """Four streams (greedy and seeded sampling) run on one worker; it drains mid-stream. Each
    stream goes on on the other worker through the router: the tokens are the undisturbed
    run's, none repeated or missing; the peer pulled the blocks; the drained pool is empty.
    (2, 1): a tensor-parallel worker drains to a single-rank one."""
    prompts = [_ids(40 + 9 * i, 20 + i) for i in range(4)]
    sampling = [dict(temperature=0.0), dict(temperature=0.0),
                dict(temperature=0.9, seed=7), dict(temperature=0.8, top_p=0.9, seed=11)]
    llm = LLM(model=ckpt, **ENGINE)
    want = [o.token_ids for o in llm.generate(prompts, [
        SamplingParams(max_tokens=64, ignore_eos=True, **s) for s in sampling])]

    async def main():
        async with _workers(ckpt, tp) as ((a, b), (a_node, b_node)):
            workers = _LocalWorkers({"w0": a, "w1": b}, first="w0")
            router = _router(ckpt, workers)
            tasks = [asyncio.create_task(_routed(router, p, 64, **s))
                     for p, s in zip(prompts, sampling)]
            while a.num_output_tokens < 4 * 20:  # well into every stream
                await asyncio.sleep(0.01)
            moved = await a.drain()
            got = await asyncio.gather(*tasks)
            assert moved == 4 and a.num_migrated_out == 4 and b.num_resumed == 4
            assert got == want
            assert b_node.puller.counts["ok"] >= 1, dict(b_node.puller.counts)
            resumed = [h for w, h in workers.calls if "resume" in h]
            assert len(resumed) == 4 and all(w == "w1" for w, h in workers.calls if "resume" in h)
            # a new request to the drained worker is handed on too
            assert await _routed(router, prompts[0], 64, **sampling[0]) == want[0]
            await asyncio.sleep(0.05)
            assert not a.engine.kv._tables and not b.engine.kv._tables
            a.engine.kv.check_integrity()
            b.engine.kv.check_integrity()
    asyncio.run(asyncio.wait_for(main(), 180))


def test_a_stream_whose_worker_is_lost_goes_on_elsewhere_from_its_output_so_far(ckpt):
    """The worker's stream breaks mid-request (WorkerLostError, what HandleWorkers raises when
    Serve's replica died): the router re-issues the prompt + output so far on the other
    worker; the client gets the undisturbed run's greedy tokens, none repeated."""
    from mxserve.api.errors import WorkerLostError

    prompt = _ids(30, 40)
    want = LLM(model=ckpt, **ENGINE).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))[0].token_ids

    class Breaking(_LocalWorkers):
        def generate(self, prompt, params, request_id, **hints):
            inner = super().generate(prompt, params, request_id, **hints)
            if "resume" in hints:
                return inner

            async def broken():
                n = 0
                async for out in inner:
                    yield out
                    n += len(out.new_token_ids)
                    if n >= 10:
                        await inner.aclose()
                        raise WorkerLostError("its worker is gone (test)", "w0")
            return broken()

    async def main():
        async with _workers(ckpt) as ((a, b), _):
            workers = Breaking({"w0": a, "w1": b}, first="w0")
            got = await _routed(_router(ckpt, workers), prompt, 48, temperature=0.0)
            assert got == want
            (target, hints), = [c for c in workers.calls if "resume" in c[1]]
            assert target == "w1" and len(hints["resume"].output_token_ids) >= 10
            await asyncio.sleep(0.05)
            assert not a.engine.kv._tables and not b.engine.kv._tables
    asyncio.run(asyncio.wait_for(main(), 120))


def _certificates(tmp_path) -> dict:
    """A CA and a certificate it signed for 127.0.0.1 (openssl), as TransferOptions' files."""
    import subprocess

    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=tmp_path)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
        "-days", "1", "-subj", "/CN=mxserve-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "worker.key", "-out", "worker.csr",
        "-subj", "/CN=127.0.0.1")
    (tmp_path / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "worker.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "worker.pem", "-days", "1", "-extfile", "san.ext")
    return dict(tls_cert=str(tmp_path / "worker.pem"), tls_key=str(tmp_path / "worker.key"),
                tls_ca=str(tmp_path / "ca.pem"))


def test_pull_over_mutual_tls_and_a_caller_without_a_certificate_is_refused(ckpt, reference,
                                                                          tmp_path):
    tls = _certificates(tmp_path)

    async def main():
        async with _workers(ckpt, num_streams=4, **tls) as ((holder, receiver), (h_node, r_node)):
            await _generate(holder, PROMPTS[0])
            assert await _generate(receiver, PROMPTS[1], _source(h_node)) == (reference[1], 96)
            assert r_node.puller.counts["ok"] == 1
            request = pb.PullRequest(layout=layout_to_pb(h_node.service.layout),
                                     block_hashes=[bytes(16)])
            ca = open(tls["tls_ca"], "rb").read()
            for channel in (grpc.aio.insecure_channel(h_node.address),  # no TLS at all
                            grpc.aio.secure_channel(h_node.address,  # TLS, no client cert
                                                    grpc.ssl_channel_credentials(ca))):
                async with channel:
                    stream = pb_grpc.KVTransferStub(channel).Pull(
                        request, metadata=((SECRET_KEY, SECRET),), timeout=5)
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        async for _ in stream:
                            pass
                    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert h_node.service.counts["served"] == 3  # the pull's 3 streams only
    asyncio.run(asyncio.wait_for(main(), 120))


def test_a_pull_runs_one_stream_for_every_four_cores(monkeypatch):
    from mxserve.cluster import kv_service

    for cores, streams in ((1, 1), (2, 1), (7, 1), (8, 2), (16, 4), (128, 4)):
        monkeypatch.setattr(kv_service.os, "sched_getaffinity", lambda _, n=cores: set(range(n)))
        assert kv_service.default_num_streams() == streams, cores
