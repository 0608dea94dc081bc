"""Token-budget scheduler: which requests compute how many tokens this step.

Scheduling is by token counts only. Every request tracks `num_computed_tokens` (tokens whose KV is
in the cache) against `num_tokens` (prompt + output so far). Each step hands every request some
tokens to compute under one budget of `max_num_batched_tokens`: 1 for a plain decode, up to the rest
of the budget for a prompt (chunked prefill, continued over later steps), and a prefix-cache hit
just starts `num_computed_tokens` further along. A speculative verify is "compute k + 1": a
decoding request with k drafts (request.draft_token_ids) computes its last token and the drafts
in one pass (the budget counts all of them; drafts past the budget wait), and the engine rolls
back what it rejects. With a drafter that keeps KV of its own in the same blocks (EAGLE), each
request also holds `num_lookahead_tokens` slots past what it computes.
With async scheduling a request's newest token may still be on the device (`num_inflight`): it
is scheduled like a known one, and the runner takes its id from the previous step's samples.
With KV eviction a request holds fewer tokens' KV than it has computed (`num_evicted`): its
blocks and the attention context count held tokens, its positions stay logical.

Order: running requests first (decodes before unfinished prefills), then waiting requests in
arrival order while the budget, `max_num_seqs` and free KV blocks allow. When a running request
cannot get a block, the most recently admitted running request is preempted: its blocks are freed
and it goes back to the front of the waiting queue, to be recomputed (its cached full blocks will
usually still be there as prefix hits).
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

from mxserve.worker import draft_tree
from mxserve.worker.kv_cache import KVCacheManager
from mxserve.worker.request import Request, RequestStatus
from mxserve.worker.stop import reaches_length_limit

if TYPE_CHECKING:
    import torch


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens to compute this step, starting at request.num_computed_tokens
    # Where they go in the request's cache: its held tokens when scheduled (num_computed_tokens
    # - num_evicted); their positions (RoPE) are start_position + position_offset onwards.
    start_position: int
    token_ids: list[int]  # the tokens to compute: all_token_ids[start : start + num_new_tokens]
    block_table: list[int]  # the request's blocks, covering start + num_new_tokens tokens
    # KVCacheManager.table_version of that table: equal versions, equal tables up to the
    # shorter one's length (the runner keeps tables across steps by it)
    table_version: int
    # True when this step reaches the last known token, so its logits yield the next token.
    samples: bool
    # >= 0: the last token to compute is still on the device, in row `inflight_row` of
    # StepPlan.inflight_tokens, and token_ids lacks it (set by the engine).
    inflight_row: int = -1
    # Drafts verified this step: the last num_draft_tokens of token_ids; logits come back for
    # each of the 1 + num_draft_tokens last positions.
    num_draft_tokens: int = 0
    position_offset: int = 0  # request.num_evicted when scheduled
    # Prompt logprobs (prompt_logprobs.py): the prompt tokens this chunk's leading positions
    # predict (the token after each, up to the last prompt token), and how many top ones to
    # return with each; empty for a request that asks for none (or has them all).
    prompt_logprob_ids: Sequence[int] = ()
    num_prompt_logprobs: int = 0
    # None: the drafts are a chain; else a draft tree (worker/draft_tree.py): each one's parent
    draft_parents: list[int] | None = None
    # Set by the verify of a tree: its kept drafts (rows 1 + j after the root's)
    kept_draft_rows: list[int] | None = None


@dataclass
class StepPlan:
    """What the model runner computes this step; the runner reads nothing else."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)  # decodes first
    num_decodes: int = 0  # scheduled[:num_decodes] compute one token each (attention's decode path)
    preempted: list[Request] = field(default_factory=list)  # sent back to waiting this step
    # The previous step's sampled ids [rows] on the device, when some request here computes one.
    inflight_tokens: torch.Tensor | None = None
    # The runner returns every token's final hidden state (a drafter reads them), not only logits.
    keep_hidden: bool = False
    # KV eviction: moves within the KV pool to make before this step runs, in order, each a
    # (source slots, destination slots) pair (KVCacheManager.compact); and > 0 when the runner
    # returns attention mass (AttentionBatch.mass_window).
    kv_moves: list[tuple[Sequence[int], Sequence[int]]] = field(default_factory=list)
    mass_window: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @cached_property
    def has_prompt_logprobs(self) -> bool:
        """(Cached: the runner asks up to three times a step; the plan is complete by then.)"""
        return any(s.prompt_logprob_ids for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int | None = None, num_lookahead_tokens: int = 0) -> None:
        self.kv = kv
        self.num_lookahead_tokens = num_lookahead_tokens
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # With num_inflight: which requests end by length (None: no context limit).
        self.max_model_len = max_model_len if max_model_len is not None else sys.maxsize
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0  # requests preempted (their KV freed, to be recomputed)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def finish(self, request: Request) -> None:
        """Remove a request (finished or aborted) and free its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request.request_id)
        request.status = RequestStatus.FINISHED

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.max_num_batched_tokens
        # Decodes first so a long prefill never stalls tokens already streaming. (This loop runs
        # for every running request each step: lengths are read directly, not via properties.)
        for request in sorted(self.running, key=lambda r: r.is_prefill):
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:  # preempted to make room for another
                continue
            if request.num_inflight and reaches_length_limit(request, self.max_model_len,
                                                             request.num_inflight):
                continue  # its token in flight is its last one
            num_rest = (len(request.all_token_ids) + request.num_inflight
                        - request.num_computed_tokens)
            num_new = min(num_rest, budget)
            drafts = request.draft_token_ids[:budget - num_new] if num_new == num_rest else []
            if not self._allocate_or_preempt(request, num_new + len(drafts), plan):
                continue
            plan.scheduled.append(self._scheduled(request, num_new, drafts))
            budget -= num_new + len(drafts)
        self._admit_waiting(plan, budget)
        # Attention treats every single-token query as a decode; they lead the batch.
        plan.num_decodes = sum(s.num_new_tokens == 1 for s in plan.scheduled)
        if plan.num_decodes != len(plan.scheduled):
            plan.scheduled.sort(key=lambda s: s.num_new_tokens != 1)
        return plan

    def _admit_waiting(self, plan: StepPlan, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if plan.preempted and request in plan.preempted:
                break  # don't re-admit in the step that preempted it
            hits = self.prefix_hits(request)
            num_computed = len(hits) * self.kv.block_size
            num_new = min(request.num_tokens - num_computed, budget)
            if not self.kv.allocate(request.request_id,
                                    self.with_lookahead(num_computed + num_new), hits):
                break
            self.waiting.popleft()
            request.num_computed_tokens = num_computed
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_computed
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            plan.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new

    def prefix_hits(self, request: Request) -> list[int]:
        """Block ids of the request's leading blocks in the prefix cache now (changes nothing).
        At least one token must be computed to produce logits, so a fully cached prompt reuses
        all but its last block. A request that wants prompt logprobs takes none: every prompt
        position's logits are needed (its blocks still go to the cache for others)."""
        if request.needs_prompt_logprobs:
            return []
        usable = (request.num_tokens - 1) // self.kv.block_size
        return self.kv.lookup_prefix(request.block_hashes[:usable])

    def _allocate_or_preempt(self, request: Request, num_new: int, plan: StepPlan) -> bool:
        """Make room for `num_new` more tokens, preempting later requests; False if `request`
        itself had to be preempted."""
        total = self.with_lookahead(request.num_computed_tokens - request.num_evicted + num_new)
        while not self.kv.allocate(request.request_id, total):
            victim = self.running[-1]
            self._preempt(victim, plan)
            if victim is request:
                return False
        return True

    def with_lookahead(self, num_tokens: int) -> int:
        """Slots a request computing up to num_tokens holds: its drafter's lookahead too, within
        the context limit (which the pool always holds)."""
        return max(num_tokens, min(num_tokens + self.num_lookahead_tokens, self.max_model_len))

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        request.draft_token_ids, request.draft_parents = [], None
        self.running.remove(request)
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.num_evicted = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        plan.preempted.append(request)
        plan.scheduled = [s for s in plan.scheduled if s.request is not request]

    def _scheduled(self, request: Request, num_new: int,
                   drafts: list[int] = ()) -> ScheduledRequest:
        start, end = request.num_computed_tokens, request.num_computed_tokens + num_new
        rid = request.request_id
        token_ids = request.all_token_ids[start:end]
        if drafts:
            token_ids += drafts
        scheduled = ScheduledRequest(
            request, num_new + len(drafts), start - request.num_evicted, token_ids,
            self.kv.get_block_ids(rid), self.kv.table_version(rid),
            end == len(request.all_token_ids) + request.num_inflight,
            num_draft_tokens=len(drafts), position_offset=request.num_evicted)
        if drafts and request.draft_parents is not None:  # a tree's prefix is a tree
            parents = request.draft_parents[:len(drafts)]
            scheduled.draft_parents = None if draft_tree.is_chain(parents) else parents
        if start < request.num_prompt_tokens - 1 and request.needs_prompt_logprobs:
            # position p predicts prompt token p + 1; the last prompt position predicts the
            # first output token (sampled), so the slice stops at the prompt's end
            scheduled.prompt_logprob_ids = request.prompt_token_ids[start + 1:end + 1]
            scheduled.num_prompt_logprobs = request.sampling_params.prompt_logprobs
        return scheduled
