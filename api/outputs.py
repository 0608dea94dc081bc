"""What a worker streams for a request: one delta per engine step that produced tokens (token ids;
the text is made from them by api/stream.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgpack


@dataclass(slots=True)
class StepOutput:
    """What one request gained in one step (a streaming delta). AsyncEngine merges the deltas
    a slow consumer has not taken yet into one (merge_outputs)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    num_output_tokens: int
    # Speculative decoding, the request's totals so far: steps that verified drafts, drafts
    # verified, drafts kept (mean acceptance length = 1 + accepted / drafts steps).
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # finish_reason "migrate": the worker is draining; the request goes on elsewhere from here
    resume: ResumeState | None = None
    # SamplingParams.prompt_logprobs, once, on the output with the request's first token: one
    # entry per prompt token, None for the first (nothing precedes it), else {that token's id:
    # lp, then each top-n id: lp} (the actual token first, as new_logprobs' sampled one).
    prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclass(frozen=True)
class ResumeState:
    """A request a draining worker handed back, for a peer to go on from its next token
    (`generate(..., resume=...)`): the output so far, a seeded request's random stream where it
    stopped, and its counts. Its KV stays in the old worker's prefix cache under its block
    hashes, `num_blocks` full blocks, for the peer to pull from `kv_address`."""

    worker_id: str  # the worker it left: routing sends it elsewhere
    kv_address: str | None
    num_blocks: int
    output_token_ids: list[int]
    generator_state: bytes | None
    num_cached_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # The worker it left died or stopped answering (rather than drained): routing leaves that
    # worker out for every request until Serve replaces it (cluster/request_router.py).
    worker_lost: bool = False


def merge_outputs(outs: Sequence[StepOutput]) -> StepOutput:
    """One delta for consecutive ones of a request (at least one): tokens and logprobs joined
    in one pass, the state (finished, reason, counts) of the last, the prompt logprobs of the
    first that has them (they come with the first token)."""
    last = outs[-1]
    if len(outs) == 1:
        return last
    tokens: list[int] = []
    logprobs = prompt_logprobs = None
    for o in outs:  # (one loop: this runs for every message a loaded worker sends)
        tokens += o.new_token_ids
        if o.new_logprobs is not None:
            logprobs = (logprobs or []) + o.new_logprobs
        if prompt_logprobs is None:
            prompt_logprobs = o.prompt_logprobs
    return StepOutput(
        last.request_id, tokens, logprobs, last.finished, last.finish_reason,
        last.num_prompt_tokens, last.num_cached_tokens, last.num_output_tokens, last.num_drafts,
        last.num_draft_tokens, last.num_accepted_tokens, last.resume, prompt_logprobs)


def encode_output(out: StepOutput) -> bytes:
    """A delta as the worker streams it to the router: msgpack of its fields in order (and a
    ResumeState's as a nested list). Ray hands bytes through as they are; a StepOutput object it
    would cloudpickle, and un-cloudpickle at the router, for every message (several times the
    Python work, in the worker process whose GIL the engine thread steps with)."""
    resume = None if out.resume is None else resume_fields(out.resume)
    return msgpack.packb((
        out.request_id, out.new_token_ids, out.new_logprobs, out.finished, out.finish_reason,
        out.num_prompt_tokens, out.num_cached_tokens, out.num_output_tokens, out.num_drafts,
        out.num_draft_tokens, out.num_accepted_tokens, resume, out.prompt_logprobs))


def decode_output(data: bytes) -> StepOutput:
    """The StepOutput `encode_output` made (logprob maps keep their int keys and order)."""
    fields = msgpack.unpackb(data, strict_map_key=False)
    if fields[11] is not None:
        fields[11] = ResumeState(*fields[11])
    return StepOutput(*fields)


def resume_fields(resume: ResumeState) -> list:
    """A ResumeState's fields in order, for msgpack (`ResumeState(*fields)` makes it back):
    the output channel and request intake carry it so."""
    return [resume.worker_id, resume.kv_address, resume.num_blocks, resume.output_token_ids,
            resume.generator_state, resume.num_cached_tokens, resume.num_drafts,
            resume.num_draft_tokens, resume.num_accepted_tokens, resume.worker_lost]
