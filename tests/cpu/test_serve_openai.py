"""OpenAI's HTTP API on the session's cluster (conftest `served`): the official `openai` client
-> Ray Serve's HTTP proxy -> the router replica -> worker replicas, as gRPC clients are served.
Answers equal the gRPC path's and the offline API's; usage counts match; bad input gets its
status and `param`; a client that disconnects frees its request's KV blocks. (Auth and 429 are
tested on the secure app: test_serve_reliability.py.)"""

from __future__ import annotations

import http.client
import json
import os
import time

import openai
import pytest

from mxserve import SamplingParams

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

MESSAGES = [{"role": "user", "content": "w40 w41 w42"}]
GREEDY = dict(temperature=0, max_tokens=12)
SAMPLED = dict(temperature=0.8, top_p=0.9, seed=7, max_tokens=12)


def _base_url(served) -> str:
    return f"http://127.0.0.1:{served.config.http_port}/v1"


@pytest.fixture(scope="module")
def client(served):
    with openai.OpenAI(base_url=_base_url(served), api_key="unused", max_retries=0,
                       timeout=60) as c:
        yield c


def _model(served) -> str:
    return served.config.served_model_name


def _http(served, method: str, path: str, body: dict | bytes | None = None
          ) -> tuple[int, dict | None]:
    """A raw call (what the openai client would not send): the status and the JSON body."""
    conn = http.client.HTTPConnection("127.0.0.1", served.config.http_port, timeout=30)
    try:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        conn.request(method, path, data, {"content-type": "application/json"})
        reply = conn.getresponse()
        raw = reply.read()
        return reply.status, json.loads(raw) if raw else None
    finally:
        conn.close()


@pytest.mark.parametrize("case", [GREEDY, SAMPLED])
def test_chat_equals_grpc_and_offline_streamed_or_not(served, client, case):
    expected = served.llm.chat(MESSAGES, SamplingParams(**case, ignore_eos=True))[0]
    with served.client() as grpc_client:
        over_grpc = grpc_client.chat(MESSAGES, **case, ignore_eos=True)
    assert over_grpc.text == expected.text
    extra = {"ignore_eos": True}
    reply = client.chat.completions.create(model=_model(served), messages=MESSAGES,
                                           extra_body=extra, **case)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == expected.text
    assert choice.finish_reason == "length"
    assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert reply.usage.completion_tokens == len(expected.token_ids) == 12
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 12
    assert reply.id.startswith("chatcmpl-") and reply.model == _model(served)

    chunks = list(client.chat.completions.create(
        model=_model(served), messages=MESSAGES, stream=True,
        stream_options={"include_usage": True}, extra_body=extra, **case))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == len(expected.prompt_token_ids)
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_completion_of_text_ids_and_a_batch_equals_offline(served, client):
    prompts = ["w5 w6 w7", [9, 10, 11, 12]]
    params = SamplingParams(**GREEDY, ignore_eos=True)
    expected = [o.text for o in served.llm.generate(prompts, params)]
    with served.client() as grpc_client:
        assert [grpc_client.generate(p, **GREEDY, ignore_eos=True).text for p in prompts] == \
            expected
    for prompt, want in zip(prompts, expected):
        reply = client.completions.create(model=_model(served), prompt=prompt,
                                          extra_body={"ignore_eos": True}, **GREEDY)
        assert reply.choices[0].text == want and reply.object == "text_completion"
        streamed = client.completions.create(model=_model(served), prompt=prompt, stream=True,
                                             extra_body={"ignore_eos": True}, **GREEDY)
        assert "".join(c.choices[0].text for c in streamed) == want
    batch = client.completions.create(model=_model(served), prompt=prompts,
                                      extra_body={"ignore_eos": True}, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == expected
    assert batch.usage.completion_tokens == 24
    # streamed, the two interleave; each choice's text is whole in its own chunks
    texts = ["", ""]
    for chunk in client.completions.create(model=_model(served), prompt=prompts, stream=True,
                                           extra_body={"ignore_eos": True}, **GREEDY):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == expected
    # echo puts the prompt before the text
    echoed = client.completions.create(model=_model(served), prompt="w5 w6 w7", echo=True,
                                       extra_body={"ignore_eos": True}, **GREEDY)
    assert echoed.choices[0].text == "w5 w6 w7" + expected[0]


def test_a_repeated_prompt_counts_its_cached_tokens(served, client):
    messages = [{"role": "user", "content": " ".join(f"w{i}" for i in range(60, 110))}]
    first, second = (client.chat.completions.create(model=_model(served), messages=messages,
                                                    **GREEDY) for _ in range(2))
    assert first.choices[0].message.content == second.choices[0].message.content
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 16 == 0 and cached <= second.usage.prompt_tokens


def test_chat_logprobs_equal_offline(served, client):
    expected = served.llm.chat(MESSAGES, SamplingParams(**GREEDY, logprobs=3))[0]
    reply = client.chat.completions.create(model=_model(served), messages=MESSAGES,
                                           logprobs=True, top_logprobs=3, **GREEDY)
    content = reply.choices[0].logprobs.content
    assert len(content) == len(expected.token_ids)
    tokenizer = served.llm.tokenizer
    for entry, token_id, want in zip(content, expected.token_ids, expected.logprobs):
        assert entry.logprob == pytest.approx(want[token_id], abs=1e-5)
        assert len(entry.top_logprobs) == 3
        best = sorted(want.items(), key=lambda kv: -kv[1])[:3]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            [v for _, v in best], abs=1e-5)
        assert entry.token == tokenizer.decode([token_id], skip_special_tokens=False)
        assert entry.bytes == list(entry.token.encode())


