"""Direct output streams without Ray (cluster/output_channel.py): a started Worker over a tiny
engine sends a request's outputs from its engine thread over real TCP on loopback to an
OutputReceiver, as a router with `streaming.direct` gets them. The tokens equal those of the
Serve path (the generator's items) under coalescing; the generator itself yields nothing; a
cancel, a channel that cannot connect and a connection without the token each end cleanly with
every KV block free."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest

from mxserve import LLM, SamplingParams
from mxserve.api.errors import UNAVAILABLE, ServeError
from mxserve.cluster.output_channel import OutputReceiver, OutputSender, frame
from mxserve.cluster.worker import Worker

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(model=str(tiny_checkpoint("llama")), dtype="float32", load_progress=False,
               num_kv_blocks=96, max_num_seqs=8)


def _worker(llm, **packing) -> Worker:
    worker = Worker(llm.engine, max_queued_requests=8, **packing)
    worker.start()
    return worker


def _run(worker: Worker, coro):
    """asyncio.run(coro), the worker shut down after, whatever happens."""
    try:
        return asyncio.run(coro)
    finally:
        worker.shutdown()


async def _direct(worker: Worker, receiver: OutputReceiver, prompt, params, rid: str):
    """(the outputs that came over the channel, what the generator yielded)."""
    key = f"k-{rid}"
    inbox = receiver.open(key)
    yielded = [o async for o in worker.generate(prompt, params, rid,
                                                stream_to=receiver.target(key))]
    outs = []
    while not outs or not outs[-1].finished:
        outs.append(await asyncio.wait_for(inbox.get(), 10))
    receiver.close(key)
    return outs, yielded


async def _idle(worker: Worker) -> dict:
    for _ in range(200):
        audit = await worker.audit()
        if audit["engine_requests"] == 0 and audit["streams"] == 0:
            return audit
        await asyncio.sleep(0.02)
    return audit


def test_outputs_over_the_channel_equal_the_generators(llm):
    """Eight streams at once, coalesced (streams_per_token 2: up to 4 tokens a message): the
    channel's tokens for each equal the plain generator's and the offline ones; the last has
    the finish reason and counts; the worker's counters are what the Serve path counts."""
    prompts = [[5 + i, 6, 7, 8] for i in range(8)]
    expected = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    worker = _worker(llm, streams_per_token=2, max_tokens_per_message=4)

    async def run():
        receiver = OutputReceiver()
        await receiver.start()
        try:
            results = await asyncio.gather(*(_direct(worker, receiver, p, GREEDY, f"r{i}")
                                             for i, p in enumerate(prompts)))
            return results, receiver.num_connections, receiver.num_frames, await _idle(worker)
        finally:
            receiver.close_server()

    results, connections, frames, audit = _run(worker, run())
    messages = 0
    for (outs, yielded), want in zip(results, expected):
        assert yielded == []  # the Serve call carries no token
        assert [t for o in outs for t in o.new_token_ids] == want
        assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 24
        assert outs[0].num_prompt_tokens == 4
        messages += len(outs)
    assert connections == 1  # one connection for the pair, however many requests
    assert frames < messages  # a frame carries a step's messages for every stream
    assert messages < 8 * 24  # coalesced
    assert worker.num_output_tokens == 8 * 24 and worker.num_requests_total == 8
    assert audit["kv_blocks_used"] == 0 and worker.num_in_flight == 0


def test_a_long_direct_stream_holds_few_messages_for_its_consumer(llm):
    """A lone stream sends a token a message; its consumer (which counts them) is woken every
    DIRECT_WAKE_EVERY messages, so the messages it has not taken stay few, not the whole
    request."""
    from mxserve.worker.async_engine import DIRECT_WAKE_EVERY

    worker = _worker(llm)
    params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)

    async def run():
        receiver = OutputReceiver()
        await receiver.start()
        most, done = 0, False

        async def watch():
            nonlocal most
            while not done:
                stream = worker.async_engine._streams.get("long")
                if stream is not None:
                    most = max(most, len(stream._items))
                await asyncio.sleep(0)
        watcher = asyncio.ensure_future(watch())
        outs, _ = await _direct(worker, receiver, [5, 6, 7], params, "long")
        done = True
        await watcher
        receiver.close_server()
        return outs, most

    outs, most = _run(worker, run())
    assert sum(len(o.new_token_ids) for o in outs) == 300 and len(outs) > 2 * DIRECT_WAKE_EVERY
    assert 0 < most <= 2 * DIRECT_WAKE_EVERY, most
    assert worker.num_output_tokens == 300


def test_cancel_aborts_the_request_and_frees_its_blocks(llm):
    worker = _worker(llm)

    async def run():
        receiver = OutputReceiver()
        await receiver.start()
        inbox = receiver.open("k")
        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        gen = worker.generate([5, 6, 7], params, "long", stream_to=receiver.target("k"))
        task = asyncio.ensure_future(anext(gen, None))
        first = await asyncio.wait_for(inbox.get(), 10)  # it runs
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await gen.aclose()
        audit = await _idle(worker)
        receiver.close_server()
        return first, audit

    first, audit = _run(worker, run())
    assert first.new_token_ids and not first.finished
    assert audit["kv_blocks_used"] == 0 and audit["engine_requests"] == 0
    assert worker.num_requests_aborted == 1


