"""A `GenerateRequest` message -> prompt token ids and `SamplingParams`, validated.

Every rejection is an InvalidRequestError naming the request field ("model", "prompt",
"messages", "temperature", ...); the router turns it into INVALID_ARGUMENT.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mxserve.api.errors import InvalidRequestError
from mxserve.api.sampling_params import SamplingParams
from mxserve.api.tokenizer import Tokenizer
from mxserve.proto import mxserve_pb2 as pb

# Optional scalar fields of pb.SamplingParams that map 1:1 onto SamplingParams; unset -> default.
_OPTIONAL = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty",
             "presence_penalty", "frequency_penalty", "min_tokens", "logprobs",
             "skip_special_tokens")


@dataclass(frozen=True)
class ModelCard:
    """What the router knows of the served model without loading its weights."""

    name: str  # what clients pass as `model` ("" also selects it)
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    # The checkpoint's sampling defaults (Checkpoint.generation_defaults) for unset fields.
    generation_defaults: dict = field(default_factory=dict)


def sampling_params(msg: pb.SamplingParams, defaults: dict | None = None) -> SamplingParams:
    """Unset fields take the model's `defaults`, then SamplingParams' own, except max_tokens:
    unset means until EOS or the context ends, as in vLLM's server (docs/sampling.md)."""
    kwargs = {name: getattr(msg, name) for name in (*_OPTIONAL, "max_tokens")
              if msg.HasField(name)}
    return SamplingParams.from_defaults(
        defaults or {}, stop=tuple(msg.stop), stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos, include_stop_str_in_output=msg.include_stop_str_in_output,
        **kwargs)


def prompt_token_ids(request: pb.GenerateRequest, tokenizer: Tokenizer,
                     card: ModelCard) -> tuple[list[int], str | None]:
    """(prompt ids, the prompt text when there is one), as offline `LLM.generate`/`LLM.chat`
    would build them. Checks the model name, emptiness, id range and the context length."""
    if request.model and request.model != card.name:
        raise InvalidRequestError("model", f"unknown model {request.model!r}; this server "
                                           f"serves {card.name!r}")
    kind = request.WhichOneof("prompt")
    text = None
    if kind is None:
        raise InvalidRequestError("prompt", "is missing: set text, chat or token_ids")
    if kind == "text":
        if not request.text:
            raise InvalidRequestError("prompt", "is empty")
        text, ids = request.text, tokenizer.encode(request.text)
    elif kind == "chat":
        text = _render_chat(request.chat, tokenizer)
        ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        ids = list(request.token_ids.ids)
        if not all(0 <= t < card.vocab_size for t in ids):
            raise InvalidRequestError("prompt", f"token ids must be in [0, {card.vocab_size})")
    if not ids:
        raise InvalidRequestError("prompt", "is empty")
    if len(ids) >= card.max_model_len:
        raise InvalidRequestError(
            "prompt", f"has {len(ids)} tokens; the model's context is {card.max_model_len}")
    return ids, text


def _render_chat(chat: pb.ChatMessages, tokenizer: Tokenizer) -> str:
    if not chat.messages:
        raise InvalidRequestError("messages", "is empty")
    for i, m in enumerate(chat.messages):
        if not m.role:
            raise InvalidRequestError("messages", f"message {i} has no role")
    messages = [{"role": m.role, "content": m.content} for m in chat.messages]
    add = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add)
