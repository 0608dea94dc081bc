"""A `GenerateRequest` message -> prompt token ids and `SamplingParams`, validated.

Every rejection is an InvalidRequestError naming the request field ("model", "prompt",
"messages", "temperature", ...); the router turns it into INVALID_ARGUMENT. `RequestLimits` caps
what one request may make the router hold or do (characters to tokenize, chat messages, stop
strings), checked before any of that work.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mxserve.api.errors import InvalidRequestError
from mxserve.api.sampling_params import SamplingParams
from mxserve.api.tokenizer import Tokenizer
from mxserve.proto import mxserve_pb2 as pb

# Chat roles a request may use (OpenAI's, less the deprecated "function").
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
# Optional scalar fields of pb.SamplingParams that map 1:1 onto SamplingParams; unset -> default.
_OPTIONAL = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty",
             "presence_penalty", "frequency_penalty", "min_tokens", "logprobs",
             "prompt_logprobs", "skip_special_tokens")


@dataclass(frozen=True)
class ModelCard:
    """What the router knows of the served model without loading its weights."""

    name: str  # what clients pass as `model` ("" also selects it)
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    # The checkpoint's sampling defaults (Checkpoint.generation_defaults) for unset fields.
    generation_defaults: dict = field(default_factory=dict)


@dataclass(frozen=True)
class RequestLimits:
    """Caps on one request (cluster/config.Limits sets them). Each bounds work or memory the
    router spends before the engine's own checks apply: a prompt is tokenized on the router,
    stop strings are matched against every token's text."""

    max_prompt_tokens: int | None = None  # None: up to the context length
    max_prompt_chars: int | None = None  # text + chat contents; None: 32 per context token
    max_chat_messages: int = 1024
    max_stop_strings: int = 64
    max_stop_chars: int = 1024  # per stop string
    max_stop_token_ids: int = 1024
    max_request_id_chars: int = 256
    max_prompts: int = 64  # prompts in one /v1/completions request (router/openai.py)

    def prompt_chars(self, card: ModelCard) -> int:
        return self.max_prompt_chars or 32 * card.max_model_len


def check_limits(request: pb.GenerateRequest, limits: RequestLimits, card: ModelCard) -> None:
    """InvalidRequestError naming the field when `request` is past one of `limits`: a cheap
    pass over the message before tokenizing anything."""
    if len(request.request_id) > limits.max_request_id_chars:
        raise InvalidRequestError("request_id", f"has {len(request.request_id)} characters; "
                                                f"the limit is {limits.max_request_id_chars}")
    max_chars = limits.prompt_chars(card)
    kind = request.WhichOneof("prompt")
    if kind == "chat":
        messages = request.chat.messages
        if len(messages) > limits.max_chat_messages:
            raise InvalidRequestError("messages", f"has {len(messages)} messages; the limit is "
                                                  f"{limits.max_chat_messages}")
        num_chars = sum(len(m.content) + len(m.role) for m in messages)
    else:
        num_chars = len(request.text) if kind == "text" else 0
    if num_chars > max_chars:
        field_name = "messages" if kind == "chat" else "prompt"
        raise InvalidRequestError(field_name, f"has {num_chars} characters; the limit is "
                                              f"{max_chars}")
    sp = request.sampling_params
    if len(sp.stop) > limits.max_stop_strings:
        raise InvalidRequestError("stop", f"has {len(sp.stop)} strings; the limit is "
                                          f"{limits.max_stop_strings}")
    if any(len(s) > limits.max_stop_chars for s in sp.stop):
        raise InvalidRequestError("stop", f"a stop string is longer than "
                                          f"{limits.max_stop_chars} characters")
    if len(sp.stop_token_ids) > limits.max_stop_token_ids:
        raise InvalidRequestError("stop_token_ids", f"has {len(sp.stop_token_ids)} ids; the "
                                                    f"limit is {limits.max_stop_token_ids}")


def sampling_params(msg: pb.SamplingParams, defaults: dict | None = None) -> SamplingParams:
    """Unset fields take the model's `defaults`, then SamplingParams' own, except max_tokens:
    unset means until EOS or the context ends, as in vLLM's server (docs/sampling.md)."""
    kwargs = {name: getattr(msg, name) for name in (*_OPTIONAL, "max_tokens")
              if msg.HasField(name)}
    return SamplingParams.from_defaults(
        defaults or {}, stop=tuple(msg.stop), stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos, include_stop_str_in_output=msg.include_stop_str_in_output,
        **kwargs)


def prompt_token_ids(request: pb.GenerateRequest, tokenizer: Tokenizer, card: ModelCard,
                     max_prompt_tokens: int | None = None) -> tuple[list[int], str | None]:
    """(prompt ids, the prompt text when there is one), as offline `LLM.generate`/`LLM.chat`
    would build them. Checks the model name, emptiness, id range and the context length (and
    max_prompt_tokens, when given)."""
    if request.model and request.model != card.name:
        raise InvalidRequestError("model", f"unknown model {request.model[:100]!r}; this server "
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
    if not ids:
        raise InvalidRequestError("prompt", "is empty")
    if len(ids) >= card.max_model_len:
        raise InvalidRequestError(
            "prompt", f"has {len(ids)} tokens; the model's context is {card.max_model_len}")
    if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
        raise InvalidRequestError(
            "prompt", f"has {len(ids)} tokens; this server's limit is {max_prompt_tokens}")
    if kind == "token_ids" and not all(0 <= t < card.vocab_size for t in ids):
        raise InvalidRequestError("prompt", f"token ids must be in [0, {card.vocab_size})")
    return ids, text


def _render_chat(chat: pb.ChatMessages, tokenizer: Tokenizer) -> str:
    if not chat.messages:
        raise InvalidRequestError("messages", "is empty")
    for i, m in enumerate(chat.messages):
        if not m.role:
            raise InvalidRequestError("messages", f"message {i} has no role")
        if m.role not in CHAT_ROLES:
            raise InvalidRequestError("messages", f"message {i} has role {m.role[:64]!r}; "
                                                  f"roles are {', '.join(sorted(CHAT_ROLES))}")
    messages = [{"role": m.role, "content": m.content} for m in chat.messages]
    add = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add)
