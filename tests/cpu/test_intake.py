"""Request intake without Ray (cluster/intake.py): two started Workers over tiny engines, each
behind an IntakeServer on loopback, and a router's IntakeWorkers routing requests to them over
real TCP, the outputs coming back over a real OutputReceiver. The directory (what the cluster
reads from each replica's `record_routing_stats`) is built here from the same Worker.load()
and server targets. Streams equal the offline engine's; a burst spreads over both workers; a
worker's admission error, a cancel, a router hanging up, a worker hanging up and a wrong token
each end as the request path promises, with every KV block free."""

from __future__ import annotations

import asyncio
import struct

import pytest

from mxserve import LLM, SamplingParams
from mxserve.api.errors import INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ServeError, WorkerLostError
from mxserve.api.outputs import ResumeState
from mxserve.cluster.intake import IntakeServer, IntakeWorkers
from mxserve.cluster.output_channel import OutputReceiver, frame
from mxserve.cluster.worker import Worker
from mxserve.router.routing import PrefixRouter

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llms(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    return [LLM(model=path, dtype="float32", load_progress=False, num_kv_blocks=96,
                max_num_seqs=4) for _ in range(2)]


class Cluster:
    """Two workers with intake servers, a router's receiver and IntakeWorkers over them."""

    def __init__(self, llms, max_queued_requests: int = 4) -> None:
        self.workers = [Worker(llm.engine, max_queued_requests, worker_id=f"w{i}")
                        for i, llm in enumerate(llms)]
        self.servers = [IntakeServer(w) for w in self.workers]
        self.receiver = OutputReceiver()
        self.routed: IntakeWorkers | None = None
        self.listed = list(range(len(llms)))  # the workers the directory lists

    async def __aenter__(self) -> Cluster:
        for worker, server in zip(self.workers, self.servers):
            worker.start()
            await server.start()
        await self.receiver.start()
        self.routed = IntakeWorkers(self.receiver, self.directory, PrefixRouter(None),
                                    period_s=0.05)
        return self

    async def __aexit__(self, *exc) -> None:
        self.routed.close()
        for worker, server in zip(self.workers, self.servers):
            server.close()
            worker.shutdown()
        self.receiver.close_server()

    async def directory(self) -> list[dict]:
        entries = []
        for i in self.listed:
            engine = self.workers[i].engine
            entries.append({"worker_id": f"w{i}", "load": self.workers[i].load(),
                            "meta": {**self.servers[i].target(), "kv_address": None,
                                     "model_id": engine.model_config.model_id,
                                     "block_size": engine.kv.block_size}})
        return entries

    async def idle(self) -> list[dict]:
        for _ in range(300):
            audits = [await w.audit() for w in self.workers]
            if all(a["engine_requests"] == 0 and a["kv_blocks_used"] == 0
                   and a["in_flight"] == 0 for a in audits):
                return audits
            await asyncio.sleep(0.02)
        raise AssertionError(f"workers not idle: {audits}")


async def _collect(stream) -> tuple[list[int], list]:
    tokens, outs = [], []
    async for out in stream:
        tokens += out.new_token_ids
        outs.append(out)
    return tokens, outs


def _prompts(n: int) -> list[list[int]]:
    return [[3 + i, 40 + 2 * i, 7, 9 + i] for i in range(n)]


def test_intake_streams_equal_the_engines(llms):
    prompts = _prompts(8)
    sampled = SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True,
                             logprobs=1)
    expected = [o.token_ids for o in llms[0].generate(
        prompts,
        [GREEDY if i % 2 else sampled for i in range(8)])]

    async def main():
        async with Cluster(llms) as c:
            results = await asyncio.gather(*(
                _collect(c.routed.generate(p, GREEDY if i % 2 else sampled, f"r{i}"))
                for i, p in enumerate(prompts)))
            await c.idle()
            return results

    results = asyncio.run(main())
    assert [tokens for tokens, _ in results] == expected
    for _, outs in results:
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        assert outs[0].num_prompt_tokens == 4


