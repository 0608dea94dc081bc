"""Moving a running request between workers (a drain): the engine's side.

    draining worker: complete_inflight(); suspend(engine, id) for each request
                     -> a last StepOutput, finish_reason "migrate", with its ResumeState
                        (its full blocks stay in the prefix cache, for the peer to pull)
    the router:      re-issues the request to a peer with that state (router/ingress.py)
    the peer:        make_request(prompt, params); resume(engine, request, state); pull the
                     blocks (cluster/kv_service.py) -> admitted as a prefix hit over prompt +
                     output, it computes the last partial block and goes on from the next token

Greedy output is the undisturbed run's; a seeded request's random stream goes on where it
stopped. A request whose blocks cannot be pulled recomputes them (the same tokens, slower).
"""

from __future__ import annotations

import torch

from mxserve.api.block_hash import extend_block_hashes
from mxserve.api.errors import InvalidRequestError
from mxserve.api.outputs import ResumeState, StepOutput
from mxserve.worker.engine import Engine
from mxserve.worker.request import FinishReason, Request


def suspend(engine: Engine, request_id: str) -> StepOutput | None:
    """Hand a request back to go on elsewhere: its last output, finish_reason "migrate", with
    the state a peer resumes from (worker_id and kv_address left for the caller to fill). None
    if it is not here. Call after `engine.complete_inflight()` (a token still on the device
    would be lost)."""
    request = engine.requests.get(request_id)
    if request is None:
        return None
    generator = request.generator
    state = None if generator is None else generator.get_state().numpy().tobytes()
    # a compacted request's blocks no longer match its hashes (KV eviction): nothing to pull
    num_blocks = 0 if request.num_evicted else \
        request.num_computed_tokens // engine.kv.block_size
    engine.abort_as(request, FinishReason.MIGRATE)
    out = engine.output_of(request)
    out.resume = ResumeState("", None, num_blocks, list(request.output_token_ids), state,
                             request.num_cached_tokens, request.num_drafts,
                             request.num_draft_tokens, request.num_accepted_tokens)
    return out


def resume(engine: Engine, request: Request, state: ResumeState) -> None:
    """Restore a request another worker suspended onto one `make_request` built from the same
    prompt and parameters: its output so far, random stream and counts. Raises
    InvalidRequestError (naming the field) when the state does not fit this model."""
    vocab = engine.model_config.vocab_size
    ids = state.output_token_ids
    if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
        raise InvalidRequestError("resume.output_token_ids",
                                  f"ids must be integers in [0, {vocab})")
    if request.num_tokens + len(ids) >= engine.max_model_len:
        raise InvalidRequestError("resume.output_token_ids", "run past the model's context")
    for token in ids:
        request.append_output(token)
    extend_block_hashes(request.block_hashes, request.all_token_ids, engine.kv.block_size,
                        engine.model_config.model_id)
    request.num_cached_tokens = state.num_cached_tokens
    request.num_preemptions = 1  # keeps num_cached_tokens: it counts the first admission only
    request.num_drafts = state.num_drafts
    request.num_draft_tokens = state.num_draft_tokens
    request.num_accepted_tokens = state.num_accepted_tokens
    if state.generator_state is not None:
        generator = torch.Generator(engine.runner.device)
        generator.set_state(torch.frombuffer(bytearray(state.generator_state),
                                             dtype=torch.uint8))
        request.generator = generator
