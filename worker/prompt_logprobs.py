"""Prompt logprobs (SamplingParams.prompt_logprobs): for each prompt token after the first, its
log-probability given the tokens before it and the n most likely tokens there.

    scheduler: a prefill chunk of such a request lists the prompt tokens its positions predict
               (ScheduledRequest.prompt_logprob_ids: the token after each of its leading
               positions, up to the last prompt token)
    runner:    compute_prompt_logprobs: those positions' logits, log_softmax, the actual token's
               logprob and the top n, on the device (a [rows, vocab] tensor never leaves it)
    engine:    PromptLogprobs.start_copy, then result() at completion -> {id: lp} dicts, placed
               at their prompt positions in request.prompt_logprobs; the whole list goes out
               with the request's first token (StepOutput.prompt_logprobs)

A request asking for them takes no prefix-cache hits (a cached token has no logits), so each
position is computed by exactly one chunk, however the prompt is split.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mxserve.worker.host_to_device import to_device
from mxserve.worker.scheduler import StepPlan

# Positions whose logits are made at once: bounds the [rows, vocab] float32 logits of a long
# prompt chunk (1024 rows of a 128k vocabulary: 512 MiB).
_ROWS_PER_SLICE = 1024


@dataclass
class PromptLogprobs:
    """One step's prompt logprobs, a row per predicted prompt token, in plan order (each
    scheduled request's `len(prompt_logprob_ids)` rows in turn)."""

    token_lps: torch.Tensor  # [rows] float32: the actual prompt token's logprob
    top_lps: torch.Tensor  # [rows, k] float32, descending; k = the plan's largest n
    top_ids: torch.Tensor  # [rows, k] int64
    num_rows: list[int]  # per request of the plan that has rows: how many
    num_top: list[int]  # per such request: its n
    target_ids: list[int]  # [rows] the actual prompt tokens
    _host: list[torch.Tensor] | None = None
    _copied: torch.cuda.Event | None = None

    def start_copy(self) -> None:
        """Queue the device -> host copies (rank 0 only; the other ranks' results are dropped)."""
        self._host = [t.to("cpu", non_blocking=True)
                      for t in (self.token_lps, self.top_lps, self.top_ids)]
        if self.token_lps.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def result(self) -> list[list[dict[int, float]]]:
        """Per request with rows, in plan order: a {actual id: lp, top ids: lp} dict per row
        (the actual token first, as a sampled token's logprobs). Waits for the copies."""
        if self._host is None:
            self.start_copy()
        if self._copied is not None:
            self._copied.synchronize()
        token_lps, top_lps, top_ids = (t.tolist() for t in self._host)
        out, row = [], 0
        for num_rows, n in zip(self.num_rows, self.num_top):
            entries = []
            for i in range(row, row + num_rows):
                entry = {self.target_ids[i]: token_lps[i]}
                entry.update(zip(top_ids[i][:n], top_lps[i][:n], strict=True))
                entries.append(entry)
            out.append(entries)
            row += num_rows
        return out


def prompt_logprob_rows(plan: StepPlan) -> list[int]:
    """The rows of the plan's flat token batch whose logits predict a prompt token: each
    request's leading len(prompt_logprob_ids) positions."""
    rows: list[int] = []
    start = 0
    for s in plan.scheduled:
        rows.extend(range(start, start + len(s.prompt_logprob_ids)))
        start += s.num_new_tokens
    return rows


def compute_prompt_logprobs(plan: StepPlan, hidden: torch.Tensor,
                            compute_logits: Callable[[torch.Tensor], torch.Tensor]
                            ) -> PromptLogprobs:
    """The plan's prompt logprobs from its final hidden states [num_tokens, hidden] and the
    model's compute_logits (every rank of a tensor-parallel group calls it alike: it gathers
    the vocabulary)."""
    with_rows = [s for s in plan.scheduled if s.prompt_logprob_ids]
    target_ids = [t for s in with_rows for t in s.prompt_logprob_ids]
    num_top = max(s.num_prompt_logprobs for s in with_rows)
    rows = to_device(prompt_logprob_rows(plan), torch.long, hidden.device)
    targets = to_device(target_ids, torch.long, hidden.device)
    parts = [_logprob_parts(compute_logits(hidden[rows[i:i + _ROWS_PER_SLICE]]),
                            targets[i:i + _ROWS_PER_SLICE], num_top)
             for i in range(0, len(target_ids), _ROWS_PER_SLICE)]
    token_lps, top_lps, top_ids = (torch.cat(p) for p in zip(*parts))
    return PromptLogprobs(token_lps, top_lps, top_ids,
                          [len(s.prompt_logprob_ids) for s in with_rows],
                          [s.num_prompt_logprobs for s in with_rows], target_ids)


def _logprob_parts(logits: torch.Tensor, targets: torch.Tensor, num_top: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(target lps [R], top lps [R, k], top ids [R, k]) from raw logits [R, vocab] float32."""
    logprobs = logits.float().log_softmax(-1)
    token_lps = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1)
    top_lps, top_ids = logprobs.topk(num_top, dim=-1)
    return token_lps, top_lps, top_ids
