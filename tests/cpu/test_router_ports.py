"""The routers' own servers (ServeConfig.ingress "routers", the default): gRPC
(cluster/router_grpc.py) and OpenAI's HTTP API (cluster/router_http.py).

Without Ray: `RouterService` on a real grpc.aio server in front of a scripted router (the router
itself is tested in test_ingress*.py; here what the wrapper adds): a deadline past
request_timeout_s ends the call DEADLINE_EXCEEDED and closes the router's stream, an overload
carries `retry-after-ms`, a malformed request is INVALID_ARGUMENT, a client's cancel closes the
router's stream.

Served, on the session's multi-node cluster (tests/cpu/conftest.py `served`, whose Serve proxies
also reach this app): two routers share each port, calls through it answer as the offline
engine and as the proxy path do, bad input and a wrong key get their status, a cancel frees the
worker's KV blocks; the official `openai` client on the routers' HTTP port gets the proxy
path's answers, and a client that disconnects mid-stream frees its blocks.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import time

import grpc
import pytest

from mxserve import SamplingParams
from mxserve.api.errors import ServeError
from mxserve.cluster.config import Resources, ServeConfig
from mxserve.cluster.redis_server import free_fixed_port, free_port
from mxserve.cluster.router_grpc import RouterGrpcServer
from mxserve.cluster.router_http import RouterHttpServer
from mxserve.proto import mxserve_pb2 as pb
from mxserve.proto import mxserve_pb2_grpc as pb_grpc

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

MB = 2**20


class ScriptedRouter:
    """Streams `tokens` responses `delay_s` apart, or raises `error` first; records how each
    stream ended."""

    def __init__(self, tokens: int = 3, delay_s: float = 0.0, error: ServeError | None = None):
        self.tokens, self.delay_s, self.error = tokens, delay_s, error
        self.ended: list[str] = []
        self.metadata: list = []

    async def generate(self, request, metadata=()):
        self.metadata.append(dict(metadata))
        try:
            if self.error is not None:
                raise self.error
            for i in range(self.tokens):
                await asyncio.sleep(self.delay_s)
                yield pb.GenerateResponse(token_ids=[i])
            self.ended.append("finished")
        except asyncio.CancelledError:
            self.ended.append("cancelled")
            raise
        except GeneratorExit:
            self.ended.append("closed")
            raise

    async def list_models(self, metadata=()):
        raise ServeError("UNAUTHENTICATED", "authorization: no bearer token")

    async def health(self, metadata=()):
        return pb.HealthResponse(healthy=True)


def _serve(router, timeout_s=None):
    """Run `body(stub)` against `router` served on a free port."""

    async def run(body):
        port = free_port()
        server = RouterGrpcServer(router, timeout_s)
        await server.start("127.0.0.1", port)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                return await body(pb_grpc.MxServeStub(channel), channel)
        finally:
            await server.stop(0)

    return lambda body: asyncio.run(run(body))


def test_router_service_streams_and_passes_metadata():
    router = ScriptedRouter(tokens=4)

    async def body(stub, channel):
        call = stub.Generate(pb.GenerateRequest(text="hi"), metadata=(("x-k", "v"),))
        ids = [r.token_ids[0] async for r in call]
        health = await stub.Health(pb.HealthRequest())
        return ids, health.healthy

    assert _serve(router)(body) == ([0, 1, 2, 3], True)
    assert router.ended == ["finished"] and router.metadata[0]["x-k"] == "v"


def test_router_service_statuses():
    overloaded = ScriptedRouter(error=ServeError(
        "RESOURCE_EXHAUSTED", "the server is at capacity; retry after 2.5 s"))

    async def body(stub, channel):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in stub.Generate(pb.GenerateRequest(text="hi")):
                pass
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "retry after 2.5 s" in e.value.details()
        assert ("retry-after-ms", "2500") in tuple(e.value.trailing_metadata())
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.ListModels(pb.ListModelsRequest())
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "authorization" in e.value.details()
        raw = channel.unary_stream("/mxserve.v1.MxServe/Generate")
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in raw(b"\xff\xff\xff"):
                pass
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "mxserve.v1.GenerateRequest" in e.value.details()

    _serve(overloaded)(body)


def test_router_service_deadline_and_cancel_close_the_routers_stream():
    slow = ScriptedRouter(tokens=100, delay_s=0.05)

    async def past_deadline(stub, channel):
        got = []
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for r in stub.Generate(pb.GenerateRequest(text="hi")):
                got.append(r)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "request_timeout_s (0.3 s)" in e.value.details()
        assert 2 <= len(got) < 10

    _serve(slow, timeout_s=0.3)(past_deadline)
    assert slow.ended == ["cancelled"]

    cancelled = ScriptedRouter(tokens=100, delay_s=0.05)

    async def cancel(stub, channel):
        call = stub.Generate(pb.GenerateRequest(text="hi"))
        await call.read()
        call.cancel()
        deadline = time.monotonic() + 5
        while not cancelled.ended and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    _serve(cancelled)(cancel)
    assert cancelled.ended == ["cancelled"]


def test_ingress_config():
    assert ServeConfig().ingress == "routers"
    with pytest.raises(ValueError, match=r"grpc_port \(9000\), http_port \(9000\)"):
        ServeConfig(http_port=9000)
    with pytest.raises(ValueError, match="ingress"):
        ServeConfig(ingress="envoy")


def test_a_port_held_by_another_server_is_an_error_naming_it():
    import socket

    async def main():
        with socket.socket() as busy:  # a listener that does not share its port
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            port = busy.getsockname()[1]
            with pytest.raises(OSError, match=f"grpc_port: cannot listen on 127.0.0.1:{port}"):
                await RouterGrpcServer(ScriptedRouter()).start("127.0.0.1", port)
            with pytest.raises(OSError, match=f"http_port: cannot listen on 127.0.0.1:{port}"):
                await RouterHttpServer(None).start("127.0.0.1", port)

    asyncio.run(main())


def test_two_http_servers_share_a_port_and_a_disconnect_cancels_the_stream():
    from starlette.responses import JSONResponse, StreamingResponse

    ended: list[str] = []

    def handler(name):
        async def handle(request):
            if request.url.path == "/who":
                return JSONResponse({"server": name})

            async def events():
                try:
                    for i in range(1000):
                        yield f"data: {i}\n\n"
                        await asyncio.sleep(0.02)
                    ended.append("finished")
                except asyncio.CancelledError:
                    ended.append("cancelled")
                    raise
            return StreamingResponse(events(), media_type="text/event-stream")
        return handle

    def get(port, path):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", path)
        return conn, conn.getresponse()

    async def main():
        port = free_fixed_port()
        servers = [RouterHttpServer(handler("a")), RouterHttpServer(handler("b"))]
        for server in servers:
            await server.start("127.0.0.1", port, grace_s=1.0)
        try:
            seen = set()
            for _ in range(32):  # a new connection each: the kernel spreads them
                conn, reply = await asyncio.to_thread(get, port, "/who")
                seen.add(json.loads(reply.read())["server"])
                conn.close()
            conn, reply = await asyncio.to_thread(get, port, "/stream")
            assert (await asyncio.to_thread(reply.readline)).startswith(b"data: 0")
            conn.close()  # the client goes away mid-stream
            deadline = time.monotonic() + 5
            while not ended and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            return seen, sum(s.num_calls for s in servers)
        finally:
            for server in servers:
                await server.stop()

    seen, calls = asyncio.run(main())
    assert seen == {"a", "b"} and calls == 33
    assert ended == ["cancelled"]


# ---- served -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ingress(served):
    from ray import serve

    nodes = served.add_nodes(1, num_cpus=1, resources={"ingress_node": 1},
                             object_store_memory=128 * MB)
    app = served.deploy(app_name="ingress", num_workers=1, num_routers=2,
                        engine=dict(served.config.engine), ingress="routers",
                        grpc_port=free_fixed_port(), http_port=free_fixed_port(),
                        api_key="key-1",
                        worker_resources=Resources(num_cpus=0.25,
                                                   resources={"ingress_node": 1}))
    try:
        yield app
    finally:
        serve.delete(app.app_name)
        served.remove_nodes(nodes)


def _client(app, own_connection: bool = False, **kwargs):
    """A client of the routers' port. own_connection: its channel opens a connection of its
    own (grpc shares one between a process's channels to the same address, and the kernel
    spreads connections, not calls, over the routers)."""
    from mxserve.cluster.client import Client

    endpoint = f"localhost:{app.grpc_port}"
    client = Client(endpoint, None, **{"api_key": "key-1", **kwargs})
    if own_connection:
        client.channel.close()
        client.channel = grpc.insecure_channel(endpoint, options=[
            ("grpc.use_local_subchannel_pool", 1)])
        client.stub = pb_grpc.MxServeStub(client.channel)
    return client


def _routers_calls(app) -> dict[str, int]:
    """Calls each router replica's own server has taken, by replica id."""
    from ray import serve

    handle = serve.get_deployment_handle("Router", app_name=app.app_name)
    seen: dict[str, int] = {}
    for _ in range(40):
        audit = handle.audit.remote().result(timeout_s=60)
        seen[audit["replica_id"]] = audit["router_grpc"]["calls"]
        if len(seen) == 2:
            break
    return seen