def test_a_burst_lands_on_both_workers(llms):
    async def main():
        async with Cluster(llms) as c:
            await asyncio.gather(*(_collect(c.routed.generate(p, GREEDY, f"r{i}"))
                                   for i, p in enumerate(_prompts(8))))
            await c.idle()
            return [w.num_requests_total for w in c.workers], c.servers

    totals, servers = asyncio.run(main())
    assert sum(totals) == 8 and min(totals) >= 3, totals
    assert [s.num_requests for s in servers] == totals


def test_worker_errors_come_back_with_their_status(llms):
    async def main():
        async with Cluster(llms, max_queued_requests=0) as c:
            with pytest.raises(ServeError) as bad:
                await _collect(c.routed.generate([1, 10**7], GREEDY,
                                                 "bad"))
            # fill both workers (4 running each, no queue), then one more is refused
            c.listed = [0]
            await c.routed.refresh()
            long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
            streams = [c.routed.generate(p, long, f"f{i}") for i, p in enumerate(_prompts(4))]
            firsts = [await anext(s) for s in streams]
            with pytest.raises(ServeError) as full:
                await _collect(c.routed.generate([5, 6], GREEDY, "over"))
            for s in streams:
                await s.aclose()
            audits = await c.idle()
            return bad.value, full.value, firsts, audits

    bad, full, firsts, audits = asyncio.run(main())
    assert bad.code == INVALID_ARGUMENT and bad.message.startswith(bad.field), bad.message
    assert full.code == RESOURCE_EXHAUSTED and "full" in full.message
    assert all(f.new_token_ids for f in firsts)
    assert audits[0]["in_flight"] == 0 and audits[0]["kv_blocks_used"] == 0


def test_a_worker_that_refuses_as_full_passes_the_request_to_the_next_in_order(llms):
    """The policy's first choice is full (its load report was behind, or routers' shares of
    the capacity overshoot it): the request goes to the next worker in the decision's order
    and streams as the engine's; with every worker full the last refusal reaches the caller."""
    from mxserve.router.routing import Decision

    expected = llms[0].generate([[5, 6, 7]], GREEDY)[0].token_ids

    async def main():
        async with Cluster(llms, max_queued_requests=0) as c:
            await c.routed.refresh()

            async def w0_first(loads, *args):  # a stale view: w0 looks best
                return Decision(sorted(load.replica_id for load in loads), "load", 0)

            c.routed.policy.route = w0_first
            long = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
            fill = [c.workers[0].generate(p, long, f"f{i}") for i, p in enumerate(_prompts(4))]
            for s in fill:
                await anext(s)  # w0 runs 4 of 4
            tokens, _ = await _collect(c.routed.generate([5, 6, 7], GREEDY, "moved"))
            moved = (c.routed.num_refused, c.workers[1].num_requests_total)
            more = [c.workers[1].generate(p, long, f"g{i}") for i, p in enumerate(_prompts(4))]
            for s in more:
                await anext(s)  # w1 full too
            with pytest.raises(ServeError) as full:
                await _collect(c.routed.generate([5, 6, 7], GREEDY, "over"))
            for s in fill + more:
                await s.aclose()
            audits = await c.idle()
            return tokens, moved, full.value, c.routed.num_refused, audits

    tokens, moved, full, refused, audits = asyncio.run(main())
    assert tokens == expected and moved == (1, 1)
    assert full.code == RESOURCE_EXHAUSTED and "w1 is full" in full.message and refused == 3
    assert all(a["in_flight"] == a["kv_blocks_used"] == 0 for a in audits)


