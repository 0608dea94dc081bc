"""OpenAI's request and response bodies <-> the gRPC API's messages, with no HTTP in it.

A chat or completion body becomes the same `pb.GenerateRequest` a gRPC client sends (so one path
validates, routes and serves both); the `pb.GenerateResponse` stream becomes OpenAI's JSON
objects. Fields follow OpenAI's API plus vLLM's extras (top_k, min_p, repetition_penalty,
ignore_eos, min_tokens, stop_token_ids, include_stop_str_in_output, skip_special_tokens,
add_generation_prompt). A field of the wrong type or a feature not served (n > 1, tools, logit
bias, suffix) raises InvalidRequestError naming it; ranges are checked where the gRPC path checks
them (SamplingParams), so both APIs give the same message.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mxserve.api.errors import InvalidRequestError
from mxserve.proto import mxserve_pb2 as pb

_NUMBER = (int, float)
# body field -> pb.SamplingParams field, with the JSON types accepted (bool is no number here)
_SAMPLING = {"temperature": _NUMBER, "top_p": _NUMBER, "top_k": int, "min_p": _NUMBER,
             "seed": int, "repetition_penalty": _NUMBER, "presence_penalty": _NUMBER,
             "frequency_penalty": _NUMBER, "min_tokens": int}
_FLAGS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens")
# Fields that ask for what is not served: None (or the listed value) is the only one accepted.
_UNSUPPORTED = {"tools": None, "functions": None, "logit_bias": None, "suffix": None,
                "prompt_logprobs": None, "tool_choice": "none", "function_call": "none"}
_INT32 = 2**31 - 1


@dataclass
class Parsed:
    """A body as requests for the router plus what shapes the reply."""

    requests: list[pb.GenerateRequest]  # one per prompt (a completion may batch several)
    model: str
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with usage
    echo: bool = False  # completions: the prompt goes before the text
    drop_output: bool = False  # echo with max_tokens 0: one token made, none returned
    top_logprobs: int | None = None  # how many alternatives a token's logprobs list
    prompts: list[str | None] = field(default_factory=list)  # each prompt's text (echo)


def _get(body: dict, name: str, types: Any, default: Any = None) -> Any:
    """body[name] checked against `types` (None is unset); bool never passes for a number."""
    value = body.get(name)
    if value is None:
        return default
    numeric = types in (int, _NUMBER)
    if not isinstance(value, types) or (numeric and isinstance(value, bool)):
        names = {int: "an integer", _NUMBER: "a number", bool: "a boolean", str: "a string",
                 list: "an array", dict: "an object"}
        raise InvalidRequestError(name, f"must be {names.get(types, types)}, got "
                                        f"{type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidRequestError(name, f"must be finite, got {value!r}")
    if isinstance(value, int) and numeric and name != "seed" and abs(value) > _INT32:
        raise InvalidRequestError(name, f"is out of range: {value}")
    return value


def _check_served(body: dict) -> None:
    for name, allowed in _UNSUPPORTED.items():
        value = body.get(name)
        if value not in (None, allowed) and value != {} and value != []:
            raise InvalidRequestError(name, "is not supported by this server")
    for name in ("n", "best_of"):
        if _get(body, name, int, 1) != 1:
            raise InvalidRequestError(name, "only 1 is supported")
    response_format = _get(body, "response_format", dict)
    if response_format and response_format.get("type", "text") != "text":
        raise InvalidRequestError("response_format", "only {\"type\": \"text\"} is supported")


def _sampling(body: dict, max_tokens_names: tuple[str, ...]) -> pb.SamplingParams:
    sp = pb.SamplingParams()
    for name, types in _SAMPLING.items():
        value = _get(body, name, types)
        if value is not None:
            setattr(sp, name, value)
    for name in max_tokens_names:  # the first one set wins
        value = _get(body, name, int)
        if value is not None:
            if value < 0:
                raise InvalidRequestError(name, f"must be >= 0, got {value}")
            sp.max_tokens = value
            break
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise InvalidRequestError("stop", "must be a string or an array of strings")
        sp.stop.extend(stop)
    ids = _get(body, "stop_token_ids", list)
    if ids is not None:
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= _INT32
                   for i in ids):
            raise InvalidRequestError("stop_token_ids", "must be an array of token ids")
        sp.stop_token_ids.extend(ids)
    for name in _FLAGS:
        value = _get(body, name, bool)
        if value is not None:
            setattr(sp, name, value)
    return sp


def _stream_options(body: dict, stream: bool) -> bool:
    options = _get(body, "stream_options", dict)
    if options is None:
        return False
    if not stream:
        raise InvalidRequestError("stream_options", "is only allowed with stream: true")
    return bool(_get(options, "include_usage", bool, False))


def parse_chat(body: dict) -> Parsed:
    """A /v1/chat/completions body."""
    _check_served(body)
    messages = _get(body, "messages", list)
    if not messages:
        raise InvalidRequestError("messages", "must be a non-empty array")
    chat = pb.ChatMessages()
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequestError("messages", f"message {i} must be an object")
        role = message.get("role")
        if not isinstance(role, str):
            raise InvalidRequestError("messages", f"message {i} needs a string role")
        chat.messages.add(role=role, content=_content(message.get("content"), i))
    add = _get(body, "add_generation_prompt", bool)
    if add is not None:
        chat.add_generation_prompt = add
    sp = _sampling(body, ("max_completion_tokens", "max_tokens"))
    if sp.HasField("max_tokens") and sp.max_tokens == 0:
        raise InvalidRequestError("max_tokens", "must be >= 1")
    top = None
    if _get(body, "logprobs", bool, False):
        top = _get(body, "top_logprobs", int, 0)
        sp.logprobs = top
    elif body.get("top_logprobs") is not None:
        raise InvalidRequestError("top_logprobs", "needs logprobs: true")
    stream = _get(body, "stream", bool, False)
    return Parsed([pb.GenerateRequest(model=_model(body), chat=chat, sampling_params=sp)],
                  _model(body), stream, _stream_options(body, stream), top_logprobs=top)


def _content(content: Any, i: int) -> str:
    """A message's text: a string, or the text parts of an array of parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise InvalidRequestError("messages", f"message {i}: only text content parts "
                                                      "are supported")
            texts.append(part["text"])
        return "\n".join(texts)
    raise InvalidRequestError("messages", f"message {i}: content must be a string or an array "
                                          "of text parts")