def test_the_routers_port_answers_as_offline_and_as_the_proxy(served, ingress):
    from concurrent.futures import ThreadPoolExecutor

    prompts = [f"w{3 + i} w{40 + i}" for i in range(16)]
    params = [dict(temperature=0, max_tokens=12, ignore_eos=True) if i % 2 else
              dict(temperature=1.0, seed=i, max_tokens=12, ignore_eos=True, logprobs=1)
              for i in range(16)]
    expected = served.llm.generate(prompts, [SamplingParams(**p) for p in params])

    def one(i):  # each call its own connection: spread over the routers
        with _client(ingress, own_connection=True) as client:
            return served.streamed(client, prompts[i], **params[i])

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(one, range(16)))
    assert got == [(e.token_ids, e.text, "length", 12) for e in expected]
    calls = _routers_calls(ingress)
    assert len(calls) == 2 and sum(calls.values()) >= 16 and all(calls.values()), calls

    with served.client(ingress.app_name, api_key="key-1") as client:  # the proxy path
        assert client.generate(prompts[1], **params[1]).token_ids == expected[1].token_ids
    with _client(ingress) as client:
        assert client.list_models().models[0].max_model_len > 0


def test_the_routers_port_rejects_bad_input_and_frees_a_cancelled_requests_blocks(
        served, ingress):
    with _client(ingress, api_key="wrong") as client:
        with pytest.raises(grpc.RpcError) as e:
            client.generate("w7", max_tokens=3)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with _client(ingress) as client:
        with pytest.raises(grpc.RpcError) as e:
            client.generate("w7", max_tokens=0)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "max_tokens" in e.value.details()
        raw = client.channel.unary_stream("/mxserve.v1.MxServe/Generate")
        with pytest.raises(grpc.RpcError) as e:
            list(raw(b"\x0a\x05\xff\xfe\xfd\xfc\xfb", metadata=client.metadata))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        for _ in range(3):  # (as test_serve_cluster's cancel: the tiny model may finish first)
            aborted = sum(w.num_requests_aborted for w in _idle(served, ingress))
            stream = client.stream("w7 w8", max_tokens=480, ignore_eos=True)
            next(stream)
            stream.close()
            loads = _idle(served, ingress)
            if sum(w.num_requests_aborted for w in loads) == aborted + 1:
                break
        else:
            pytest.fail("no cancel reached the worker before its request finished")
        assert len(client.generate("w7", max_tokens=3, ignore_eos=True).token_ids) == 3


