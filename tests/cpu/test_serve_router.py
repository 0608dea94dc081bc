"""The serving logic without Ray: Router (validate, tokenize, detokenize, stop strings) over a
Worker (AsyncEngine, admission, load), the config, the client's request builder and the CLI."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import pickle
import re
import threading

import pytest

from mxserve import LLM, SamplingParams
from mxserve.api.errors import (
    INVALID_ARGUMENT,
    RESOURCE_EXHAUSTED,
    UNAUTHENTICATED,
    ServeError,
    as_serve_error,
)
from mxserve.cluster.client import build_request
from mxserve.cluster.config import ServeConfig
from mxserve.cluster.worker import Worker
from mxserve.proto import mxserve_pb2 as pb
from mxserve.router.ingress import Router, TokenAuth
from mxserve.router.requests import ModelCard, RequestLimits
from mxserve.worker.config import EngineConfig
from mxserve.worker.engine import build_engine


class LocalWorkers:
    """router.ingress.Workers over one in-process Worker."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def generate(self, prompt_token_ids, params, request_id):
        return self.worker.generate(prompt_token_ids, params, request_id)

    async def loads(self):
        return [self.worker.load()]


def make_router(model: str | None, max_queued_requests: int = 8, **engine_options):
    """A Router over a started Worker, as the cluster wires them (the router detokenizes)."""
    engine = build_engine(EngineConfig(model=model, load_progress=False, **engine_options))
    tokenizer = engine.tokenizer
    worker = Worker(engine, max_queued_requests)
    worker.start()
    cfg = engine.model_config
    card = ModelCard("m", engine.max_model_len, cfg.vocab_size, tuple(cfg.eos_token_ids))
    return Router(tokenizer, card, LocalWorkers(worker)), worker


async def collect(router: Router, request: pb.GenerateRequest) -> dict:
    out = dict(text="", token_ids=[], logprobs=[], finish_reason="", stop=None, usage=None)
    async for r in router.generate(request):
        out["text"] += r.text
        out["token_ids"] += r.token_ids
        out["logprobs"] += [dict(zip(lp.token_ids, lp.logprobs)) for lp in r.logprobs]
        if r.finish_reason:
            out["finish_reason"], out["usage"] = r.finish_reason, r.usage
            kind = r.WhichOneof("stop_reason")
            out["stop"] = getattr(r, kind) if kind else None
    return out


# SmolLM2's byte-level BPE makes stop strings straddle tokens; each case is also run offline.
CASES = [
    dict(temperature=0, max_tokens=24),
    dict(temperature=0.9, top_p=0.95, seed=11, max_tokens=24),
    dict(temperature=0, max_tokens=24, stop=[" Paris", "xyz"]),
    dict(temperature=0, max_tokens=24, stop=["ital of"], include_stop_str_in_output=True),
    dict(temperature=0, max_tokens=24, stop=["."], min_tokens=12),
    dict(temperature=0.7, seed=5, max_tokens=12, logprobs=2, stop_token_ids=[13]),
]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm2():
    llm = LLM(load_progress=False, num_threads=1)
    router, worker = make_router(None, num_threads=1)
    yield llm, router
    worker.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_router_stream_equals_offline_llm(smollm2, case):
    llm, router = smollm2
    params = SamplingParams(**case)
    for prompt, expected in ((dict(messages=QUESTION), llm.chat(QUESTION, params)[0]),
                             (dict(prompt="The capital of France is"),
                              llm.generate("The capital of France is", params)[0])):
        got = asyncio.run(collect(router, build_request(**prompt, **case)))
        assert got["text"] == expected.text
        assert got["token_ids"] == expected.token_ids
        assert got["finish_reason"] == expected.finish_reason
        assert got["usage"].completion_tokens == len(expected.token_ids)
        assert got["usage"].prompt_tokens == len(expected.prompt_token_ids)
        if case.get("logprobs"):
            lps = got["logprobs"]  # token ids in order, then their logprobs
            assert [list(d) for d in lps] == [list(d) for d in expected.logprobs]
            assert [v for d in lps for v in d.values()] == pytest.approx(
                [v for d in expected.logprobs for v in d.values()])
        if case.get("stop") and expected.finish_reason == "stop":
            assert got["stop"] in case["stop"]


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    router, worker = make_router(str(tiny_checkpoint("llama")), max_queued_requests=1,
                                 dtype="float32", num_kv_blocks=64, max_num_seqs=2)
    yield router, worker
    worker.shutdown()


