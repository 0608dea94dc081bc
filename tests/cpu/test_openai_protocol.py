"""OpenAI bodies -> gRPC messages and back (router/openai_protocol.py, router/openai.py's error
bodies), without a server: the mapping of every field, what is refused, and the error format."""

from __future__ import annotations

import pytest

from mxserve.api.errors import (
    INVALID_ARGUMENT,
    NOT_FOUND,
    RESOURCE_EXHAUSTED,
    UNAUTHENTICATED,
    UNAVAILABLE,
    InvalidRequestError,
    ServeError,
)
from mxserve.proto import mxserve_pb2 as pb
from mxserve.router.openai import error_body, error_response
from mxserve.router.openai_protocol import (
    CompletionLogprobs,
    chat_logprobs,
    parse_chat,
    parse_completion,
)

MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "a"},
                                         {"type": "text", "text": "b"}]}]


def test_chat_fields_map_onto_the_grpc_request():
    parsed = parse_chat({"model": "m", "messages": MESSAGES, "temperature": 0.5, "top_p": 0.9,
                         "top_k": 5, "min_p": 0.1, "seed": 2**40, "max_completion_tokens": 7,
                         "max_tokens": 99, "stop": "x", "presence_penalty": 0.5,
                         "frequency_penalty": -0.5, "repetition_penalty": 1.1,
                         "ignore_eos": True, "logprobs": True, "top_logprobs": 3,
                         "stream": True, "stream_options": {"include_usage": True},
                         "user": "ignored", "n": 1, "add_generation_prompt": False})
    (request,) = parsed.requests
    assert [(m.role, m.content) for m in request.chat.messages] == [
        ("system", "Be brief."), ("user", "a\nb")]
    assert request.chat.add_generation_prompt is False and request.model == "m"
    sp = request.sampling_params
    assert (sp.temperature, sp.top_k, sp.seed, sp.max_tokens) == (0.5, 5, 2**40, 7)
    assert list(sp.stop) == ["x"] and sp.ignore_eos and sp.logprobs == 3
    assert sp.repetition_penalty == pytest.approx(1.1)
    assert parsed.stream and parsed.include_usage and parsed.top_logprobs == 3
    unset = parse_chat({"messages": MESSAGES}).requests[0].sampling_params
    assert not unset.HasField("max_tokens") and not unset.HasField("temperature")


@pytest.mark.parametrize("body, field", [
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"content": "hi"}]}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_k": 1.5}, "top_k"),
    ({"max_tokens": 2**40}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"stop": ["a", 3]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"n": 3}, "n"),
    ({"logit_bias": {"5": 1}}, "logit_bias"),
    ({"tools": [{}]}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"model": 5}, "model"),
])
def test_chat_refuses_wrong_types_and_unserved_features_naming_the_field(body, field):
    with pytest.raises(InvalidRequestError) as e:
        parse_chat({"messages": [{"role": "user", "content": "hi"}], **body})
    assert e.value.field == field


def test_completion_prompts_echo_and_logprobs():
    parsed = parse_completion({"prompt": ["a b", [5, 6]], "logprobs": 2, "echo": True,
                               "max_tokens": 0}, max_prompts=4)
    texts = [r.text for r in parsed.requests]
    ids = [list(r.token_ids.ids) for r in parsed.requests]
    assert texts == ["a b", ""] and ids == [[], [5, 6]] and parsed.prompts == ["a b", None]
    sp = parsed.requests[0].sampling_params
    # max_tokens 0 with echo: one token is made (the prompt is scored with it), none returned
    assert sp.max_tokens == 1 and parsed.drop_output and sp.logprobs == 2
    assert parse_completion({"prompt": "a"}, 4).requests[0].sampling_params.max_tokens == 16
    for body, field in (({"prompt": []}, "prompt"), ({"prompt": [[]]}, "prompt"),
                        ({"prompt": ["a"] * 5}, "prompt"), ({"prompt": [1.5]}, "prompt"),
                        ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
                        ({"prompt": "a", "suffix": "z"}, "suffix"),
                        ({"prompt": "a", "best_of": 2}, "best_of")):
        with pytest.raises(InvalidRequestError) as e:
            parse_completion(body, max_prompts=4)
        assert e.value.field == field


def test_errors_are_openai_bodies_with_statuses():
    cases = [(ServeError(INVALID_ARGUMENT, "temperature: bad", "temperature"), 400,
              "invalid_request_error", "temperature"),
             (ServeError(UNAUTHENTICATED, "invalid token", "authorization"), 401,
              "authentication_error", "authorization"),
             (ServeError(NOT_FOUND, "no model", "model"), 404, "not_found_error", "model"),
             (ServeError(RESOURCE_EXHAUSTED, "at capacity", retry_after_s=1.5), 429,
              "rate_limit_error", None),
             (ServeError(UNAVAILABLE, "no worker"), 503, "service_unavailable_error", None)]
    for error, status, kind, param in cases:
        got_status, body = error_body(error)
        assert got_status == status and body["error"]["type"] == kind
        assert body["error"]["param"] == param and body["error"]["message"] == error.message
    response = error_response(cases[3][0])
    assert response.headers["retry-after"] == "2" and response.headers["retry-after-ms"] == \
        "1500"


def test_logprobs_objects():
    lp = pb.TokenLogprobs(token_ids=[7, 3, 7, 9], logprobs=[-0.5, -0.1, -0.5, -2.0])
    text = {3: "c", 7: "g", 9: "i"}.__getitem__
    (entry,) = chat_logprobs([lp], 2, text)
    assert entry["token"] == "g" and entry["logprob"] == -0.5 and entry["bytes"] == [103]
    assert [t["token"] for t in entry["top_logprobs"]] == ["c", "g"]
    built = CompletionLogprobs(1, text)
    built.add(pb.TokenLogprobs(token_ids=[3]))  # a prompt's first token: no logprob
    built.add(lp)
    got = built.take()
    assert got == {"tokens": ["c", "g"], "token_logprobs": [None, -0.5],
                   "top_logprobs": [None, {"c": -0.1, "g": -0.5}], "text_offset": [0, 1]}
    assert built.take()["tokens"] == []