def test_the_routers_http_port_answers_as_the_proxy_and_frees_a_dropped_stream(served, ingress):
    import openai

    messages = [{"role": "user", "content": "w40 w41 w42"}]
    expected = served.llm.chat(messages, SamplingParams(temperature=0, max_tokens=12,
                                                        ignore_eos=True))[0]
    answers = {}
    for name, base_url in (  # the same paths on both, below the app's route prefix
            ("router", f"http://127.0.0.1:{ingress.http_port}{ingress.route_prefix}/v1"),
            ("proxy", f"http://127.0.0.1:{served.config.http_port}{ingress.route_prefix}/v1")):
        with openai.OpenAI(base_url=base_url, api_key="key-1", max_retries=0,
                           timeout=60) as client:
            out = client.chat.completions.create(
                model=ingress.served_model_name, messages=messages, temperature=0,
                max_tokens=12, extra_body={"ignore_eos": True})
            streamed = client.chat.completions.create(
                model=ingress.served_model_name, messages=messages, temperature=0,
                max_tokens=12, extra_body={"ignore_eos": True}, stream=True)
            text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
            answers[name] = (out.choices[0].message.content, text,
                             out.usage.completion_tokens)
    assert answers["router"] == answers["proxy"] == (expected.text, expected.text, 12)

    with openai.OpenAI(base_url=f"http://127.0.0.1:{ingress.http_port}{ingress.route_prefix}/v1",
                       api_key="wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError):
            client.models.list()

    before = sum(w.num_requests_aborted for w in _idle(served, ingress))
    body = {"model": ingress.served_model_name, "prompt": "w5 w6 w7", "max_tokens": 480,
            "ignore_eos": True, "stream": True}
    conn = http.client.HTTPConnection("127.0.0.1", ingress.http_port, timeout=30)
    conn.request("POST", f"{ingress.route_prefix}/v1/completions", json.dumps(body),
                 {"content-type": "application/json", "authorization": "Bearer key-1"})
    reply = conn.getresponse()
    assert reply.status == 200
    events = 0
    while events < 3:
        events += reply.readline().startswith(b"data: {")
    conn.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 20
    while sum(w.num_requests_aborted for w in _idle(served, ingress)) == before:
        assert time.monotonic() < deadline, "the worker never aborted the request"
        time.sleep(0.1)


def _idle(served, app):
    return served.wait_idle(app.app_name, api_key="key-1")  # (the app has a key)
