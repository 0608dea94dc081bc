"""The offline API: `LLM(model=..., **engine_options).generate(prompts, sampling_params)`.

Each request's token ids go through the same `OutputStream` the router uses (api/stream.py:
incremental detokenization and stop strings), so offline and served outputs are made alike.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from mxserve.api.errors import InvalidRequestError
from mxserve.api.outputs import StepOutput
from mxserve.api.sampling_params import SamplingParams
from mxserve.api.stream import OutputStream
from mxserve.worker.config import EngineConfig
from mxserve.worker.engine import Engine, build_engine
from mxserve.worker.request import Request

Prompt = str | list[int]
Message = dict[str, str]


@dataclass
class RequestOutput:
    """One prompt's finished generation."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None
    # SamplingParams.prompt_logprobs: an entry per prompt token, None for the first, else
    # {that token's id: lp, then each top-n id: lp} (StepOutput.prompt_logprobs)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int = 0
    # speculative decoding: steps that verified drafts, drafts verified, drafts kept
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class LLM:
    """Runs an engine in this process and generates for batches of prompts."""

    def __init__(self, model: str | None = None, **engine_options) -> None:
        self.config = EngineConfig(model=model, **engine_options)
        self.engine: Engine = build_engine(self.config)
        self.tokenizer = self.engine.tokenizer
        if self.engine.runner.followers is not None:  # the other ranks end with this LLM
            weakref.finalize(self, self.engine.runner.followers.close)

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks' processes now (also when this LLM is
        collected, or at exit); it cannot generate after."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Generate for each prompt (a string, or a list of token ids); outputs in prompt order.
        Without `sampling_params`, the model's generation defaults apply (docs/sampling.md).

        A bad prompt or parameter raises InvalidRequestError before anything runs.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = self._params_per_prompt(sampling_params, len(prompts))
        requests = [self._make_request(p, sp) for p, sp in zip(prompts, params)]  # validate all
        outputs = {}
        for request, prompt in zip(requests, prompts):
            self.engine.add(request)
            outputs[request.request_id] = (RequestOutput(
                request.request_id, prompt if isinstance(prompt, str) else None,
                request.prompt_token_ids), self._output_stream(request))
        self._run(outputs)
        return [out for out, _ in outputs.values()]

    def stream(self, prompt_token_ids: list[int], sampling_params: SamplingParams | None = None
               ) -> Iterator[str]:
        """Generate for one prompt and yield its text as it comes (what `mxserve chat` prints);
        closing the iterator early aborts the request."""
        request = self._make_request(prompt_token_ids,
                                     sampling_params or self.default_sampling_params())
        self.engine.add(request)
        out = {request.request_id: (RequestOutput(request.request_id, None, prompt_token_ids),
                                    self._output_stream(request))}
        try:
            while self.engine.has_unfinished_requests():
                for delta in self.engine.step():
                    if (text := self._take(out, delta)):
                        yield text
        finally:
            self._abort_all()

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        self._need_tokenizer("chat messages")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        texts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt)
                 for c in conversations]
        ids = [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        outputs = self.generate(ids, sampling_params)
        for out, text in zip(outputs, texts):
            out.prompt = text
        return outputs

    def _params_per_prompt(self, sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.default_sampling_params()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        if len(sampling_params) != n:
            raise InvalidRequestError("sampling_params",
                                      f"got {len(sampling_params)} for {n} prompts")
        return list(sampling_params)

    def _make_request(self, prompt: Prompt, params: SamplingParams) -> Request:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "is empty")
            self._need_tokenizer("a text prompt")
            prompt = self.tokenizer.encode(prompt)
        elif not isinstance(prompt, list):
            raise InvalidRequestError("prompt", "must be a string or a list of token ids")
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop", "stop strings need a tokenizer, and this model has "
                                      "none (dummy weights): use stop_token_ids")
        return self.engine.make_request(prompt, params)

    def _need_tokenizer(self, what: str) -> None:
        if self.tokenizer is None:
            raise InvalidRequestError("prompt", f"{what} needs a tokenizer, and this model has "
                                      "none (dummy weights): pass token ids")

    def default_sampling_params(self) -> SamplingParams:
        """What a request without sampling_params gets: the model's generation defaults, with
        SamplingParams' own max_tokens (16) unless the model sets one (vLLM's rule)."""
        return SamplingParams.from_defaults(
            {"max_tokens": SamplingParams.max_tokens, **self.engine.generation_defaults})

    def _output_stream(self, request: Request) -> OutputStream:
        return OutputStream(self.tokenizer, request.prompt_token_ids, request.sampling_params,
                            request.eos_token_ids)

    def _run(self, outputs: dict[str, tuple[RequestOutput, OutputStream]]) -> None:
        try:
            while self.engine.has_unfinished_requests():
                for delta in self.engine.step():
                    self._take(outputs, delta)
        finally:
            self._abort_all()

    def _take(self, outputs: dict[str, tuple[RequestOutput, OutputStream]],
              delta: StepOutput) -> str:
        """Add one engine delta to its request's output; returns the new text. A stop string
        the stream finds ends the request in the engine too."""
        out, stream = outputs[delta.request_id]
        if delta.prompt_logprobs is not None:
            out.prompt_logprobs = delta.prompt_logprobs
        if stream.finished:  # ended by a stop string; this is its in-flight token
            return ""
        num_new = stream.add(delta.new_token_ids, delta.finish_reason)
        out.token_ids += delta.new_token_ids[:num_new]
        if delta.new_logprobs:
            out.logprobs = (out.logprobs or []) + delta.new_logprobs[:num_new]
        out.num_cached_tokens = delta.num_cached_tokens
        out.num_drafts, out.num_draft_tokens = delta.num_drafts, delta.num_draft_tokens
        out.num_accepted_tokens = delta.num_accepted_tokens
        text = stream.take_text()
        out.text += text
        out.finish_reason = stream.finish_reason
        if stream.finished and not delta.finished:
            self.engine.abort(delta.request_id)
        return text

    def _abort_all(self) -> None:
        """Leave no request holding KV blocks (after an interrupt, or a stream closed early)."""
        for rid in list(self.engine.requests):
            self.engine.abort(rid)