BAD = [
    (dict(prompt=""), "prompt"),
    (dict(), "prompt"),
    (dict(prompt=[]), "prompt"),
    (dict(prompt=[5, 999]), "prompt"),
    (dict(prompt=[5] * 600), "prompt"),  # the tiny model's context is 512
    (dict(messages=[]), "messages"),
    (dict(messages=[{"role": "", "content": "hi"}]), "messages"),
    (dict(prompt="w5", model="no-such-model"), "model"),
    (dict(prompt="w5", temperature=-1.0), "temperature"),
    (dict(prompt="w5", top_p=1.5), "top_p"),
    (dict(prompt="w5", max_tokens=0), "max_tokens"),
    (dict(prompt="w5", stop=[""]), "stop"),
    (dict(prompt="w5", logprobs=99), "logprobs"),
    (dict(prompt="w5", prompt_logprobs=21), "prompt_logprobs"),
    (dict(prompt="w5", stop_token_ids=[-1]), "stop_token_ids"),
    (dict(prompt="w5", temperature=float("nan")), "temperature"),
    (dict(prompt="w5", temperature=float("inf")), "temperature"),
    (dict(prompt="w5", repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(prompt="w5", top_p=float("nan")), "top_p"),
    (dict(messages=[{"role": "wizard", "content": "hi"}]), "messages"),
    (dict(messages=[{"role": "user", "content": "w5"}] * 1025), "messages"),
    (dict(messages=[{"role": "user", "content": "w5 " * 6000}]), "messages"),
    (dict(prompt="w5 " * 6000), "prompt"),  # 18,000 characters: past 32 per context token
    (dict(prompt="w5", stop=["a"] * 65), "stop"),
    (dict(prompt="w5", stop=["a" * 1025]), "stop"),
    (dict(prompt="w5", stop_token_ids=[1] * 1025), "stop_token_ids"),
    (dict(prompt="w5", request_id="r" * 257), "request_id"),
]


@pytest.mark.parametrize("kwargs,field", BAD)
def test_bad_requests_are_invalid_argument_naming_the_field(tiny, kwargs, field):
    router, _ = tiny
    with pytest.raises(ServeError) as e:
        asyncio.run(collect(router, build_request(**kwargs)))
    assert e.value.code == INVALID_ARGUMENT and e.value.field == field
    assert e.value.message.startswith(field)
    good = asyncio.run(collect(router, build_request("w5 w6", max_tokens=3, ignore_eos=True)))
    assert len(good["token_ids"]) == 3 and good["finish_reason"] == "length"


def test_worker_sends_several_tokens_a_message_only_under_load(tiny_checkpoint):
    """With 8 streams running (one more token a message per 4 streams, at most 3) the engine
    stream wakes a consumer only once 2 tokens are due: every message but the first and the
    last carries at least 2, and every stream's tokens are offline's. A lone stream is due at
    every token (a consumer that lags still gets what piled up merged, so its message count is
    not fixed)."""
    llm = LLM(model=str(tiny_checkpoint("llama")), dtype="float32", num_kv_blocks=128,
              max_num_seqs=8, load_progress=False)
    params = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)
    prompts = [[5 + i, 6, 7] for i in range(8)]
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    worker = Worker(llm.engine, max_queued_requests=0, streams_per_token=4,
                    max_tokens_per_message=3)
    due: list[tuple[int, int]] = []  # (streams open, tokens a wake-up waits for), each step
    policy = worker.async_engine.tokens_per_wake

    def recorded(num_streams: int) -> int:
        due.append((num_streams, policy(num_streams)))
        return due[-1][1]
    worker.async_engine.tokens_per_wake = recorded
    worker.start()

    async def run(batch: list[list[int]], tag: str) -> list[list[list[int]]]:
        async def one(i: int, prompt: list[int]) -> list[list[int]]:
            return [out.new_token_ids
                    async for out in worker.generate(prompt, params, f"{tag}{i}")]
        # the engine thread waits until every stream is open: all run from the first step
        gate = threading.Event()
        worker.async_engine.submit(lambda engine: gate.wait(10))
        streams = asyncio.gather(*(one(i, p) for i, p in enumerate(batch)))
        await asyncio.sleep(0.2)
        gate.set()
        return await streams

    try:
        (alone,) = asyncio.run(run(prompts[:1], "alone"))
        alone_due, due[:] = list(due), []
        together = asyncio.run(run(prompts, "m"))
    finally:
        worker.shutdown()
    assert [t for m in alone for t in m] == expected[0]
    assert alone_due and all(d == (1, 1) for d in alone_due)  # nothing held back
    assert set(due[:-1]) == {(8, 2)}  # (the last step's streams may be closing)
    for messages, want in zip(together, expected):
        assert [t for m in messages for t in m] == want
        # each message but the first and the last carries at least 2 tokens (a consumer that
        # lags gets more, merged): held until they are due
        assert all(len(m) >= 2 for m in messages[1:-1]), messages
        assert len(messages) <= 1 + (len(want) - 1 + 1) // 2


