"""When a request stops: EOS, stop token ids, stop strings, max_tokens, the context length."""

from __future__ import annotations

from mxserve.api.stream import find_stop_string, stop_holdback
from mxserve.worker.request import FinishReason, Request


def check_stop(request: Request, max_model_len: int, text_start: int) -> None:
    """Set `finish_reason` (and `stop_reason`) if the token just appended ends the request.

    `text_start` is the length of `output_text` before this token's text was added; stop strings
    are searched only where they could newly appear. A matched stop string is cut from
    `output_text` (kept when include_stop_str_in_output). EOS and stop ids count only once
    `min_tokens` tokens were produced; length limits always count.
    """
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
        if params.stop and _cut_at_stop_string(request, text_start):
            return
    if reaches_length_limit(request, max_model_len):
        request.finish_reason = FinishReason.LENGTH


def reaches_length_limit(request: Request, max_model_len: int, ahead: int = 0) -> bool:
    """max_tokens or the context length is reached, counting `ahead` more output tokens (the
    scheduler's tokens still in flight, Request.num_inflight)."""
    max_tokens = request.sampling_params.max_tokens
    return (max_tokens is not None and len(request.output_token_ids) + ahead >= max_tokens) \
        or len(request.all_token_ids) + ahead >= max_model_len


def _cut_at_stop_string(request: Request, text_start: int) -> bool:
    params = request.sampling_params
    match = find_stop_string(request.output_text, text_start, params.stop,
                             params.include_stop_str_in_output)
    if match is None:
        return False
    request.output_text = request.output_text[:match[0]]
    request.finish_reason, request.stop_reason = FinishReason.STOP, match[1]
    return True


def stream_holdback(request: Request) -> int:
    """`stop_holdback` for a request (0 once it finished)."""
    return stop_holdback(request.sampling_params.stop) if request.finish_reason is None else 0
