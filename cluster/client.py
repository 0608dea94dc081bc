"""A Python client for an mxserve server (gRPC through Ray Serve's proxy)::

    from mxserve.cluster.client import Client
    with Client("127.0.0.1:9000") as client:
        for chunk in client.stream(messages=[{"role": "user", "content": "Hi!"}], max_tokens=32):
            print(chunk.text, end="", flush=True)
        print(client.generate("The capital of France is", max_tokens=8, temperature=0).text)

Sampling keywords are SamplingParams' (vLLM's) names. Failures raise `grpc.RpcError`, whose
`.code()` is INVALID_ARGUMENT (details name the field), RESOURCE_EXHAUSTED (its trailing
metadata `retry-after-ms` says when to retry), UNAUTHENTICATED, DEADLINE_EXCEEDED... A server
with auth on takes `api_key` (default: the MXSERVE_API_KEY environment variable).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from mxserve.proto import mxserve_pb2 as pb
from mxserve.proto import mxserve_pb2_grpc as pb_grpc

API_KEY_ENV = "MXSERVE_API_KEY"  # the API's bearer token(s) (ServeConfig.api_key's default)


@dataclass
class Completion:
    """A whole streamed answer, put together."""

    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    stop_reason: int | str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[dict[int, float]] | None = None
    # prompt_logprobs: per prompt token, None for the first, else {its id: lp, top ids: lp}
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # speculative decoding: steps that verified drafts, drafts verified, drafts kept
    num_drafts: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0


def build_request(prompt: str | list[int] | None = None, *, messages: list[dict] | None = None,
                  model: str = "", request_id: str = "", add_generation_prompt: bool = True,
                  **sampling) -> pb.GenerateRequest:
    """A GenerateRequest from a text or token-id prompt, or chat messages, plus sampling
    keywords (unknown ones raise ValueError)."""
    request = pb.GenerateRequest(model=model, request_id=request_id,
                                 sampling_params=pb.SamplingParams(**_none_dropped(sampling)))
    if messages is not None:
        request.chat.CopyFrom(pb.ChatMessages(
            messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages],
            add_generation_prompt=add_generation_prompt))
    elif isinstance(prompt, str):
        request.text = prompt
    elif prompt is not None:
        request.token_ids.CopyFrom(pb.TokenIds(ids=list(prompt)))
    return request


class Client:
    """A connection to one endpoint ("host:port"). `app_name` selects the Serve application
    (needed only when the cluster serves several)."""

    def __init__(self, endpoint: str = "127.0.0.1:9000", app_name: str | None = "mxserve",
                 timeout_s: float | None = None, api_key: str | None = None) -> None:
        self.channel = grpc.insecure_channel(endpoint)
        self.stub = pb_grpc.MxServeStub(self.channel)
        self.metadata: tuple[tuple[str, str], ...] = \
            (("application", app_name),) if app_name else ()
        api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV, "")
        api_key = api_key.split(",")[0].strip()  # (a server may accept several)
        if api_key:
            self.metadata += (("authorization", f"Bearer {api_key}"),)
        self.timeout_s = timeout_s

    def stream(self, prompt: str | list[int] | None = None, *, timeout_s: float | None = None,
               **kwargs) -> Iterator[pb.GenerateResponse]:
        """Yield the server's responses as they come (see `build_request` for the arguments).
        Closing the iterator early cancels the request on the server."""
        call = self.stub.Generate(build_request(prompt, **kwargs), metadata=self.metadata,
                                  timeout=timeout_s or self.timeout_s)
        try:
            yield from call
        finally:
            call.cancel()  # a no-op once the stream ended

    def generate(self, prompt: str | list[int] | None = None, **kwargs) -> Completion:
        """The whole answer to one request."""
        done = Completion()
        for r in self.stream(prompt, **kwargs):
            done.request_id = r.request_id
            done.text += r.text
            done.token_ids += r.token_ids
            if r.logprobs:
                done.logprobs = (done.logprobs or []) + [
                    dict(zip(lp.token_ids, lp.logprobs)) for lp in r.logprobs]
            if r.prompt_logprobs:
                done.prompt_logprobs = [dict(zip(lp.token_ids, lp.logprobs)) if lp.logprobs
                                        else None for lp in r.prompt_logprobs]
            if r.finish_reason:
                done.finish_reason = r.finish_reason
                done.stop_reason = _stop_reason(r)
                u = r.usage
                done.prompt_tokens, done.cached_tokens = u.prompt_tokens, u.cached_tokens
                done.completion_tokens = u.completion_tokens
                done.num_drafts, done.draft_tokens = u.num_drafts, u.draft_tokens
                done.accepted_draft_tokens = u.accepted_draft_tokens
        return done

    def chat(self, messages: list[dict], **kwargs) -> Completion:
        return self.generate(messages=messages, **kwargs)

    def list_models(self) -> pb.ListModelsResponse:
        return self.stub.ListModels(pb.ListModelsRequest(), metadata=self.metadata,
                                    timeout=self.timeout_s)

    def health(self) -> pb.HealthResponse:
        return self.stub.Health(pb.HealthRequest(), metadata=self.metadata,
                                timeout=self.timeout_s)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _none_dropped(sampling: dict) -> dict:
    return {k: ([v] if k == "stop" and isinstance(v, str) else v)
            for k, v in sampling.items() if v is not None}


def _stop_reason(response: pb.GenerateResponse) -> int | str | None:
    kind = response.WhichOneof("stop_reason")
    return getattr(response, kind) if kind else None
