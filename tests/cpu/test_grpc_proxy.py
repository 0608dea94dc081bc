"""The servicer Serve's gRPC proxy registers: a client's cancel reaches the replica whether it
lands while the proxy awaits the next chunk or while grpc writes one (cluster/grpc_proxy.py).

`serve_like_stream` is Serve's server-streaming proxy generator in miniature (Ray 2.60,
`gRPCProxy.send_request_to_replica` and `proxy_request`): it cancels the replica's call only on a
CancelledError at its await, a close at its `yield` is caught without a cancel, and it touches
the grpc context after each chunk and at its end (a finished call's context crashes the proxy's
process). The first test shows that behaviour, so the others test the guard against it."""

from __future__ import annotations

import asyncio
from unittest.mock import Mock

import pytest

from mxserve.cluster.grpc_proxy import add_servicer, cancel_on_close


class ReplicaCall:
    """A replica's stream: chunks put in a queue; `cancelled` once the proxy cancels it."""

    def __init__(self, chunks: list[str]):
        self.queue: asyncio.Queue = asyncio.Queue()
        for chunk in chunks:
            self.queue.put_nowait(chunk)
        self.cancelled = False


class Context:
    """A grpc servicer context that records what was touched after its call had ended."""

    def __init__(self) -> None:
        self.ended = False
        self.touched_after_end: list[str] = []

    def _touch(self, name: str):
        if self.ended:
            self.touched_after_end.append(name)

    def peer(self):
        self._touch("peer")
        return "ipv4:127.0.0.1:1"

    def invocation_metadata(self):
        self._touch("invocation_metadata")
        return ()

    def set_code(self, code):
        self._touch("set_code")


async def serve_like_stream(call: ReplicaCall, context):
    context.invocation_metadata()
    try:
        while True:
            try:
                chunk = await call.queue.get()
            except asyncio.CancelledError:
                call.cancelled = True  # Serve: ProxyResponseGenerator cancels the response
                raise
            if chunk is None:
                break
            yield chunk
            context.set_code(0)
        status = "OK"
    except BaseException:  # as Serve's proxy does, GeneratorExit included
        status = "CANCELLED"
    context.peer()  # its access log
    yield status


def test_a_close_at_the_proxys_yield_does_not_cancel_without_the_guard():
    async def main():
        call = ReplicaCall(["a", "b"])
        stream = serve_like_stream(call, Context())
        assert await stream.__anext__() == "a"
        with pytest.raises(RuntimeError, match="ignored GeneratorExit"):
            await stream.aclose()
        return call.cancelled

    assert asyncio.run(main()) is False


@pytest.mark.parametrize("num_ready", [0, 1, 3])
def test_a_close_at_a_yield_cancels_the_replica_call(num_ready):
    """Closed after its first chunk, with 0, 1 or 3 more chunks already waiting."""

    async def main():
        call, context = ReplicaCall(["first"] + [f"ready{i}" for i in range(num_ready)]), Context()
        stream = cancel_on_close(serve_like_stream)(call, context)
        assert await stream.__anext__() == "first"
        context.ended = True  # grpc ended the call, then dropped its handler
        await stream.aclose()
        return call, context

    call, context = asyncio.run(main())
    assert call.cancelled
    assert call.queue.empty()
    assert context.touched_after_end == []


def test_a_cancel_at_the_await_still_cancels_and_a_finished_stream_is_left_alone():
    async def consume(stream, into):
        async for chunk in stream:
            into.append(chunk)

    async def main():
        waiting = ReplicaCall(["first"])
        got: list[str] = []
        task = asyncio.ensure_future(consume(
            cancel_on_close(serve_like_stream)(waiting, Context()), got))
        while not got:
            await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

        done = ReplicaCall(["x", "y", None])
        ended: list[str] = []
        await consume(cancel_on_close(serve_like_stream)(done, Context()), ended)
        return waiting, done, got, ended

    waiting, done, got, ended = asyncio.run(main())
    assert waiting.cancelled and got == ["first", "CANCELLED"]  # Serve's status, then its end
    assert not done.cancelled and ended == ["x", "y", "OK"]