def test_worker_rejects_beyond_its_queue_and_aborts_free_blocks(tiny):
    router, worker = tiny  # max_num_seqs=2, max_queued_requests=1: three fit, the fourth not
    long = build_request("w5 w6 w7", max_tokens=400, ignore_eos=True)

    async def main():
        streams = [router.generate(long) for _ in range(3)]
        for s in streams[:2]:
            await anext(s)  # running
        # queued behind them (its first token comes when one of them ends: then that one no
        # longer counts against the limit, AsyncEngine.num_ending)
        third = asyncio.ensure_future(anext(streams[2]))
        while worker.num_in_flight < 3:
            await asyncio.sleep(0.001)
        with pytest.raises(ServeError) as e:  # (the worker's own check, past the router's)
            await anext(worker.generate([5, 6, 7], SamplingParams(max_tokens=4), "fourth"))
        assert e.value.code == RESOURCE_EXHAUSTED and "is full" in e.value.message
        for s in streams[:2]:
            await s.aclose()  # the client goes away mid-stream
        await third
        await streams[2].aclose()
        assert await worker.wait_idle()
        return await router.health()

    aborted = worker.num_requests_aborted
    health = asyncio.run(main())
    (load,) = health.workers
    assert load.num_running == load.num_waiting == load.num_kv_blocks_used == 0
    assert load.num_requests_aborted == aborted + 3
    assert load.num_preemptions == worker.engine.scheduler.num_preemptions
    worker.engine.kv.check_integrity()


def test_a_workers_refusal_reaches_the_client_with_the_routers_retry_hint(tiny):
    """Two routers that each think they have the whole worker (their shares overshoot it):
    the second one's request, refused by the full worker, reaches its client as
    RESOURCE_EXHAUSTED with the router's retry hint, as a router's own shedding does."""
    from mxserve.router.ingress import Admission

    router, worker = tiny  # capacity 3 (max_num_seqs=2, max_queued_requests=1)
    other = Router(router.tokenizer, router.card, router.workers,
                   admission=Admission(retry_after_s=0.25))
    long = build_request("w5 w6 w7", max_tokens=400, ignore_eos=True)

    async def main():
        streams = [router.generate(long) for _ in range(3)]
        for s in streams[:2]:
            await anext(s)
        third = asyncio.ensure_future(anext(streams[2]))
        while worker.num_in_flight < 3:
            await asyncio.sleep(0.001)
        with pytest.raises(ServeError) as e:
            await collect(other, build_request("w5", max_tokens=4))
        for s in streams[:2]:
            await s.aclose()
        await third
        await streams[2].aclose()
        other.close()
        assert await worker.wait_idle()
        return e.value

    error = asyncio.run(main())
    assert error.code == RESOURCE_EXHAUSTED and "is full" in error.message
    assert error.retry_after_s == 0.25


@pytest.mark.parametrize("spec_version", ["2.0", "2.4"])
def test_a_streamed_http_reply_whose_client_left_frees_its_requests_at_once(tiny, spec_version):
    """The client is gone before the SSE body's first byte (ASGI 2.4: the first send fails;
    older: the disconnect is heard first): each request of the batch is aborted and its KV
    blocks freed when the response ends, not when its generators are collected."""
    from starlette.requests import Request

    from mxserve.router.openai import OpenAIServer

    router, worker = tiny
    body = json.dumps(dict(model="m", prompt=["w5 w6", "w7 w8"], max_tokens=300,
                           ignore_eos=True, stream=True)).encode()
    scope = dict(type="http", method="POST", path="/v1/completions", root_path="",
                 query_string=b"", headers=[(b"content-type", b"application/json")],
                 asgi=dict(spec_version=spec_version))

    async def request_body():
        return dict(type="http.request", body=body, more_body=False)

    async def gone():
        return dict(type="http.disconnect")

    async def send(message):
        if spec_version == "2.4":
            raise OSError("the client is gone")
        await asyncio.sleep(3600)  # (older servers: the disconnect listener ends it)

    async def main():
        response = await OpenAIServer(router)(Request(scope, request_body))
        assert worker.num_in_flight == 2  # both prompts admitted and running
        with contextlib.suppress(Exception):
            await response(scope, gone, send)
        return worker.num_in_flight

    aborted = worker.num_requests_aborted
    gc.disable()  # nothing may depend on the generators being collected
    try:
        assert asyncio.run(main()) == 0
        assert worker.num_requests_aborted == aborted + 2
    finally:
        gc.enable()
    assert asyncio.run(worker.wait_idle())
    assert worker.engine.kv.num_free_blocks == worker.engine.kv.num_blocks
    worker.engine.kv.check_integrity()


