"""Reliability and security of the served path, on the session's cluster (conftest `served`)
plus one node for a second app with token auth on (`secure`): a fuzzed API, a cancel storm,
overload at 10x capacity, token auth. Real processes throughout: Ray Serve's gRPC proxy, the
router and worker replicas, gRPC over loopback.

The fuzz generator is seeded; the seed is printed (`-s` shows it) and MXSERVE_FUZZ_SEED
replays it."""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import struct
import time

import grpc
import pytest

from mxserve.cluster.config import Resources
from mxserve.cluster.local import worker_pids
from mxserve.proto import mxserve_pb2 as pb

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

MB = 2**20
TOKEN = "tok-" + os.urandom(12).hex()  # the secure app's API key (looked for in the logs)
GENERATE = "/mxserve.v1.MxServe/Generate"
ANSWERS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
           grpc.StatusCode.UNAUTHENTICATED}


def _audits(app: str, deployment: str) -> list[dict]:
    """Every replica's `audit()` (a handle call reaches one replica: repeated until each of
    the deployment's replicas has answered)."""
    from ray import serve

    handle = serve.get_deployment_handle(deployment, app_name=app)
    want, seen = len(worker_pids(app, deployment)), {}
    for _ in range(400):
        audit = handle.audit.remote().result(timeout_s=60)
        seen[audit["replica_id"]] = audit
        if len(seen) == want:
            return [seen[k] for k in sorted(seen)]
    raise AssertionError(f"only {len(seen)} of {want} {deployment} replicas answered")


@pytest.fixture(scope="module")
def secure(served):
    """App "secure" on a node of its own: auth on, one worker of capacity 4 (4 running, no
    queue)."""
    from ray import serve

    (node,) = served.add_nodes(1, num_cpus=2, resources={"secure_node": 1},
                               object_store_memory=128 * MB)
    config = served.deploy(
        app_name="secure", num_workers=1, api_key=TOKEN, max_queued_requests=0,
        engine={**served.config.engine, "max_num_seqs": 4},
        worker_resources=Resources(num_cpus=0.5, resources={"secure_node": 1}))
    try:
        yield config
    finally:
        serve.delete("secure")
        served.remove_nodes([node])


def _metadata(app: str, token: str | None = TOKEN) -> tuple:
    return (("application", app),) + ((("authorization", f"Bearer {token}"),) if token else ())


# ---- the fuzz generator ------------------------------------------------------------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field, written by hand (it may hold invalid UTF-8)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _valid(rng: random.Random) -> pb.GenerateRequest:
    request = pb.GenerateRequest(sampling_params=pb.SamplingParams(max_tokens=4, temperature=0))
    kind = rng.randrange(3)
    if kind == 0:
        request.text = "w5 w6 w7"
    elif kind == 1:
        request.chat.messages.add(role="user", content="w5 w6")
    else:
        request.token_ids.ids.extend([5, 6, 7])
    return request


def _bad_value(rng: random.Random, low_ok: float, high_ok: float):
    """A value outside [low_ok, high_ok], or not finite."""
    return rng.choice([low_ok - 1, high_ok + 1, low_ok - 1e9, high_ok + 1e9, math.nan,
                       math.inf, -math.inf, low_ok - 1e-6, high_ok + 1e-6])