def test_add_servicer_guards_serves_handlers_and_parses_safely():
    """On Serve's own gRPCGenericServer: every handler is a wrapper around the one Serve's
    factory made (Generate's stream also cancel-guarded), it forwards a parsed request to it,
    and a request that does not parse is answered INVALID_ARGUMENT without reaching it."""
    import grpc
    from ray.serve._private.grpc_util import gRPCGenericServer

    from mxserve.cluster.grpc_proxy import MalformedRequest
    from mxserve.proto import mxserve_pb2 as pb

    made = {}

    def factory(service_method, streaming_type):
        async def handler(request, context):
            yield (service_method, streaming_type.name, request)
        made.setdefault((service_method, streaming_type.name), []).append(handler)
        return handler

    async def build():  # grpc.aio servers are made inside a running loop
        server = gRPCGenericServer(factory)
        add_servicer(Mock(), server)
        return server

    server = asyncio.run(build())
    assert server.service_handler_factory is factory
    handlers = {}
    for generic in server.generic_rpc_handlers:
        handlers.update(generic[0]._method_handlers)
    generate = handlers["/mxserve.v1.MxServe/Generate"]
    assert generate.unary_stream not in made[("/mxserve.v1.MxServe/Generate", "UNARY_STREAM")]
    health = handlers["/mxserve.v1.MxServe/Health"]
    assert health.unary_unary not in made[("/mxserve.v1.MxServe/Health", "UNARY_UNARY")]

    parse = generate.request_deserializer
    request = pb.GenerateRequest(text="hi")
    assert parse(request.SerializeToString()) == request
    bad = [b"\xff" * 7, pb.GenerateRequest(text="x").SerializeToString()[:-1] + b"\xff"]
    malformed = [parse(data) for data in bad]
    assert all(isinstance(m, MalformedRequest) for m in malformed)
    assert "GenerateRequest" in malformed[0].message

    class Aborted(Exception):
        pass

    class AbortingContext(Context):
        async def abort(self, code, details):
            raise Aborted(code, details)

    async def first(stream):
        return await stream.__anext__()

    got = asyncio.run(first(generate.unary_stream(request, AbortingContext())))
    assert got == ("/mxserve.v1.MxServe/Generate", "UNARY_STREAM", request)
    with pytest.raises(Aborted) as e:
        asyncio.run(first(generate.unary_stream(malformed[1], AbortingContext())))
    assert e.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid mxserve.v1.GenerateRequest" in e.value.args[1]


def test_add_servicer_on_a_plain_grpc_server_serves_the_servicer():
    """Without Serve's factory the servicer's own methods answer, over loopback."""
    import grpc

    from mxserve.proto import mxserve_pb2 as pb
    from mxserve.proto.mxserve_pb2_grpc import MxServeStub

    class Servicer:
        Generate = ListModels = None  # not called here

        async def Health(self, request, context):
            return pb.HealthResponse(healthy=True)

    async def main():
        server = grpc.aio.server()
        add_servicer(Servicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                return await MxServeStub(channel).Health(pb.HealthRequest(), timeout=10)
        finally:
            await server.stop(None)

    assert asyncio.run(main()).healthy


def test_proxy_admission_sheds_past_the_published_capacity_and_counts_calls_out():
    """The proxy's first shed: up to the app's published capacity calls pass, the next is
    answered RESOURCE_EXHAUSTED with a retry hint without reaching the handler, a finished
    call makes room again; other apps and calls naming no app are not limited."""
    import grpc

    from mxserve.cluster.grpc_proxy import ProxyAdmission

    published = {"a": {"capacity": 2, "retry_after_s": 0.5}}
    admission = ProxyAdmission(published.get, refresh_s=0.01)
    reached = []

    async def handler(request, context):
        reached.append(request)
        yield request
        await asyncio.sleep(3600)  # a long stream, until closed

    class Aborted(Exception):
        pass

    class AppContext(Context):
        def __init__(self, app):
            super().__init__()
            self.app = app

        def invocation_metadata(self):
            return (("application", self.app),) if self.app else ()

        async def abort(self, code, details, trailing_metadata=()):
            raise Aborted(code, details, dict(trailing_metadata))

    async def main():
        wrapped = admission.wrap(handler)
        first = wrapped("r1", AppContext("a"))
        assert await anext(first) == "r1"  # before any limit is read: admitted
        await asyncio.sleep(0.05)  # the refresher has read "a"'s capacity
        second = wrapped("r2", AppContext("a"))
        assert await anext(second) == "r2"
        with pytest.raises(Aborted) as e:
            await anext(wrapped("r3", AppContext("a")))
        code, details, trailing = e.value.args
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "capacity 2" in details
        assert trailing == {"retry-after-ms": "500"}
        for app in ("b", None):  # no capacity published, or no app named
            assert await anext(wrapped(f"{app}", AppContext(app))) == f"{app}"
        await first.aclose()  # a call ends: room for one more
        assert await anext(wrapped("r4", AppContext("a"))) == "r4"
        return dict(admission.in_flight)  # (asyncio.run closes the open streams after)

    in_flight = asyncio.run(main())
    assert reached == ["r1", "r2", "b", "None", "r4"] and admission.num_shed == 1
    assert in_flight["a"] == 2  # r2 and r4 still open
