"""When the engine stops a request: EOS, stop token ids, max_tokens, the context length. Stop
strings are matched on text, which is not the engine's: api/stream.py."""

from __future__ import annotations

from mxserve.worker.request import FinishReason, Request


def check_stop(request: Request, max_model_len: int) -> None:
    """Set `finish_reason` (and `stop_reason`) if the token just appended ends the request.
    EOS and stop ids count only once `min_tokens` tokens were produced; length limits always
    count."""
    params, outputs = request.sampling_params, request.output_token_ids
    num_outputs = len(outputs)  # (runs for every request each step: no property hops)
    if num_outputs >= params.min_tokens:
        token = outputs[-1]
        if token in request.eos_token_ids and not params.ignore_eos:
            request.finish_reason = FinishReason.STOP
            return
        if token in params.stop_token_ids:
            request.finish_reason, request.stop_reason = FinishReason.STOP, token
            return
    if reaches_length_limit(request, max_model_len):
        request.finish_reason = FinishReason.LENGTH


def reaches_length_limit(request: Request, max_model_len: int, ahead: int = 0) -> bool:
    """max_tokens or the context length is reached, counting `ahead` more output tokens (the
    scheduler's tokens still in flight, Request.num_inflight)."""
    max_tokens = request.sampling_params.max_tokens
    return (max_tokens is not None and len(request.output_token_ids) + ahead >= max_tokens) \
        or len(request.all_token_ids) + ahead >= max_model_len