def test_a_worker_at_its_limit_takes_the_next_request_once_it_sent_the_last_output(
        llms, monkeypatch):
    """Four closed-loop clients on one worker of capacity 4 (no queue), each sending its next
    request the moment its last output arrives: none is refused, though the worker's event loop
    takes each new request before the wake-up that counts the finished one out (delayed here;
    under uvloop a socket's data is taken before a wake-up queued earlier from another thread,
    worker/async_engine.py `num_ending`)."""
    from mxserve.worker import async_engine

    set_all = async_engine._set_all

    def set_all_late(events: list) -> None:
        asyncio.get_running_loop().call_later(0.02, set_all, events)

    monkeypatch.setattr(async_engine, "_set_all", set_all_late)

    async def main():
        async with Cluster(llms, max_queued_requests=0) as c:
            c.listed = [0]
            await c.routed.refresh()
            short = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
            refused = []

            async def client(n: int) -> None:
                for i in range(100):
                    try:
                        await _collect(c.routed.generate([5 + n, 6, i], short, f"c{n}-{i}"))
                    except ServeError as e:
                        refused.append(e.message)

            await asyncio.gather(*(client(n) for n in range(4)))
            await c.idle()
            return refused, c.workers[0].num_requests_total

    refused, total = asyncio.run(main())
    assert refused == [] and total == 400, (refused[:3], total)


def test_a_cancel_aborts_on_the_worker_and_frees_its_blocks(llms):
    async def main():
        async with Cluster(llms) as c:
            long = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
            stream = c.routed.generate(_prompts(1)[0], long, "cancelled")
            await anext(stream)
            used = sum([(await w.audit())["kv_blocks_used"] for w in c.workers])
            await stream.aclose()  # sends "abort", at once, not when the stream is collected
            closed = (len(c.receiver._inboxes), len(c.routed.policy.dispatched))
            audits = await c.idle()
            return used, closed, audits, [w.num_requests_aborted for w in c.workers]

    used, closed, audits, aborted = asyncio.run(main())
    assert used > 0 and closed == (0, 0) and sum(aborted) == 1


def test_a_router_hanging_up_aborts_what_it_sent(llms):
    async def main():
        async with Cluster(llms) as c:
            long = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
            streams = [c.routed.generate(p, long, f"h{i}") for i, p in enumerate(_prompts(3))]
            for s in streams:
                await anext(s)
            c.routed.close()  # the router's connections go, its streams with them
            audits = await c.idle()
            return sum(w.num_requests_aborted for w in c.workers), audits

    aborted, _ = asyncio.run(main())
    assert aborted == 3


def test_a_worker_hanging_up_fails_its_streams_as_lost_and_routing_moves_on(llms):
    async def main():
        async with Cluster(llms) as c:
            long = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
            c.listed = [1]
            await c.routed.refresh()
            stream = c.routed.generate(_prompts(1)[0], long, "lost")
            await anext(stream)
            c.listed = [0, 1]
            await c.routed.refresh()
            c.servers[1].close()  # as a worker's process dying breaks the connection
            with pytest.raises(WorkerLostError) as lost:
                await _collect(stream)
            # the request goes on elsewhere (router/ingress.py passes the resume state)
            resume = ResumeState("w1", None, 0, [], None, 0, worker_lost=True)
            tokens, _ = await _collect(c.routed.generate(_prompts(1)[0], GREEDY, "again",
                                                         resume=resume))
            await c.idle()
            return lost.value, tokens, [w.num_requests_total for w in c.workers]

    lost, tokens, totals = asyncio.run(main())
    assert lost.worker_id == "w1"
    assert tokens == llms[0].generate([_prompts(1)[0]],
                                      GREEDY)[0].token_ids
    assert totals == [1, 1]


def test_a_draining_worker_hands_the_request_back(llms):
    async def main():
        async with Cluster(llms) as c:
            c.listed = [0]
            await c.routed.refresh()
            await c.workers[0].drain()
            _, outs = await _collect(c.routed.generate(_prompts(1)[0], GREEDY, "drained"))
            return outs

    outs = asyncio.run(main())
    assert len(outs) == 1 and outs[0].finish_reason == "migrate"
    assert outs[0].resume.worker_id == "w0"


