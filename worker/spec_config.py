"""Speculative decoding options, as vLLM users pass them: `speculative_config={"method": "eagle"
| "ngram", "model": PATH, "num_speculative_tokens": k}` (EngineConfig, LLM, `mxserve serve
--speculative-config JSON`). Torch-free, so configs validate anywhere."""

from __future__ import annotations

from dataclasses import dataclass, fields

METHODS = ("eagle", "ngram")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """method: "eagle" (a draft head on the target's hidden states, worker/eagle.py) or "ngram"
    (prompt lookup, no model: the longest recent n-gram that occurred before proposes what
    followed it). model: the EAGLE head's directory (None: the one shipped for the default
    model). num_speculative_tokens: drafts a step, 1..16. prompt_lookup_min/max: the n-gram
    lengths ngram tries, longest first."""

    method: str
    num_speculative_tokens: int = 3
    model: str | None = None
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, "
                             f"got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("speculative_config: need 1 <= prompt_lookup_min <= "
                             "prompt_lookup_max")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("speculative_config.model: ngram drafts without a model")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | None) -> SpeculativeConfig | None:
        """A SpeculativeConfig from a mapping (unknown keys are a ValueError naming them)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a mapping, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key {unknown[0]!r} "
                             f"(keys: {sorted(known)})")
        if "method" not in value:
            raise ValueError("speculative_config.method is required ('eagle' or 'ngram')")
        return cls(**value)