def _model(body: dict) -> str:
    return _get(body, "model", str, "")


def parse_completion(body: dict, max_prompts: int) -> Parsed:
    """A /v1/completions body; `prompt` may be a string, token ids, or an array of either."""
    _check_served(body)
    prompts = _prompts(body.get("prompt"), max_prompts)
    sp = _sampling(body, ("max_tokens",))
    echo = _get(body, "echo", bool, False)
    if not sp.HasField("max_tokens"):
        sp.max_tokens = 16  # OpenAI's default for completions
    drop = sp.max_tokens == 0
    if drop:
        if not echo:
            raise InvalidRequestError("max_tokens", "must be >= 1 (0 only with echo)")
        sp.max_tokens = 1  # the prompt's scoring comes with one token, not returned
    top = _get(body, "logprobs", int)
    if top is not None:
        sp.logprobs = top
        if echo:
            sp.prompt_logprobs = top
    stream = _get(body, "stream", bool, False)
    model = _model(body)
    requests = []
    for prompt in prompts:
        request = pb.GenerateRequest(model=model, sampling_params=sp)
        if isinstance(prompt, str):
            request.text = prompt
        else:
            request.token_ids.ids.extend(prompt)
        requests.append(request)
    return Parsed(requests, model, stream, _stream_options(body, stream), echo, drop, top,
                  [p if isinstance(p, str) else None for p in prompts])


def _prompts(prompt: Any, max_prompts: int) -> list[str | list[int]]:
    def is_ids(x: Any) -> bool:
        return isinstance(x, list) and bool(x) and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= _INT32 for t in x)

    if isinstance(prompt, str) or is_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p)
                                                     for p in prompt):
        prompts = prompt
    else:
        raise InvalidRequestError("prompt", "must be a string, an array of token ids, or a "
                                            "non-empty array of either")
    if len(prompts) > max_prompts:
        raise InvalidRequestError("prompt", f"has {len(prompts)} prompts; the limit is "
                                            f"{max_prompts}")
    return prompts


# ---- responses ----------------------------------------------------------------------------
def usage(u: pb.Usage, drop_output: bool = False) -> dict:
    completion = 0 if drop_output else u.completion_tokens
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": completion,
            "total_tokens": u.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def add_usage(a: dict | None, b: dict) -> dict:
    if a is None:
        return b
    total = {k: a[k] + b[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    cached = a["prompt_tokens_details"]["cached_tokens"] + \
        b["prompt_tokens_details"]["cached_tokens"]
    return {**total, "prompt_tokens_details": {"cached_tokens": cached}}


def _top(lp: pb.TokenLogprobs, n: int) -> list[tuple[int, float]]:
    """The n most likely of a token's logprob entries (its sampled token comes first)."""
    return sorted(zip(lp.token_ids, lp.logprobs), key=lambda e: -e[1])[:n]


def chat_logprobs(lps, n: int, token_text: Callable[[int], str]) -> list[dict]:
    """OpenAI's chat `logprobs.content` entries for the tokens of one response."""
    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return [{**entry(lp.token_ids[0], lp.logprobs[0]),
             "top_logprobs": [entry(t, v) for t, v in _top(lp, n)]} for lp in lps]


@dataclass
class CompletionLogprobs:
    """OpenAI's completion `logprobs` object, built token by token (echo: the prompt's first)."""

    n: int
    token_text: Callable[[int], str]
    offset: int = 0  # characters of text before the next token
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(self, lp: pb.TokenLogprobs) -> None:
        """One token: its id first; no logprobs for a prompt's first token."""
        text = self.token_text(lp.token_ids[0])
        self.tokens.append(text)
        self.text_offset.append(self.offset)
        self.offset += len(text)
        if not lp.logprobs:
            self.token_logprobs.append(None)
            self.top_logprobs.append(None)
            return
        self.token_logprobs.append(lp.logprobs[0])
        top = dict(_top(lp, self.n))
        top.setdefault(lp.token_ids[0], lp.logprobs[0])  # the chosen token is always listed
        self.top_logprobs.append({self.token_text(t): v for t, v in top.items()})

    def take(self) -> dict:
        """What was added since the last take, as OpenAI's object."""
        out = {"tokens": self.tokens, "token_logprobs": self.token_logprobs,
               "top_logprobs": self.top_logprobs, "text_offset": self.text_offset}
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return out