def test_the_intake_drops_a_connection_without_its_token_or_with_a_bad_frame(llms):
    async def main():
        async with Cluster(llms) as c:
            host, port = c.servers[0].address.rsplit(":", 1)
            results = []
            for first in (frame("not the token"), frame(c.servers[0].token)
                          + frame(["g", "k", b"a pickle, say"]),
                          struct.pack("!I", 1 << 30)):
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(first)
                results.append(await asyncio.wait_for(reader.read(), 5))  # b"": closed
                writer.close()
            return results, c.servers[0].num_rejected, await c.idle()

    results, rejected, _ = asyncio.run(main())
    assert results == [b"", b"", b""] and rejected == 3


def test_a_request_frame_is_plain_msgpack_and_a_bad_field_fails_that_request_alone(llms):
    """The router's request frame holds no pickle (SamplingParams and ResumeState as their
    fields); fields the worker cannot make a SamplingParams of answer that request with
    INVALID_ARGUMENT naming the field (or INTERNAL for an unknown one) and the connection
    serves on."""
    import msgpack

    from mxserve.cluster.intake import _request_frame
    from mxserve.cluster.output_channel import FrameReader

    resume = ResumeState("w1", None, 0, [4, 5], b"\x00\x01", 2, worker_lost=True)
    sent = _request_frame("k", [5, 6], GREEDY, "r", {"resume": resume}, {"key": "k"})
    back = msgpack.unpackb(msgpack.packb(sent))
    assert SamplingParams(**back[3]) == GREEDY and ResumeState(*back[6]) == resume

    async def main():
        async with Cluster(llms) as c:
            host, port = c.servers[0].address.rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host, int(port))
            good = _request_frame("ok", [5, 6], GREEDY, "r2", {}, {"key": "ok"})
            writer.write(frame(c.servers[0].token)
                         + frame(["g", "neg", [5, 6], {"temperature": -1.0}, "r0", None, None,
                                  {}])
                         + frame(["g", "new", [5, 6], {"a_new_field": 1}, "r1", None, None,
                                  {}])
                         + frame(good[:-1] + [{"address": "127.0.0.1:1", "token": "t",
                                               "key": "ok"}]))
            frames, got = FrameReader(), []
            while len(got) < 3:
                got += frames.feed(await asyncio.wait_for(reader.read(1 << 16), 10))
            writer.close()
            return got, c.servers[0].num_rejected, await c.idle()

    got, rejected, _ = asyncio.run(main())
    by_key = {g[0]: g for g in got}
    assert by_key["neg"][1:3] == ["error", INVALID_ARGUMENT] and by_key["neg"][4] == "temperature"
    assert by_key["new"][1:3] == ["error", "INTERNAL"] and "a_new_field" in by_key["new"][3]
    # the third went to the engine: its output channel does not answer, so it fails UNAVAILABLE
    assert by_key["ok"][1:3] == ["error", "UNAVAILABLE"] and rejected == 0


def test_the_in_flight_autoscaling_policy_is_serves_rule_on_the_workers_reports():
    """cluster/autoscaling.InFlightPolicy on Serve's context fields (Serve applies the delays
    and bounds around it): ceil(requests the workers hold / target); no decision (the current
    target) while no replica runs or none has reported, so a deployment's start does not count
    toward a scale-down."""
    from types import SimpleNamespace

    from mxserve.cluster.autoscaling import InFlightPolicy

    policy = InFlightPolicy(target=8)

    def ask(in_flight: list[int], running: int = 2, target: int = 2) -> int:
        ctx = SimpleNamespace(aggregated_metrics={"worker_in_flight": dict(enumerate(in_flight))},
                              current_num_replicas=running, target_num_replicas=target)
        return policy(ctx)[0]

    assert ask([3, 4]) == 1
    assert ask([8, 9]) == 3
    assert ask([16, 16]) == 4
    assert ask([0, 0]) == 1
    assert ask([], target=3) == 3  # nothing reported yet
    assert ask([5], running=0, target=2) == 2  # starting
    with pytest.raises(ValueError, match="target"):
        InFlightPolicy(target=0)