def test_a_router_that_hangs_up_is_forgotten_by_the_worker(llm):
    """An idle sender sees its router close the connection (a router replica gone) and the
    worker drops it; the next request to a new receiver gets a new sender."""
    worker = _worker(llm)

    async def run():
        first = OutputReceiver()
        await first.start()
        await _direct(worker, first, [5, 6], SamplingParams(max_tokens=2, ignore_eos=True), "a")
        had = len(worker._senders)
        first.close_server()
        for _ in range(100):
            if not worker._senders:
                break
            await asyncio.sleep(0.05)
        gone = not worker._senders
        second = OutputReceiver()
        await second.start()
        outs, _ = await _direct(worker, second, [5, 6], SamplingParams(
            max_tokens=3, ignore_eos=True), "b")
        second.close_server()
        return had, gone, outs

    had, gone, outs = _run(worker, run())
    assert had == 1 and gone
    assert sum(len(o.new_token_ids) for o in outs) == 3


def test_a_channel_that_cannot_connect_fails_the_request_unavailable(llm):
    worker = _worker(llm)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"

    async def run():
        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        with pytest.raises(ServeError) as e:
            async for _ in worker.generate([5, 6, 7], params, "r", stream_to={
                    "address": dead, "token": "t", "key": "k"}):
                pass
        return e.value, await _idle(worker)

    error, audit = _run(worker, run())
    assert error.code == UNAVAILABLE and dead in error.message
    assert audit["kv_blocks_used"] == 0 and audit["engine_requests"] == 0


def test_the_receiver_drops_a_connection_without_its_token():
    async def run():
        receiver = OutputReceiver()
        await receiver.start()
        inbox = receiver.open("k")
        host, port = receiver.address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(frame("not the token") + frame([["k", b"x"]]))
        await writer.drain()
        closed = await asyncio.wait_for(reader.read(), 5) == b""  # the receiver hung up
        writer.close()
        empty = inbox.empty()
        good = OutputSender(receiver.address, receiver.token)
        good.start()
        from mxserve.api.outputs import StepOutput, encode_output
        good.send([["k", encode_output(StepOutput("r", [3], None, True, "length", 1, 0, 1))]])
        out = await asyncio.wait_for(inbox.get(), 5)
        good.close()
        receiver.close_server()
        return closed, empty, out, receiver.num_rejected, receiver.num_connections

    closed, empty, out, rejected, connections = asyncio.run(run())
    assert closed and empty and rejected == 1 and connections == 1
    assert out.new_token_ids == [3] and out.finished


def test_the_receiver_hands_on_every_frame_a_read_brings_at_once():
    """Frames that arrive together reach their queues together: none waits in the socket for
    later turns of the loop (a backlog there delays every output behind it, and outputs
    already queued go on merged). A frame split across reads arrives whole."""
    from mxserve.api.outputs import StepOutput, encode_output

    def out(i: int, last: bool = False) -> bytes:
        return encode_output(StepOutput("r", [i], None, last, "length" if last else None, 1,
                                        0, i + 1))

    async def run():
        receiver = OutputReceiver()
        await receiver.start()
        inboxes = [receiver.open(f"k{j}") for j in range(4)]
        host, port = receiver.address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        burst = frame(receiver.token) + b"".join(
            frame([[f"k{j}", out(i)] for j in range(4)]) for i in range(50))
        writer.write(burst)
        await writer.drain()
        await asyncio.wait_for(inboxes[0].get(), 5)
        together = [inbox.qsize() for inbox in inboxes]  # no await since the first came
        whole = frame([["k0", out(99, last=True)]])
        writer.write(whole[:7])
        await writer.drain()
        await asyncio.sleep(0.05)
        early = inboxes[0].qsize()
        writer.write(whole[7:])
        await writer.drain()
        while inboxes[0].qsize() < 50:
            await asyncio.sleep(0.01)
        items = [inboxes[0].get_nowait() for _ in range(50)]
        writer.close()
        receiver.close_server()
        return together, early, items, receiver.num_frames

    together, early, items, num_frames = asyncio.run(run())
    assert together == [49, 50, 50, 50]
    assert early == 49  # half a frame delivers nothing
    assert [o.new_token_ids for o in items] == [[i] for i in range(1, 50)] + [[99]]
    assert items[-1].finished and num_frames == 51


def test_the_sender_writes_from_the_callers_thread_and_keeps_order_when_the_socket_fills():
    """`send` writes a frame itself when the socket takes it at once; once a router stops
    reading and the socket fills, frames queue for the sender's thread, and every frame still
    arrives once, in order, when it reads again."""
    import struct
    import threading

    import msgpack

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    host, port = listener.getsockname()
    address = f"{host}:{port}"
    got, go = [], threading.Event()

    def router():
        conn, _ = listener.accept()
        with conn, conn.makefile("rb") as f:
            go.wait(10)
            while True:
                head = f.read(4)
                if len(head) < 4:
                    return
                got.append(msgpack.unpackb(f.read(struct.unpack("!I", head)[0])))

    reader = threading.Thread(target=router, daemon=True)
    reader.start()
    sender = OutputSender(address, "t")
    sender.start()
    for _ in range(500):  # connected and the token sent
        if sender._sock is not None:
            break
        threading.Event().wait(0.01)
    sender.send([["k", b"first"]])
    inline_at_first = sender.num_written_by_caller
    blob = bytes(64 << 10)
    for i in range(400):  # 25 MiB: more than loopback's socket buffers hold
        sender.send([["k", i.to_bytes(4, "big") + blob]])
    queued = sender.num_frames - sender.num_written_by_caller
    go.set()
    sender.close()
    sender._thread.join(30)
    reader.join(30)
    listener.close()
    assert inline_at_first == 1 and queued > 0
    assert got[0] == "t" and got[1] == [["k", b"first"]]
    assert [int.from_bytes(f[0][1][:4], "big") for f in got[2:]] == list(range(400))
    assert sender.failed is None