def _mutations(vocab_size: int, max_model_len: int):
    """Each takes (rng, request) and makes the request invalid in one field."""
    sp = "sampling_params"

    def set_sp(name, value):
        def apply(rng, r):
            setattr(getattr(r, sp), name, value(rng) if callable(value) else value)
        return apply

    def clamp32(x):
        return int(max(-2**31, min(2**31 - 1, x)))

    def prompt_text(value):
        def apply(rng, r):
            r.text = value(rng)
        return apply

    def chat(messages):
        def apply(rng, r):
            r.chat.CopyFrom(pb.ChatMessages(messages=[pb.ChatMessage(role=a, content=b)
                                                      for a, b in messages(rng)]))
        return apply

    def token_ids(ids):
        def apply(rng, r):
            r.token_ids.CopyFrom(pb.TokenIds(ids=ids(rng)))
        return apply

    def clear_prompt(rng, r):
        r.ClearField(r.WhichOneof("prompt"))

    def rand_text(rng, n):
        return "".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(0x80, 0xD7FF)]))
                       for _ in range(n))

    return [
        set_sp("temperature", lambda g: g.choice([-1.0, -1e-300, math.nan, math.inf,
                                                  -math.inf])),
        set_sp("top_p", lambda g: g.choice([0.0, -0.5, 1.0001, math.nan, math.inf, 2.0])),
        set_sp("top_k", lambda g: g.choice([-2, -2**31, -7])),
        set_sp("min_p", lambda g: g.choice([-0.1, 1.5, math.nan, -math.inf])),
        set_sp("repetition_penalty", lambda g: g.choice([0.0, -1.0, math.nan, math.inf])),
        set_sp("presence_penalty", lambda g: _bad_value(g, -2, 2)),
        set_sp("frequency_penalty", lambda g: _bad_value(g, -2, 2)),
        set_sp("max_tokens", lambda g: g.choice([0, -1, -2**31])),
        set_sp("min_tokens", lambda g: g.choice([-1, -2**31, 5])),  # 5 > max_tokens 4
        set_sp("logprobs", lambda g: clamp32(g.choice([-1, 21, 2**31 - 1, -2**31]))),
        lambda g, r: r.sampling_params.stop.extend([""] if g.random() < 0.5
                                                   else ["s"] * g.randrange(65, 5000)),
        lambda g, r: r.sampling_params.stop.append("x" * g.randrange(1025, 100_000)),
        lambda g, r: r.sampling_params.stop_token_ids.extend(
            [g.randrange(-2**31, 0)] if g.random() < 0.5 else [1] * g.randrange(1025, 50_000)),
        lambda g, r: setattr(r, "model", g.choice(["gpt-4", rand_text(g, g.randrange(1, 40)),
                                                   "m" * g.randrange(1000, 200_000)])),
        lambda g, r: setattr(r, "request_id", "r" * g.randrange(257, 100_000)),
        clear_prompt,
        prompt_text(lambda g: ""),
        prompt_text(lambda g: rand_text(g, 20) * g.randrange(1000, 50_000)),  # past the cap
        chat(lambda g: []),
        chat(lambda g: [(g.choice(["", "wizard", "USER", "\x00", "user "]), "hi")]),
        chat(lambda g: [("user", "w5")] * g.randrange(1025, 20_000)),
        chat(lambda g: [("user", "w5 " * g.randrange(6000, 300_000))]),
        token_ids(lambda g: []),
        token_ids(lambda g: [g.choice([-1, -2**31, vocab_size, 2**31 - 1])]),
        token_ids(lambda g: [5] * g.randrange(max_model_len, 200_000)),
    ]