def test_worker_reports_the_prefill_its_prefix_cache_will_not_supply(tiny_checkpoint):
    """Routing weighs a cached prefix against the prefill work queued on a worker: a request
    whose first 32 tokens are cached there counts only the rest, until its first output (all
    of them when it asks for prompt logprobs: it takes no prefix hits)."""
    engine = build_engine(EngineConfig(model=str(tiny_checkpoint("llama")), load_progress=False,
                                       dtype="float32", num_kv_blocks=64, max_num_seqs=2))
    prefix = list(range(5, 37))  # two full blocks of 16
    engine.add_request(prefix + [40], SamplingParams(temperature=0, max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    worker = Worker(engine, max_queued_requests=4)  # not started: requests wait, admitted

    async def admit():
        streams = [worker.generate(prompt, SamplingParams(max_tokens=2, prompt_logprobs=plp), rid)
                   for rid, prompt, plp in (("hit", prefix + [41] * 9, None),
                                            ("miss", [42] * 20, None),
                                            ("all", prefix + [41] * 9, 0))]
        tasks = [asyncio.ensure_future(anext(s)) for s in streams]
        await asyncio.sleep(0.05)
        pending = worker.load()["num_prefill_tokens_pending"]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return pending

    assert asyncio.run(admit()) == 9 + 20 + 41
    assert worker.load()["num_prefill_tokens_pending"] == 0  # cancelled before any output


def test_prompt_logprobs_come_in_the_first_response(tiny, tiny_checkpoint):
    """One entry per prompt token: the first token's id alone, then each token's id and
    logprob first, then the top n; as the offline LLM gives them."""
    router, _ = tiny
    ids = [5, 9, 14, 3, 77, 20, 31, 8]
    case = dict(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    responses = asyncio.run(_responses(router, build_request(ids, **case)))
    with LLM(str(tiny_checkpoint("llama")), dtype="float32", num_kv_blocks=64,
             load_progress=False) as llm:
        expected = llm.generate(ids, SamplingParams(**case))[0].prompt_logprobs
    got = responses[0].prompt_logprobs
    assert [list(e.token_ids) for e in got] == [[ids[0]]] + [list(e) for e in expected[1:]]
    assert [list(e.logprobs) for e in got[1:]] == \
        [pytest.approx(list(e.values())) for e in expected[1:]]
    assert not got[0].logprobs
    assert all(not r.prompt_logprobs for r in responses[1:])
    assert len([t for r in responses for t in r.token_ids]) == 3


async def _responses(router: Router, request: pb.GenerateRequest) -> list:
    return [r async for r in router.generate(request)]


def test_prompt_token_limit_and_long_prompts_tokenized_off_the_loop(tiny):
    """max_prompt_tokens caps prompts below the context; a prompt long enough to be tokenized
    in a thread is still checked and served."""
    router, _ = tiny
    capped = Router(router.tokenizer, router.card, router.workers,
                    limits=RequestLimits(max_prompt_tokens=8))
    with pytest.raises(ServeError) as e:
        asyncio.run(collect(capped, build_request("w5 " * 9, max_tokens=2)))
    assert e.value.field == "prompt" and "limit is 8" in e.value.message
    roomy = Router(router.tokenizer, router.card, router.workers,
                   limits=RequestLimits(max_prompt_chars=100_000))
    long = build_request("w5 " * 6000, max_tokens=2, ignore_eos=True)  # tokenized in a thread
    with pytest.raises(ServeError) as e:  # over the tiny model's 512-token context
        asyncio.run(collect(roomy, long))
    assert e.value.field == "prompt" and "context is 512" in e.value.message
    ok = build_request("w5 " * 100 + " " * 17000, max_tokens=2, ignore_eos=True)
    assert len(asyncio.run(collect(roomy, ok))["token_ids"]) == 2


def test_token_auth_rejects_missing_and_wrong_tokens_and_serves_the_right_one(tiny):
    router, _ = tiny
    secured = Router(router.tokenizer, router.card, router.workers,
                     auth=TokenAuth([TokenAuth.digest("old"), TokenAuth.digest("s3cret")]))
    request = build_request("w5 w6", max_tokens=2, ignore_eos=True)

    async def ask(metadata):
        return [r async for r in secured.generate(request, metadata)]

    for metadata, why in [((), "missing"), ((("authorization", "Bearer nope"),), "invalid"),
                          ((("authorization", "s3cret"),), "Bearer"),
                          ((("authorization", "Basic s3cret"),), "Bearer")]:
        with pytest.raises(ServeError) as e:
            asyncio.run(ask(metadata))
        assert e.value.code == UNAUTHENTICATED and why in e.value.message
        assert "s3cret" not in e.value.message
        with pytest.raises(ServeError):
            asyncio.run(secured.list_models(metadata))
    for token in ("s3cret", "old"):  # either of two accepted tokens (a rotation)
        metadata = (("application", "x"), ("authorization", f"Bearer {token}"))
        assert sum(len(r.token_ids) for r in asyncio.run(ask(metadata))) == 2
        assert asyncio.run(secured.health(metadata)).healthy


def test_router_sheds_past_its_share_of_the_workers_capacity(tiny):
    """The router admits what its workers can hold (capacity 3 here: 2 running + 1 queued)
    and rejects more at once, RESOURCE_EXHAUSTED with a retry hint, before the worker does;
    a shed request costs the workers nothing and every admitted one is counted back out."""
    router, worker = tiny
    long = build_request("w5 w6 w7", max_tokens=400, ignore_eos=True)

    async def main():
        router.set_capacity(await router.workers.loads())
        assert router.capacity == 3
        streams = [router.generate(long) for _ in range(3)]
        for s in streams:
            await anext(s)
        total = worker.num_requests_total
        with pytest.raises(ServeError) as e:
            await collect(router, long)
        assert e.value.code == RESOURCE_EXHAUSTED and e.value.retry_after_s == 1.0
        assert "at capacity" in e.value.message and worker.num_requests_total == total
        assert router.num_in_flight == 3
        for s in streams:
            await s.aclose()
        assert router.num_in_flight == 0
        assert await worker.wait_idle()
        router.set_capacity([{**worker.load(), "draining": True}])
        assert router.capacity is None  # every worker draining: requests wait for a new one
        router.set_capacity(await router.workers.loads())

    shed = router.num_shed
    asyncio.run(main())
    assert router.num_shed == shed + 1
    worker.engine.kv.check_integrity()


def test_stop_string_seen_by_the_router_aborts_the_worker_request(tiny):
    router, worker = tiny
    full = asyncio.run(collect(router, build_request("w9", max_tokens=40, ignore_eos=True,
                                                     temperature=0)))
    stop = full["text"][13:17]  # straddles words: the cut lands inside a token's text
    aborted = worker.num_requests_aborted
    cut = asyncio.run(collect(router, build_request("w9", max_tokens=40, ignore_eos=True,
                                                    temperature=0, stop=[stop])))
    assert cut["text"] == full["text"][:full["text"].index(stop)]
    assert cut["finish_reason"] == "stop" and cut["stop"] == stop
    assert asyncio.run(worker.wait_idle())
    assert worker.num_requests_aborted == aborted + 1  # the worker had more tokens to go


def test_worker_freezes_the_heap_for_its_process_and_thaws_it_on_shutdown(tiny_checkpoint):
    """Worker.start(freeze_gc=True), as each Serve replica starts: everything alive then (the
    engine among it) leaves the cyclic collector's generations; requests still run, their
    objects are collected as usual; shutdown unfreezes."""
    assert gc.get_freeze_count() == 0
    engine = build_engine(EngineConfig(model=str(tiny_checkpoint("llama")), load_progress=False,
                                       dtype="float32", num_kv_blocks=64, max_num_seqs=2))
    worker = Worker(engine, max_queued_requests=1)
    worker.start(freeze_gc=True)
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 1000 and not any(o is engine for o in gc.get_objects())

        async def run():
            outs = [o async for o in worker.generate([5, 6, 7], SamplingParams(
                temperature=0, max_tokens=8, ignore_eos=True), "r1")]
            return sum(len(o.new_token_ids) for o in outs), outs[-1].finished

        assert asyncio.run(run()) == (8, True)
        # requests' objects stay collectable: nothing joins the frozen set (which only shrinks,
        # as frozen objects still die by reference count: a CI run saw 2 go during the request)
        assert gc.get_freeze_count() <= frozen
    finally:
        worker.shutdown()
    assert gc.get_freeze_count() == 0 and any(o is engine for o in gc.get_objects())


def test_serve_error_survives_pickling_and_ray_style_wrapping():
    error = ServeError(RESOURCE_EXHAUSTED, "full", None)
    again = pickle.loads(pickle.dumps(error))
    assert (again.code, again.message, again.field) == (RESOURCE_EXHAUSTED, "full", None)

    class Wrapped(Exception):  # Ray's RayTaskError keeps the original as .cause
        cause = error
    assert as_serve_error(Wrapped()).code == RESOURCE_EXHAUSTED
    assert as_serve_error(ValueError("x")) is None


def test_serve_config_defaults_and_checks(tmp_path):
    config = ServeConfig()
    assert config.served_model_name == "SmolLM2-135M-Instruct" and config.num_workers == 1
    assert ServeConfig(model="/x/my-model.gguf").served_model_name == "my-model"
    with pytest.raises(ValueError):
        ServeConfig(engine={"max_num_seqs": 0})
    with pytest.raises(ValueError):
        ServeConfig(num_workres=2)  # a typo is an error, not ignored
    path = tmp_path / "serve.yaml"
    path.write_text("num_workers: 2\nengine:\n  max_num_seqs: 8\n"
                    "worker_resources:\n  num_cpus: 2\n")
    config = ServeConfig.from_file(str(path), grpc_port=9100)
    assert config.num_workers == 2 and config.engine_config().max_num_seqs == 8
    assert config.worker_resources.num_cpus == 2 and config.grpc_port == 9100


def test_direct_streams_are_on_unless_set_off_or_tls_is_on():
    tls = {"enabled": True, "tls_cert": "c.pem", "tls_key": "k.pem"}
    with pytest.raises(ValueError, match="streaming.direct"):
        ServeConfig(streaming={"direct": True}, kv_transfer=tls)
    assert ServeConfig().streaming.direct
    assert not ServeConfig(kv_transfer=tls).streaming.direct  # the default gives way to TLS
    again = ServeConfig(**ServeConfig(kv_transfer=tls).model_dump())  # and stays off
    assert not again.streaming.direct
    assert not ServeConfig(streaming={"direct": False}).streaming.direct
    from mxserve.cluster.config import Streaming
    given = Streaming()
    assert not ServeConfig(streaming=given, kv_transfer=tls).streaming.direct
    assert given.direct  # the caller's object is left as it was


def test_serve_cli_builds_the_config(monkeypatch):
    from mxserve.cluster import cli, local

    seen = {}
    monkeypatch.setattr(local, "serve_until_stopped",
                        lambda config, address, ask: seen.update(config=config, address=address,
                                                                  ask=ask) or 0)
    assert cli.main(["serve", "--num-workers", "2", "--grpc-port", "9001", "--worker-cpus", "0.5",
                     "--max-num-seqs", "8", "--address", "auto", "--routing", "round_robin",
                     "--redis-url", "redis://:pw@redis:6379/0", "--ask", "hi?",
                     "--tensor-parallel-size", "2", "--num-routers", "2",
                     "--streams-per-token", "8", "--max-tokens-per-message", "4",
                     "--direct-streams", "--ingress", "proxy"]) == 0
    config = seen["config"]
    assert config.num_workers == 2 and config.grpc_port == 9001 and seen["address"] == "auto"
    assert config.worker_resources.num_cpus == 0.5
    assert config.engine == {"max_num_seqs": 8, "tensor_parallel_size": 2}
    assert config.routing.policy == "round_robin" and not config.uses_prefix_index
    assert config.redis_url == "redis://:pw@redis:6379/0" and seen["ask"] == "hi?"
    assert config.num_routers == 2
    assert (config.streaming.streams_per_token, config.streaming.max_tokens_per_message) == (8, 4)
    assert config.streaming.direct and config.ingress == "proxy"


def test_build_request_covers_each_prompt_kind():
    assert build_request("hi").text == "hi"
    assert list(build_request([1, 2]).token_ids.ids) == [1, 2]
    chat = build_request(messages=[{"role": "user", "content": "hi"}], stop="x", seed=3)
    assert chat.chat.messages[0].content == "hi" and list(chat.sampling_params.stop) == ["x"]
    assert chat.sampling_params.HasField("seed") and not chat.sampling_params.HasField("top_p")
    with pytest.raises(ValueError):
        build_request("hi", temprature=0)


def test_build_app_turns_the_config_into_deployment_options():
    from mxserve.cluster.config import Autoscaling, Resources
    from mxserve.cluster.deployments import build_app

    config = ServeConfig(autoscaling=Autoscaling(min_workers=1, max_workers=3),
                         worker_resources=Resources(num_gpus=1, resources={"big": 1}),
                         max_queued_requests=4, engine={"max_num_seqs": 8})
    router = build_app(config)._bound_deployment  # Serve internals, read-only here
    worker = router.init_args[0]._bound_deployment
    assert worker._deployment_config.autoscaling_config.max_replicas == 3
    assert worker.ray_actor_options["num_gpus"] == 1
    assert worker.ray_actor_options["resources"] == {"big": 1}
    assert worker._deployment_config.max_ongoing_requests > 8 + 4  # admission is the Worker's
    assert router.init_args[2:5] == ("SmolLM2-135M-Instruct", None, "mxserve")
    limits, digests, admission, migration_limit, direct, own_ports, intake = \
        router.init_args[5:]
    assert limits["max_chat_messages"] == 1024 and digests == []  # no api_key: no auth
    assert admission == {"num_routers": 1, "retry_after_s": 1.0} and migration_limit == 3
    assert direct is True  # outputs over the routers' output channels unless set off
    assert own_ports == {"grpc": 9000, "http": 8000, "route_prefix": "/", "timeout_s": None,
                         "grace_s": 300.0}  # ingress "routers": the routers serve the ports
    # request intake: the routers route (no Redis URL: by load alone) and send requests over
    # TCP; the workers report what they hold for Serve's autoscaling
    assert intake == {"redis_url": None, "namespace": "mxserve:mxserve",
                      "routing": config.routing.policy_options(), "period_s": 0.5}
    assert worker.init_args[-1] is True
    policy = worker._deployment_config.autoscaling_config.policy
    assert policy.policy_function.endswith("InFlightPolicy")
    assert policy.policy_kwargs == {"target": config.autoscaling.target_ongoing_requests}
    proxied = build_app(config.model_copy(update=dict(ingress="proxy")))._bound_deployment
    assert proxied.init_args[-2] is None  # Serve's proxies serve them
    assert worker.init_args[2] is None  # no Redis URL: no prefix index, Serve's own routing
    assert worker.init_args[-2] == {"streams_per_token": 8, "max_tokens_per_message": 16}
    assert worker._deployment_config.request_router_config.request_router_class.endswith(
        "PowerOfTwoChoicesRequestRouter")
    # intake off (set off, or direct streams off): a Serve call a request, Serve's policy
    calls = build_app(ServeConfig(**{**config.model_dump(), "streaming": {"intake": False}})
                      )._bound_deployment
    assert calls.init_args[-1] is None and calls.init_args[0]._bound_deployment.init_args[-1] \
        is False
    no_direct = ServeConfig(**{**config.model_dump(), "streaming": {"direct": False}})
    assert not no_direct.uses_intake and config.uses_intake
    with pytest.raises(ValueError, match="streaming.intake needs"):
        ServeConfig(streaming=dict(direct=False, intake=True))
    with pytest.raises(ValueError, match="streaming.intake needs"):
        ServeConfig(streaming=dict(intake=True), routing=dict(policy="round_robin"))
    assert not ServeConfig(routing=dict(policy="round_robin")).uses_intake


def test_build_app_reserves_one_bundle_per_tensor_parallel_rank():
    from mxserve.cluster.config import Resources
    from mxserve.cluster.deployments import build_app

    for resources, strategy in ((dict(num_cpus=2, num_gpus=1), "STRICT_PACK"),
                                (dict(num_cpus=1), "PACK")):
        config = ServeConfig(engine={"tensor_parallel_size": 4},
                             worker_resources=Resources(**resources))
        worker = build_app(config)._bound_deployment.init_args[0]._bound_deployment
        bundle = {"CPU": resources["num_cpus"], **({"GPU": 1.0} if "num_gpus" in resources
                                                   else {})}
        assert worker._replica_config.placement_group_bundles == [bundle] * 4
        assert worker._replica_config.placement_group_strategy == strategy
        assert worker.init_args[3] == config.worker_resources.ray_actor_options()  # each rank's


def test_build_app_wires_prefix_routing_to_redis():
    from mxserve.cluster.deployments import build_app

    config = ServeConfig(redis_url="redis://127.0.0.1:7000/0", app_name="x",
                         routing=dict(load_weight=10.0, stats_period_s=0.25))
    worker = build_app(config)._bound_deployment.init_args[0]._bound_deployment
    index = worker.init_args[2]
    assert (index["url"], index["namespace"]) == ("redis://127.0.0.1:7000/0", "mxserve:x")
    router_config = worker._deployment_config.request_router_config
    assert router_config.request_router_class.endswith("PrefixAwareRequestRouter")
    assert router_config.request_router_kwargs["load_weight"] == 10.0
    assert router_config.request_routing_stats_period_s == 0.25
    config = ServeConfig(redis_url="redis://127.0.0.1:7000/0", routing=dict(policy="round_robin"))
    worker = build_app(config)._bound_deployment.init_args[0]._bound_deployment
    assert worker.init_args[2] is None
    assert worker._deployment_config.request_router_config.request_router_class.endswith(
        "RoundRobinRequestRouter")


def test_each_request_ends_in_one_log_line(tiny, caplog):
    """However a request ends (rejected, finished, cancelled by its client), the router logs
    it once, at INFO, with no traceback: what the operator reads instead of Serve's errors."""
    router, _ = tiny
    caplog.set_level(logging.INFO, logger="mxserve.router.ingress")
    with pytest.raises(ServeError):
        asyncio.run(collect(router, build_request("w5", temperature=-1.0)))
    asyncio.run(collect(router, build_request("w5 w6", max_tokens=3, ignore_eos=True)))

    async def cancel():
        stream = router.generate(build_request("w5 w6", max_tokens=50, ignore_eos=True))
        await anext(stream)
        await stream.aclose()

    asyncio.run(cancel())
    records = [r for r in caplog.records if r.name == "mxserve.router.ingress"]
    assert [r.levelno for r in records] == [logging.INFO] * 3
    assert not any(r.exc_info for r in records)
    rejected, finished, cancelled = (r.getMessage() for r in records)
    assert re.fullmatch(r"request mx-\w+: INVALID_ARGUMENT: temperature: must be a finite "
                        r"number >= 0, got -1\.0 \(0 prompt \+ 0 output tokens, \d+ ms\)", rejected)
    assert re.fullmatch(r"request mx-\w+: length \(\d+ prompt \+ 3 output tokens, \d+ ms\)",
                        finished)
    # The engine may have produced a token or two more before the cancel reached it; what
    # matters is that the line says cancelled, well short of max_tokens.
    match = re.fullmatch(r"request mx-\w+: cancelled \(\d+ prompt \+ (\d+) output tokens, \d+ ms\)",
                         cancelled)
    assert match and 1 <= int(match.group(1)) < 50, cancelled


class LosingWorkers:
    """Calls go to the workers in turn (a lost worker is not chosen again); each stream breaks
    (WorkerLostError, as HandleWorkers raises when a replica dies) after `after` tokens, for
    the first `num_losses` calls. `calls` keeps each call's hints."""

    def __init__(self, workers: list[Worker], num_losses: int, after: int = 5) -> None:
        self.workers, self.num_losses, self.after, self.calls = workers, num_losses, after, []

    async def loads(self):
        return [w.load() for w in self.workers]

    def generate(self, prompt_token_ids, params, request_id, **hints):
        from mxserve.api.errors import WorkerLostError

        worker = self.workers[len(self.calls) % len(self.workers)]
        self.calls.append(hints)
        inner = worker.generate(prompt_token_ids, params, request_id, **hints)
        if len(self.calls) > self.num_losses:
            return inner

        async def lost():
            n = 0
            async for out in inner:
                yield out
                n += len(out.new_token_ids)
                if n >= self.after:
                    await inner.aclose()  # (the dead worker's requests die with it)
                    raise WorkerLostError("its worker is gone (test)", f"w{len(self.calls)}")
        return lost()


def test_a_request_goes_on_after_each_lost_worker_until_its_migration_limit(tiny,
                                                                             tiny_checkpoint):
    """Each loss re-issues the prompt + the tokens sent so far, naming the lost worker: the
    client gets the undisturbed greedy tokens once each. One loss past migration_limit ends
    the request UNAVAILABLE, and the worker holds no block after either."""
    from mxserve.api.errors import UNAVAILABLE

    router, worker = tiny
    _, other = make_router(str(tiny_checkpoint("llama")), dtype="float32", num_kv_blocks=64,
                           max_num_seqs=2)
    request = build_request("w5 w6 w7", max_tokens=24, ignore_eos=True, temperature=0)
    want = asyncio.run(collect(router, request))["token_ids"]

    workers = LosingWorkers([worker, other], num_losses=2)
    lossy = Router(router.tokenizer, router.card, workers, migration_limit=2)
    got = asyncio.run(collect(lossy, request))
    assert got["token_ids"] == want and got["finish_reason"] == "length"
    resumes = [h["resume"] for h in workers.calls[1:]]
    assert [r.worker_id for r in resumes] == ["w1", "w2"] and all(r.worker_lost for r in resumes)
    # (each loss comes after at least 5 more tokens: more when outputs arrive merged)
    first, second = (r.output_token_ids for r in resumes)
    assert first == want[:len(first)] and len(first) >= 5
    assert second == want[:len(second)] and len(second) >= len(first) + 5

    workers = LosingWorkers([worker, other], num_losses=3)
    lossy = Router(router.tokenizer, router.card, workers, migration_limit=2)
    with pytest.raises(ServeError) as e:
        asyncio.run(collect(lossy, request))
    assert e.value.code == UNAVAILABLE and "migration_limit 2" in e.value.message
    assert len(workers.calls) == 3
    for w in (worker, other):
        assert asyncio.run(w.wait_idle())
        assert w.load()["num_kv_blocks_used"] == 0
        w.engine.kv.check_integrity()
    other.shutdown()


def test_a_wedged_engine_fails_the_health_check(tiny_checkpoint):
    """Work pending and no step finished for stall_timeout_s: check_health raises (Serve then
    replaces the replica). Idle for longer than that is healthy, and so is stepping again."""
    import threading
    import time

    engine = build_engine(EngineConfig(model=str(tiny_checkpoint("llama")), load_progress=False,
                                       dtype="float32", num_kv_blocks=64, max_num_seqs=2))
    worker = Worker(engine, 4, stall_timeout_s=0.3)
    worker.start()
    release = threading.Event()
    step = engine.step

    def wedged_step():
        release.wait()  # a hung kernel or collective
        return step()

    async def main():
        await asyncio.sleep(0.5)
        worker.check_health()  # idle past the timeout: healthy
        engine.step = wedged_step
        stream = worker.generate([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True), "r")
        task = asyncio.create_task(anext(stream))
        await asyncio.sleep(0.1)
        worker.check_health()  # within the timeout
        await asyncio.sleep(0.4)
        with pytest.raises(RuntimeError, match="finished no step"):
            worker.check_health()
        release.set()
        await task
        async for _ in stream:
            pass
        worker.check_health()

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        release.set()
        worker.shutdown()
    assert time.monotonic() - worker.async_engine.progress_at < 60


def test_request_router_leaves_a_lost_worker_out_until_serve_drops_it():
    """A resumed request naming a lost worker takes it out of every later generate choice
    (not of other calls); Serve's new replica set without it clears the mark."""
    from types import SimpleNamespace as NS

    from mxserve.api.outputs import ResumeState
    from mxserve.cluster.request_router import PrefixAwareRequestRouter

    def replica(worker_id, **stats):
        return NS(replica_id=NS(unique_id=worker_id), routing_stats=stats)

    def pending(method="generate", **kwargs):
        return NS(metadata=NS(call_method=method), kwargs=kwargs)

    router = object.__new__(PrefixAwareRequestRouter)  # its state only: no Serve here
    router._lost = {}
    a, b, c = replica("a"), replica("b"), replica("c", draining=True)
    ids = lambda rs: [r.replica_id.unique_id for r in rs]  # noqa: E731
    assert ids(router._serving([a, b, c], pending())) == ["a", "b"]
    drained = ResumeState("a", None, 0, [1], None, 0)
    assert ids(router._serving([a, b, c], pending(resume=drained))) == ["b"]
    assert ids(router._serving([a, b, c], pending())) == ["a", "b"]  # a drain marks nothing
    lost = ResumeState("a", None, 0, [1], None, 0, worker_lost=True)
    assert ids(router._serving([a, b, c], pending(resume=lost))) == ["b"]
    assert ids(router._serving([a, b, c], pending())) == ["b"]  # every later request too
    assert ids(router._serving([a, b], pending("record_routing_stats"))) == ["a", "b"]
    assert ids(router._serving([a], pending())) == ["a"]  # none left: any
    router._lost = {w: t for w, t in router._lost.items() if w in {"b"}}  # update_replicas
    assert ids(router._serving([a, b, c], pending())) == ["a", "b"]