def test_echo_with_logprobs_scores_the_prompt_as_loglikelihood_evaluation_asks(served, client):
    """lm-eval's `local-completions` scores a context + continuation: echo, logprobs and
    max_tokens 0 give each prompt token's logprob given those before it (the first has none),
    nothing generated; they equal the offline engine's prompt_logprobs."""
    prompt = [5, 9, 14, 3, 77, 120, 42, 8]
    (expected,) = served.llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0,
                                                               prompt_logprobs=2))
    tokenizer = served.llm.tokenizer
    for stream in (False, True):
        reply = client.completions.create(model=_model(served), prompt=prompt, echo=True,
                                          logprobs=2, max_tokens=0, stream=stream)
        choices = [reply.choices[0]] if not stream else [c.choices[0] for c in reply]
        text = "".join(c.text for c in choices)
        logprobs = [c.logprobs for c in choices if c.logprobs]
        tokens = [t for lp in logprobs for t in lp.tokens]
        values = [v for lp in logprobs for v in lp.token_logprobs]
        tops = [t for lp in logprobs for t in lp.top_logprobs]
        assert text == tokenizer.decode(prompt, skip_special_tokens=False)
        assert tokens == [tokenizer.decode([t], skip_special_tokens=False) for t in prompt]
        assert values[0] is None and tops[0] is None
        want = [entry[token] for entry, token in zip(expected.prompt_logprobs[1:], prompt[1:])]
        assert values[1:] == pytest.approx(want, abs=1e-5)
        for top, entry in zip(tops[1:], expected.prompt_logprobs[1:]):
            best = sorted(entry.values(), reverse=True)[:2]
            assert sorted(top.values(), reverse=True)[:2] == pytest.approx(best, abs=1e-5)
        offsets = [o for lp in logprobs for o in lp.text_offset]
        assert offsets == sorted(offsets) and offsets[0] == 0
        if not stream:
            assert reply.usage.completion_tokens == 0
            assert reply.usage.prompt_tokens == len(prompt)


def test_models_and_health(served, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [_model(served)]
    assert _http(served, "GET", "/health") == (200, None)


BAD = [
    (dict(temperature=-1), 400, "temperature"),
    (dict(top_p=2.0), 400, "top_p"),
    (dict(max_tokens="many"), 400, "max_tokens"),
    (dict(messages=[]), 400, "messages"),
    (dict(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400, "messages"),
    (dict(n=2), 400, "n"),
    (dict(logprobs=True, top_logprobs=21), 400, "logprobs"),
    (dict(top_logprobs=2), 400, "top_logprobs"),
    (dict(stream_options={"include_usage": True}), 400, "stream_options"),
    (dict(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools"),
    (dict(stop=[1, 2]), 400, "stop"),
    (dict(seed=1.5), 400, "seed"),
    (dict(messages=[{"role": "user", "content": "w5 " * 600}]), 400, "prompt"),
    (dict(model="no-such-model"), 404, "model"),
]


@pytest.mark.parametrize("fields, status, param", BAD)
def test_bad_chat_requests_get_their_status_and_param(served, fields, status, param):
    body = {"model": _model(served), "messages": MESSAGES, "max_tokens": 4, **fields}
    code, reply = _http(served, "POST", "/v1/chat/completions", body)
    assert code == status, reply
    error = reply["error"]
    assert error["param"] == param and error["message"], error
    assert error["type"] == ("invalid_request_error" if status == 400 else "not_found_error")


def test_bad_completion_requests_and_bodies(served, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=_model(served), prompt=[5, 999], max_tokens=4)
    assert e.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=_model(served), prompt="w5", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="w5", max_tokens=4)
    for body, status in ((b"{not json", 400), (b"[1, 2]", 400), (b"x" * (5 << 20), 400)):
        code, reply = _http(served, "POST", "/v1/completions", body)
        assert code == status and "error" in reply, reply
    assert _http(served, "POST", "/v1/embeddings", {})[0] == 404
    assert _http(served, "GET", "/v1/completions")[0] == 405


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(served):
    """The stream is dropped after a few events; its worker aborts the request (counted) and
    frees its blocks long before the 480 tokens it was asked for were made."""
    def aborted() -> int:
        with served.client() as c:
            return sum(w.num_requests_aborted for w in c.health().workers)

    before = aborted()
    body = {"model": _model(served), "prompt": "w5 w6 w7", "max_tokens": 480,
            "ignore_eos": True, "stream": True}
    conn = http.client.HTTPConnection("127.0.0.1", served.config.http_port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"content-type": "application/json"})
    reply = conn.getresponse()
    assert reply.status == 200
    events = []
    while len(events) < 3:
        line = reply.readline().decode()
        if line.startswith("data: {"):
            events.append(json.loads(line[6:]))
    conn.close()  # the client goes away mid-stream
    assert all(e["choices"][0]["finish_reason"] is None for e in events)
    deadline = time.monotonic() + 20
    while aborted() == before:
        assert time.monotonic() < deadline, "the worker never aborted the request"
        time.sleep(0.1)
    served.wait_idle()