def fuzz_payloads(seed: int, count: int, vocab_size: int, max_model_len: int
                  ) -> list[tuple[str, bytes]]:
    """`count` (kind, serialized request) pairs, each invalid: 1-3 field mutations of a valid
    request, or bytes that are not a GenerateRequest (random, truncated, a string field of
    invalid UTF-8), or a few over the proxy's 4 MiB message cap (10 MB prompts)."""
    rng = random.Random(seed)
    mutations = _mutations(vocab_size, max_model_len)
    out: list[tuple[str, bytes]] = []
    for i in range(count):
        roll = rng.random()
        if i < 3:  # 10 MB prompts: text, chat content, token ids
            kind, big = "10MB", "w5 " * (10 * MB // 3)
            request = _valid(rng)
            if i == 0:
                request.text = big
            elif i == 1:
                request.chat.CopyFrom(pb.ChatMessages(messages=[pb.ChatMessage(
                    role="user", content=big)]))
            else:
                request.token_ids.CopyFrom(pb.TokenIds(ids=[300] * (5 * MB)))  # 2 bytes each
            out.append((kind, request.SerializeToString()))
        elif roll < 0.06:
            out.append(("random bytes", rng.randbytes(rng.randrange(1, 4096))))
        elif roll < 0.10:  # a string field (text, model or request id) with invalid UTF-8
            bad = rng.choice([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80"])
            number = rng.choice([1, 2, 6])
            out.append(("invalid utf-8", _field(number, b"w5 " + bad + b" w6")
                        + _field(5, pb.SamplingParams(max_tokens=4).SerializeToString())))
        elif roll < 0.13:  # cut inside the last field (request_id: 6, written last)
            request = _valid(rng)
            request.request_id = "r" * 20
            out.append(("truncated", request.SerializeToString()[:-rng.randrange(1, 20)]))
        elif roll < 0.15:  # a double field holding a bare 3-byte tail
            out.append(("bad double", _field(5, b"\x09" + struct.pack("<d", 1.0)[:3])))
        else:
            request = _valid(rng)
            for m in rng.sample(mutations, rng.randrange(1, 4)):
                m(rng, request)
            out.append(("fields", request.SerializeToString()))
    return out


# ---- tests ---------------------------------------------------------------------------------


def test_two_thousand_fuzzed_requests_get_clear_errors_and_nothing_restarts(served, secure):
    """Every malformed request gets INVALID_ARGUMENT, RESOURCE_EXHAUSTED or UNAUTHENTICATED
    with a message; no replica restarts; a valid request right after is served."""
    seed = int(os.environ.get("MXSERVE_FUZZ_SEED", random.randrange(2**31)))
    print(f"fuzz seed {seed} (MXSERVE_FUZZ_SEED={seed} replays it)")
    card = served.llm.engine.model_config
    payloads = fuzz_payloads(seed, 2000, card.vocab_size, served.llm.engine.max_model_len)
    rng = random.Random(seed + 1)
    auth = [rng.choice([TOKEN] * 8 + [None, "wrong", TOKEN + "x"]) for _ in payloads]
    before = {d: worker_pids("secure", d) for d in ("Router", "Worker")}  # id -> pid

    async def main() -> list[tuple[str, grpc.StatusCode, str, int]]:
        limit = asyncio.Semaphore(4)  # (the app's capacity: more would be shed by the proxy)
        options = [("grpc.max_send_message_length", 64 * MB)]
        async with grpc.aio.insecure_channel(served.endpoint, options=options) as channel:
            call = channel.unary_stream(GENERATE, request_serializer=lambda b: b,
                                        response_deserializer=pb.GenerateResponse.FromString)

            async def one(i: int, kind: str, data: bytes):
                async with limit:
                    try:
                        got = [r async for r in call(data, metadata=_metadata("secure",
                                                                              auth[i]),
                                                     timeout=60)]
                        return kind, grpc.StatusCode.OK, f"{len(got)} responses", i
                    except grpc.aio.AioRpcError as e:
                        return kind, e.code(), e.details() or "", i

            return await asyncio.gather(*(one(i, k, d) for i, (k, d) in enumerate(payloads)))

    start = time.monotonic()
    results = asyncio.run(main())
    took = time.monotonic() - start
    wrong = [r for r in results if r[1] not in ANSWERS or not r[2]]
    assert not wrong, f"seed {seed}: {len(wrong)} unexpected answers, e.g. {wrong[:5]}"
    codes = {code: sum(r[1] == code for r in results) for code in ANSWERS}
    assert min(codes.values()) > 0, codes  # each kind of answer was exercised
    assert all(r[1] == grpc.StatusCode.RESOURCE_EXHAUSTED for r in results if r[0] == "10MB")
    for kind, code, details, i in results:  # auth is checked before the request's fields
        if auth[i] != TOKEN and kind not in ("10MB", "random bytes", "invalid utf-8",
                                             "truncated", "bad double"):
            assert code == grpc.StatusCode.UNAUTHENTICATED or "at capacity" in details, \
                (kind, code, details)
        assert TOKEN not in details
    after = {d: worker_pids("secure", d) for d in ("Router", "Worker")}
    assert after == before  # no replica restarted
    with served.client("secure", api_key=TOKEN) as client:
        done = client.generate([5, 6, 7], max_tokens=4, temperature=0, ignore_eos=True)
    assert len(done.token_ids) == 4
    print(f"{len(results)} fuzzed requests in {took:.1f} s: {codes}")


def test_http_api_takes_the_same_token_and_answers_429_past_capacity(served, secure):
    """OpenAI's HTTP API of the secure app (its route /secure): 401 without the app's token,
    /health open to probes; at capacity (4 streams running) a fifth request is 429 with a
    Retry-After the openai client honours, and the streams' ends free their blocks."""
    import http.client

    import openai

    base = f"http://127.0.0.1:{served.config.http_port}/secure/v1"
    conn = http.client.HTTPConnection("127.0.0.1", served.config.http_port, timeout=30)
    conn.request("POST", "/secure/v1/completions", '{"prompt": "w5"}',
                 {"content-type": "application/json"})
    reply = conn.getresponse()
    assert reply.status == 401
    assert json.loads(reply.read())["error"]["param"] == "authorization"
    conn.request("GET", "/secure/health")
    assert conn.getresponse().status == 200
    conn.close()
    with openai.OpenAI(base_url=base, api_key="wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError) as e:
            client.completions.create(model="", prompt="w5", max_tokens=2)
        assert e.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
    with openai.OpenAI(base_url=base, api_key=TOKEN, max_retries=0) as client:
        model = client.models.list().data[0].id
        done = client.completions.create(model=model, prompt="w5 w6", max_tokens=3,
                                         extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 3
        time.sleep(1.5)  # the router has read the workers' capacity
        streams = [client.completions.create(model=model, prompt="w5 w6 w7", max_tokens=480,
                                             stream=True, extra_body={"ignore_eos": True})
                   for _ in range(4)]
        try:
            for stream in streams:
                next(iter(stream))
            with pytest.raises(openai.RateLimitError) as e:
                client.completions.create(model=model, prompt="w5", max_tokens=2)
            assert "at capacity" in e.value.body["message"]
            assert e.value.response.headers["retry-after"] == "1"
        finally:
            for stream in streams:
                stream.close()
    deadline = time.monotonic() + 20
    while any(a["in_flight"] or a["kv_blocks_used"] for a in _audits("secure", "Worker")):
        assert time.monotonic() < deadline, _audits("secure", "Worker")
        time.sleep(0.1)


def test_token_auth_on_the_served_path_and_the_token_never_logged(served, secure):
    from mxserve.cluster.client import Client

    for key in ("", "wrong"):
        with Client(served.endpoint, "secure", api_key=key) as client:
            for call in (lambda: client.generate("w5", max_tokens=2), client.list_models,
                         client.health):
                with pytest.raises(grpc.RpcError) as e:
                    call()
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "authorization" in e.value.details() or "token" in e.value.details()
    with Client(served.endpoint, "secure", api_key=TOKEN) as client:
        assert client.generate("w5 w6", max_tokens=3, ignore_eos=True).completion_tokens == 3
        assert client.list_models().models[0].num_workers == 1
        (load,) = client.health().workers
        assert load.capacity == 4
    with Client(served.endpoint, "tiny") as client:  # another app's auth is its own
        assert client.generate("w5", max_tokens=2, ignore_eos=True).completion_tokens == 2
    logs = os.path.join(served.cluster.head_node.get_session_dir_path(), "logs")
    needle, seen = TOKEN.encode(), 0
    for root, _, files in os.walk(logs):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                assert needle not in f.read(), f"the API token is in {name}"
            seen += 1
    assert seen > 10  # the replicas' and proxy's logs were there to search


def test_a_thousand_cancels_and_deadlines_leave_nothing_behind(served):
    """1,000 requests end early at random points: the client cancels after 0-8 responses, or
    a deadline of 1 ms to 0.3 s passes. Afterwards every worker holds no request, no KV block
    (check_integrity holds), no stream; the router nothing in flight; no tasks pile up."""
    rng = random.Random(7)
    routers_before = _audits("tiny", "Router")
    workers_before = {a["worker_id"]: a for a in _audits("tiny", "Worker")}

    async def main() -> dict[str, int]:
        limit = asyncio.Semaphore(24)
        outcomes: dict[str, int] = {}
        async with grpc.aio.insecure_channel(served.endpoint) as channel:
            call = channel.unary_stream(GENERATE,
                                        request_serializer=pb.GenerateRequest.SerializeToString,
                                        response_deserializer=pb.GenerateResponse.FromString)

            async def one(i: int) -> None:
                prompt = [rng.randrange(3, 256) for _ in range(rng.randrange(4, 120))]
                request = pb.GenerateRequest(
                    token_ids=pb.TokenIds(ids=prompt), request_id=f"storm-{i}",
                    sampling_params=pb.SamplingParams(max_tokens=rng.randrange(8, 64),
                                                      ignore_eos=True, temperature=0))
                deadline = 10 ** rng.uniform(-3, math.log10(0.3)) if i % 2 else None
                stop_after = rng.randrange(0, 9)
                async with limit:
                    stream = call(request, metadata=_metadata("tiny", None), timeout=deadline)
                    try:
                        n = 0
                        async for _ in stream:
                            n += 1
                            if deadline is None and n > stop_after:
                                stream.cancel()
                                break
                        outcome = "finished" if deadline is not None or n <= stop_after \
                            else "cancelled"
                    except grpc.aio.AioRpcError as e:
                        outcome = e.code().name
                    outcomes[outcome] = outcomes.get(outcome, 0) + 1

            await asyncio.gather(*(one(i) for i in range(1000)))
        return outcomes

    outcomes = asyncio.run(main())
    assert sum(outcomes.values()) == 1000
    assert outcomes.get("cancelled", 0) + outcomes.get("CANCELLED", 0) > 300, outcomes
    assert outcomes.get("DEADLINE_EXCEEDED", 0) > 100, outcomes
    assert set(outcomes) <= {"finished", "cancelled", "CANCELLED", "DEADLINE_EXCEEDED"}, outcomes
    served.wait_idle("tiny", timeout_s=60)
    for audit in _audits("tiny", "Worker"):
        assert audit["engine_requests"] == audit["kv_blocks_used"] == 0, audit
        assert audit["streams"] == audit["in_flight"] == audit["prefill_tokens_pending"] == 0
        assert audit["tasks"] <= workers_before[audit["worker_id"]]["tasks"] + 8, audit
    for after, before in zip(_audits("tiny", "Router"), routers_before, strict=True):
        assert after["in_flight"] == 0 and after["tasks"] <= before["tasks"] + 8, after


def test_overload_at_ten_times_capacity_sheds_fast_and_keeps_admitted_latency(served, secure):
    """40 clients against a capacity of 4 for 60 s, each retrying after the server's hint: the
    excess is rejected at once by the router (never by the worker), the admitted requests'
    p99 time to first token stays within 3x that of 4 clients (the server at capacity, no excess),
    and the router's and the worker's memory stay flat."""
    prompt_rng, jitter = random.Random(3), random.Random(4)

    def request() -> pb.GenerateRequest:
        return pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[prompt_rng.randrange(3, 256) for _ in range(24)]),
            sampling_params=pb.SamplingParams(max_tokens=16, ignore_eos=True, temperature=0))

    async def timed(call, metadata) -> tuple[str, float, float | None, str]:
        """(outcome, seconds to the first response or the error, retry hint, details)"""
        start = time.monotonic()
        stream = call(request(), metadata=metadata, timeout=60)
        try:
            first = None
            async for _ in stream:
                first = first or time.monotonic() - start
            return "ok", first, None, ""
        except grpc.aio.AioRpcError as e:
            hint = dict(e.trailing_metadata() or ()).get("retry-after-ms")
            return e.code().name, time.monotonic() - start, hint and int(hint) / 1e3, \
                e.details()

    async def main():
        async with grpc.aio.insecure_channel(served.endpoint) as channel:
            call = channel.unary_stream(GENERATE,
                                        request_serializer=pb.GenerateRequest.SerializeToString,
                                        response_deserializer=pb.GenerateResponse.FromString)
            metadata = _metadata("secure")
            for _ in range(5):  # warm up
                await timed(call, metadata)
            unloaded = [(await timed(call, metadata))[1] for _ in range(100)]
            memory: list[list[int]] = []

            async def client(results, stop):
                while time.monotonic() < stop:
                    result = await timed(call, metadata)
                    results.append(result)
                    if result[0] != "ok":  # retry as told, jittered
                        await asyncio.sleep((result[2] or 1.0) * jitter.uniform(0.5, 1.5))

            async def sample(stop):
                while time.monotonic() < stop:
                    await asyncio.sleep(10)
                    memory.append(await asyncio.to_thread(
                        lambda: [a["rss_bytes"] for a in _audits("secure", "Router")
                                 + _audits("secure", "Worker")]))

            at_capacity: list = []  # 4 clients: the load the server holds, and no more
            stop = time.monotonic() + 15
            await asyncio.gather(*(client(at_capacity, stop) for _ in range(4)))
            results: list = []
            stop = time.monotonic() + 60
            await asyncio.gather(sample(stop), *(client(results, stop) for _ in range(40)))
            return unloaded, at_capacity, results, memory

    unloaded, at_capacity, results, memory = asyncio.run(main())
    ok = sorted(r[1] for r in results if r[0] == "ok")
    shed = [r for r in results if r[0] != "ok"]
    assert {r[0] for r in shed} <= {"RESOURCE_EXHAUSTED"}, {r[0] for r in shed}
    # the router's (or proxy's) own rejections, never a worker's: a worker that has sent a
    # request's last output has counted it out (worker/async_engine.py _deliver_all)
    odd = [r for r in shed if not ("at capacity" in r[3] and r[2] == 1.0)]
    assert not odd, odd[:3]
    assert len(shed) > 4 * len(ok) / 10 and len(ok) > 50, (len(ok), len(shed))

    def quantile(xs, q):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    def p99(xs):
        return quantile(xs, 0.99)

    shed_s = [r[1] for r in shed]
    def pct(xs):
        xs = sorted(xs)
        return "/".join(f"{xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3:.0f}"
                        for q in (0.5, 0.9, 0.99))

    full = [r[1] for r in at_capacity if r[0] == "ok"]
    print(f"TTFT p50/p90/p99 ms: unloaded {pct(unloaded)}; at capacity ({len(full)}) "
          f"{pct(full)}; overloaded: admitted ({len(ok)}) {pct(ok)}, shed ({len(shed)}) "
          f"{pct([r[1] for r in shed])}; rss {memory}")
    assert len(full) == len(at_capacity)  # 4 clients: never shed
    # The excess costs the admitted requests little: their p99 TTFT stays within 3x of that
    # at capacity, where a queue without admission grows it tens of times (bench/results/
    # overload.md, which measures it). 40 clients' retries share this 2-core machine's cores
    # with the proxy, the router and the worker, which moves the p99 by up to ~2.5x from run
    # to run (a clean-clone CI once read 152 ms against 60 at capacity).
    assert p99(ok) <= 3 * p99(full), (p99(ok), p99(full))
    # A rejection is answered no slower than a first token: at p90 against the server at
    # capacity (shed ~5-15 ms, first tokens ~35-60), and its p99 within this box's scheduling
    # stalls of the admitted requests' p99 in the same overloaded minute. The p99s of both are
    # those stalls, not the work (full CI runs read shed 112 ms against 101 at capacity, and
    # 84 against 76 admitted with request intake, whose admitted first tokens are quicker).
    assert quantile(shed_s, 0.9) <= quantile(full, 0.9), (quantile(shed_s, 0.9),
                                                          quantile(full, 0.9))
    assert p99(shed_s) <= 1.5 * p99(ok), (p99(shed_s), p99(ok))
    first, last = memory[1], memory[-1]  # after the first 10 s of load, and at the end
    for a, b in zip(first, last, strict=True):
        assert b < a * 1.05 + 8 * MB, memory
    for audit in _audits("secure", "Worker"):  # (the streams' ends are counted at once)
        assert audit["in_flight"] == audit["kv_blocks_used"] == 0, audit
