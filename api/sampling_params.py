"""Per-request sampling parameters, validated once at construction (vLLM's names and defaults)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from mxserve.api.errors import InvalidRequestError


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(field_name, message)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    """A finite int or float (NaN and infinities are no sampling parameter's value)."""
    return _is_int(x) or (isinstance(x, float) and math.isfinite(x))


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature 0 means greedy. top_k 0 (or -1) and top_p 1 and min_p 0 disable those filters.
    Penalties follow vLLM: repetition_penalty (> 1 discourages) applies to prompt and output tokens,
    presence/frequency penalties to output tokens only. `stop` strings end generation when they
    appear in the detokenized output (not included unless include_stop_str_in_output). `seed` makes
    a sampled request reproducible regardless of what it is batched with. `logprobs` = n returns,
    per output token, the log-probability of the sampled token and of the n most likely ones (raw
    model distribution, before temperature and filters). `prompt_logprobs` = n returns, for each
    prompt token after the first, the log-probability of that token given the ones before it and
    of the n most likely tokens there (raw distribution too); a request asking for them computes
    its whole prompt (no prefix-cache hits: cached tokens have no logits).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # Normalise list-valued fields first so frozen instances stay hashable.
        object.__setattr__(self, "stop", _normalize_stop(self.stop))
        object.__setattr__(self, "stop_token_ids", _normalize_ids(self.stop_token_ids))
        _check(_is_number(self.temperature) and self.temperature >= 0, "temperature",
               f"must be a finite number >= 0, got {self.temperature!r}")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p",
               f"must be in (0, 1], got {self.top_p!r}")
        _check(_is_int(self.top_k) and self.top_k >= -1, "top_k",
               f"must be an integer >= -1 (0 or -1 disables), got {self.top_k!r}")
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p",
               f"must be in [0, 1], got {self.min_p!r}")
        _check(self.seed is None or _is_int(self.seed), "seed",
               f"must be an integer or None, got {self.seed!r}")
        _check(_is_number(self.repetition_penalty) and self.repetition_penalty > 0,
               "repetition_penalty", f"must be > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2 <= value <= 2, name,
                   f"must be in [-2, 2], got {value!r}")
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
               "max_tokens", f"must be an integer >= 1 or None, got {self.max_tokens!r}")
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens",
               f"must be an integer >= 0, got {self.min_tokens!r}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (_is_int(value) and 0 <= value <= 20), name,
                   f"must be an integer in [0, 20] or None, got {value!r}")

    @classmethod
    def from_defaults(cls, defaults: Mapping[str, Any], **fields: Any) -> SamplingParams:
        """A request's parameters as the servers and the CLI build them (docs/sampling.md):
        `fields` are what the request set (None = unset); each unset field takes the model's
        default from `defaults` (a checkpoint's generation defaults, whose `max_new_tokens`
        is max_tokens), else the class default, except max_tokens: unset means until EOS or
        the context ends."""
        merged = {"max_tokens": None, **defaults}
        if "max_new_tokens" in merged:
            merged["max_tokens"] = merged.pop("max_new_tokens")
        merged.update((k, v) for k, v in fields.items() if v is not None)
        return cls(**merged)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @cached_property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that changes the logits or asks for logprobs (min_tokens aside:
        it matters only until that many tokens are out). Cached: the sampler asks per request
        per step."""
        return self.greedy and self.logprobs is None and not self.has_penalties


def _normalize_stop(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    _check(isinstance(stop, (list, tuple)), "stop",
           f"must be a string or a list of strings, got {type(stop).__name__}")
    for s in stop:
        _check(isinstance(s, str), "stop", f"must contain strings only, got {type(s).__name__}")
        _check(len(s) > 0, "stop", "stop strings must not be empty")
    return tuple(stop)


def _normalize_ids(ids: Any) -> tuple[int, ...]:
    if ids is None:
        return ()
    _check(isinstance(ids, (list, tuple)), "stop_token_ids",
           f"must be a list of integers, got {type(ids).__name__}")
    for i in ids:
        _check(_is_int(i) and i >= 0, "stop_token_ids", f"must hold integers >= 0, got {i!r}")
    return tuple(ids)
