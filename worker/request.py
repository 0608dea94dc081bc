"""One generation request as the engine tracks it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from mxserve.api.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no KV blocks (new, or preempted and to be recomputed)
    RUNNING = "running"  # holds KV blocks, gets tokens every step
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"  # cancelled by the client, a deadline, or shutdown
    MIGRATE = "migrate"  # handed back by a draining worker, to go on elsewhere (not an end)


@dataclass(eq=False, slots=True)
class Request:
    """Prompt, output so far, and how much of it has KV in the cache.

    Scheduling is by token counts: `num_computed_tokens` of `all_token_ids` have their KV written;
    a step computes some of the rest (a prefill chunk, one decode token, or a verify window).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    # Token ids whose KV is (or will be) in the cache: prompt followed by output.
    all_token_ids: list[int] = field(init=False)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    # SamplingParams.prompt_logprobs: an entry per prompt position computed so far (None for the
    # first), filled as prefill chunks complete; handed out, and emptied, with the first token.
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    num_computed_tokens: int = 0
    # KV eviction (kv_eviction.py): how many of the computed tokens no longer have KV. The
    # request holds num_computed_tokens - num_evicted tokens' KV; positions stay logical.
    num_evicted: int = 0
    # Tokens sampled by a launched step that the host has not seen yet (async scheduling: 0 or 1).
    # They count as known for scheduling: the next step computes the newest one, taking its id
    # from the device (engine.py).
    num_inflight: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first schedule)
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # Chained hashes of the full blocks of all_token_ids, extended as blocks fill (block_hash.py).
    block_hashes: list[int] = field(default_factory=list)
    # torch.Generator for a seeded request, created by the sampler on first use.
    generator: object | None = None
    # Speculative decoding: the drafter's proposals for the tokens after all_token_ids, verified
    # by the next step (scheduled as "compute 1 + len(drafts)"); and running totals.
    draft_token_ids: list[int] = field(default_factory=list)
    # None: the drafts are a chain; else a tree, each draft's parent (worker/draft_tree.py)
    draft_parents: list[int] | None = None
    num_draft_tokens: int = 0  # drafts verified
    num_accepted_tokens: int = 0  # of them, kept
    num_drafts: int = 0  # steps that verified drafts (vLLM's name)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def is_prefill(self) -> bool:
        """True while prompt tokens remain without KV; the step then samples nothing new."""
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        """It asks for prompt logprobs and has not had them: no output token yet (a request
        preempted, or resumed from another worker, after its first token recomputes its prompt
        without them)."""
        return self.sampling_params.prompt_logprobs is not None and not self.output_token_ids

    def append_output(self, token_id: int, logprobs: dict[int, float] | None = None) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
