"""Drafters for speculative decoding, chosen by name (SpeculativeConfig.method): after each step
the engine asks its drafter for up to n tokens for each request that decodes next; the next step
verifies them (spec_verify.py).

- "ngram" (prompt lookup, no model): the longest recent n-gram of the request's tokens that also
  occurred earlier proposes what followed that earlier occurrence.
- "eagle" (worker/eagle.py): a one-layer head over the target's final hidden states; with
  `lookup_first`, a request whose recent n-gram matches drafts by lookup instead (`LookupFirst`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import numpy as np

from mxserve.worker.spec_config import SpeculativeConfig

if TYPE_CHECKING:
    import torch

    from mxserve.worker.request import Request
    from mxserve.worker.scheduler import StepPlan


class Drafter(Protocol):
    """Proposes drafts after a step. `needs_hidden`: the step's runner returns every token's
    final hidden state. `num_lookahead_tokens`: KV slots a request holds past what it computes,
    for a drafter that writes KV of its own in the request's blocks."""

    needs_hidden: bool
    num_lookahead_tokens: int

    def propose(self, plan: StepPlan, hidden: torch.Tensor | None,
                num_drafts: dict[Request, int]) -> None:
        """After `plan` completed (rejected drafts rolled back: each running request's
        num_computed_tokens is where its valid KV ends), set `draft_token_ids` (at most n) of
        each request in num_drafts. hidden: [plan.num_tokens, hidden] in plan order, or None."""

    def release(self, request: Request) -> None:
        """The request has ended (finished or aborted): drop what is kept for it."""


class TokenArrays:
    """Each request's tokens as an int64 array grown in place (a request's tokens only ever
    append), so a lookup each step does not convert the whole token list again."""

    def __init__(self) -> None:
        self._arrays: dict[Request, tuple[np.ndarray, int]] = {}

    def of(self, request: Request) -> np.ndarray:
        tokens = request.all_token_ids
        buf, count = self._arrays.get(request, (None, 0))
        if buf is None or len(tokens) > len(buf):
            grown = np.empty(2 * len(tokens) + 64, dtype=np.int64)
            if count:
                grown[:count] = buf[:count]
            buf = grown
        if len(tokens) > count:
            buf[count:len(tokens)] = tokens[count:]
        self._arrays[request] = (buf, len(tokens))
        return buf[:len(tokens)]

    def release(self, request: Request) -> None:
        self._arrays.pop(request, None)


class NgramDrafter:
    needs_hidden = False
    num_lookahead_tokens = 0

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self.tokens = TokenArrays()

    def propose(self, plan: StepPlan, hidden, num_drafts: dict[Request, int]) -> None:
        for request, n in num_drafts.items():
            request.draft_token_ids = ngram_lookup(self.tokens.of(request), n, self.min_n,
                                                   self.max_n)

    def release(self, request: Request) -> None:
        self.tokens.release(request)


def ngram_lookup(tokens: list[int] | np.ndarray, n: int, min_n: int, max_n: int) -> list[int]:
    """Up to n tokens that followed the latest earlier occurrence of the sequence's last
    max_n..min_n tokens (the longest that occurred), or [] if none did."""
    a = np.asarray(tokens, dtype=np.int64)
    length = len(a)
    for size in range(min(max_n, length - 1), min_n - 1, -1):
        # match[i]: a[i:i + size] equals the last `size` tokens, for windows ending before the
        # last token; one shifted comparison per offset (a window view's all() is ~10x slower)
        match = a[:length - size] == a[length - size]
        for j in range(1, size):
            match &= a[j:length - size + j] == a[length - size + j]
        hits = np.flatnonzero(match)
        if hits.size:
            start = int(hits[-1]) + size
            return a[start:start + n].tolist()
    return []


class LookupFirst:
    """EAGLE with prompt lookup first: each request whose latest n-gram occurred before takes
    ngram's proposal; the rest draft with the head (local or a replica). The head is asked for
    no drafts of the first kind (a catch-up pass only, which keeps its KV current), so their
    chains cost nothing. Both kinds are argmax proposals (q one-hot), so the verify rule, greedy
    or sampled, stays exact. Everything else (needs_hidden, the replica channel's counters) is
    the inner drafter's; release goes to both."""

    def __init__(self, inner: Drafter, config: SpeculativeConfig) -> None:
        self.inner = inner
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self.num_lookup_drafts = 0  # requests' rounds drafted by lookup
        self.tokens = TokenArrays()

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def release(self, request: Request) -> None:
        self.tokens.release(request)
        self.inner.release(request)

    def propose(self, plan: StepPlan, hidden, num_drafts: dict[Request, int]) -> None:
        found = {}
        for request, n in num_drafts.items():
            drafts = ngram_lookup(self.tokens.of(request), n, self.min_n, self.max_n)
            if drafts:
                found[request] = drafts
        self.inner.propose(plan, hidden, {r: 0 if r in found else n
                                          for r, n in num_drafts.items()})
        for request, drafts in found.items():
            request.draft_token_ids = drafts
        self.num_lookup_drafts += len(found)


def build_drafter(config: SpeculativeConfig, runner, model_config,
                  draft_address: Callable[[], str | None] | None = None) -> Drafter:
    """The drafter `config.method` names, on `runner`'s device (EAGLE loads its head), or with
    draft_placement "replica" the client of a draft replica (worker/draft_channel.py) at
    draft_address() (default: config.draft_address)."""
    if config.method == "ngram":
        return NgramDrafter(config)
    if config.lookup_first:
        return LookupFirst(build_drafter(dataclasses.replace(config, lookup_first=False),
                                         runner, model_config, draft_address), config)
    if config.draft_placement == "replica":
        import uuid

        from mxserve.worker.draft_channel import RemoteDrafter

        return RemoteDrafter(draft_address or (lambda: config.draft_address),
                             uuid.uuid4().hex[:12], model_config.model_id,
                             runner.config.block_size, config.draft_timeout_s)
    from mxserve.worker.eagle import EagleDrafter

    return EagleDrafter(config, runner, model_config)
