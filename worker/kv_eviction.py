"""KV eviction: which cached tokens a request keeps once it holds more than its budget.

H2O (Zhang et al., 2023): a token's importance is the attention it has received so far. Every
step the attention backend returns, per request, the softmax probability each cached position
got, summed over query heads and layers (`AttentionBatch.mass_window`; a decode's one query, a
prefill chunk's last `h2o_window` queries); `KVEvictor.observe` adds it to the request's scores.
When a request holds `budget + block_size` tokens, it keeps

    the first `sinks` tokens  +  the `recent` newest  +  the highest-scoring of the rest

`budget` tokens in all, and `KVCacheManager.compact` moves them into the fewest blocks (whole
blocks freed). "streaming" (StreamingLLM) keeps the sinks and the newest only, no scores.

One score per cached token, summed over layers and heads: the block table is shared by every
layer, so a token leaves all layers at once. A request keeps its logical length (positions
stay the tokens' own: keys are stored after RoPE); `Request.num_evicted` is how many of its
tokens no longer have KV, and the scheduler places new tokens after the held ones.

Eviction runs when a request passes its budget by a block, so compaction (a gather within the
pool, every layer) happens once per `block_size` tokens a request grows, not every step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class EvictionPolicy:
    policy: str  # "h2o" or "streaming"
    budget: int | float  # tokens, or a fraction of the request's length so far
    recent: int | None  # None: half the budget
    sinks: int
    window: int  # a prefill chunk's last queries whose attention counts (h2o)
    block_size: int

    @classmethod
    def from_config(cls, config) -> EvictionPolicy | None:
        """The engine config's policy (EngineConfig.kv_eviction ...), None when off."""
        if config.kv_eviction is None:
            return None
        return cls(config.kv_eviction, config.kv_budget, config.h2o_recent, config.h2o_sinks,
                   config.h2o_window, config.block_size)

    @property
    def needs_scores(self) -> bool:
        return self.policy == "h2o"

    def budget_for(self, num_tokens: int) -> int:
        """Tokens a request of num_tokens (logical) tokens may keep; at least sinks + one block,
        so the newest tokens always stay."""
        budget = self.budget
        if isinstance(budget, float):
            budget = math.ceil(budget * num_tokens)
        return max(budget, self.sinks + self.block_size)

    def over_budget(self, num_held: int, num_tokens: int) -> bool:
        return num_held >= self.budget_for(num_tokens) + self.block_size

    def keep(self, num_held: int, num_tokens: int, scores: torch.Tensor | None) -> np.ndarray:
        """Indices (ascending, int64) of the held tokens to keep, budget_for(num_tokens) of
        them. scores: [num_held] fp32 accumulated attention (h2o). One read-back from the
        scores' device."""
        budget = min(self.budget_for(num_tokens), num_held)
        sinks = min(self.sinks, budget)
        if self.policy == "streaming" or scores is None:
            return np.concatenate([np.arange(sinks), np.arange(num_held - (budget - sinks),
                                                               num_held)])
        recent = min(self.recent if self.recent is not None else budget // 2, budget - sinks)
        heavy = budget - sinks - recent
        middle = scores[sinks:num_held - recent]
        chosen = np.zeros(0, dtype=np.int64)
        if heavy > 0 and middle.numel():
            chosen = torch.topk(middle, heavy).indices.cpu().numpy() + sinks
        return np.concatenate([np.arange(sinks), np.sort(chosen),
                               np.arange(num_held - recent, num_held)])


class KVEvictor:
    """The engine's side of eviction: accumulated scores per request, and the decision."""

    def __init__(self, policy: EvictionPolicy, device: torch.device) -> None:
        self.policy = policy
        self.device = device
        self.scores: dict[str, torch.Tensor] = {}  # request id -> [>= held] fp32
        self.num_evicted_tokens = 0  # over the engine's life (metrics)

    @property
    def mass_window(self) -> int:
        """What to ask the attention backend for (AttentionBatch.mass_window); 0: no scores."""
        return self.policy.window if self.policy.needs_scores else 0

    def observe(self, request_ids: list[str], ends: list[int], mass: torch.Tensor) -> None:
        """Add a step's attention mass [requests, width] (rows in plan order; ends: each one's
        held tokens after the step) to the scores."""
        totals, rows = [], []
        for row, (request_id, end) in enumerate(zip(request_ids, ends)):
            scores = self.scores.get(request_id)
            if scores is None or scores.numel() < end:
                grown = torch.zeros(max(end, 2 * (0 if scores is None else scores.numel())),
                                    dtype=torch.float32, device=self.device)
                if scores is not None:
                    grown[:scores.numel()] = scores
                scores = self.scores[request_id] = grown
            totals.append(scores[:end])
            rows.append(mass[row, :end])
        # one multi-tensor launch on a GPU rather than a small add a request (decode steps of
        # 64 requests: bench/h2o_gpu.py)
        torch._foreach_add_(totals, rows)

    def select(self, request_id: str, num_held: int, num_tokens: int) -> np.ndarray | None:
        """The held tokens to keep when the request is over budget (ascending), else None."""
        if not self.policy.over_budget(num_held, num_tokens):
            return None
        scores = self.scores.get(request_id)
        if scores is not None:
            scores = scores[:num_held]
            if scores.numel() < num_held:  # tokens no step has scored yet count 0
                scores = torch.cat([scores, scores.new_zeros(num_held - scores.numel())])
        return self.policy.keep(num_held, num_tokens, scores)

    def compacted(self, request_id: str, keep: np.ndarray, num_held: int) -> None:
        """The request, which held num_held tokens, now holds only `keep` (in that order): its
        scores follow."""
        self.num_evicted_tokens += num_held - len(keep)
        scores = self.scores.get(request_id)
        if scores is None or not len(keep):
            return
        last = int(keep[-1])
        if scores.numel() <= last:  # tokens no step has scored yet count 0
            scores = torch.cat([scores, scores.new_zeros(last + 1 - scores.numel())])
        moved = torch.zeros_like(scores)
        moved[:len(keep)] = scores[torch.from_numpy(keep).to(scores.device)]
        self.scores[request_id] = moved

    def forget(self, request_id: str) -> None:
        """A request finished or was preempted (it recomputes from scratch)."""
        self.scores.pop(request_id, None)
