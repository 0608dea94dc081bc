"""The logit transforms the sampler applies before drawing (worker/sampler.py): min_tokens, the
repetition / presence / frequency penalties, one threshold for top_k, top_p and min_p, and greedy's
argmax; plus the row helpers they share with the sampler."""

from __future__ import annotations

from itertools import chain

import torch

from mxserve.api.sampling_params import SamplingParams
from mxserve.worker.host_to_device import index_on, to_device
from mxserve.worker.request import Request

_NEG_INF = float("-inf")
# top_p from the host (on CPU, or top_p_on_device off) looks for its cutoff among the 256 largest
# logits (a partial sort, far cheaper than a full one at a 49k vocab); when they hold less than
# top_p of the mass, on CPU among 16x more, and so on. On CUDA it sorts the whole row at once
# instead: each growth waits for the device, and a flat row (random weights) grows to the whole
# vocabulary (bench/results/engine_gpu.step_order.md).
_TOP_P_CANDIDATES = 256
_TOP_P_GROWTH = 16
ARGMAX_TRITON_ROWS = 64  # rows up to which argmax runs sampling_ops.argmax_rows on CUDA


def apply_min_tokens(logits: torch.Tensor, requests: list[Request]) -> None:
    """Until a request has min_tokens outputs, it may not end: its EOS and stop ids get -inf."""
    rows: list[int] = []
    cols: list[int] = []
    for i, r in enumerate(requests):
        sp = r.sampling_params
        if r.num_output_tokens >= sp.min_tokens:
            continue
        banned = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(r.eos_token_ids))
        banned_ids = [t for t in banned if t < logits.shape[1]]  # an id past the vocab never comes
        rows += [i] * len(banned_ids)
        cols += banned_ids
    if rows:
        logits.index_put_((index_on(rows, logits), index_on(cols, logits)),
                          logits.new_full((), _NEG_INF))


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> None:
    """Repetition, presence and frequency penalties, in place, on the rows that set any."""
    rows = [i for i, r in enumerate(requests) if r.sampling_params.has_penalties]
    if not rows:
        return
    reqs = [requests[i] for i in rows]
    params = [r.sampling_params for r in reqs]
    sub = select_rows(logits, rows)  # [rows, vocab]
    # Dense [rows, vocab] counts; plain arithmetic below, since where/masked_fill are slow on CPU.
    counts = _token_counts([r.output_token_ids for r in reqs], sub)
    present = counts.clamp(max=1.0)  # 1 where the id is in the output, else 0
    if any(sp.repetition_penalty != 1.0 for sp in params):
        # Tokens seen in prompt or output: a positive logit is divided by p, others multiplied,
        # so p > 1 always makes a seen token less likely. p_seen is p there and 1 elsewhere.
        seen = present.clone()
        seen[_flat_index([r.prompt_token_ids for r in reqs], sub)] = 1.0
        p = column([sp.repetition_penalty for sp in params], sub)
        p_seen = seen.mul_(p - 1.0).add_(1.0)
        sub = sub.clamp(min=0.0).div_(p_seen).add_(sub.clamp(max=0.0).mul_(p_seen))
    if any(sp.frequency_penalty != 0.0 for sp in params):  # minus p per occurrence in the output
        sub = sub - column([sp.frequency_penalty for sp in params], sub) * counts
    if any(sp.presence_penalty != 0.0 for sp in params):  # minus p once if in the output at all
        sub = sub - column([sp.presence_penalty for sp in params], sub) * present
    write_rows(logits, rows, sub)


def filter_threshold(logits: torch.Tensor, params: list[SamplingParams],
                     top_p_on_device: bool | None = None) -> torch.Tensor | None:
    """top_k, top_p then min_p on temperature-scaled logits [rows, vocab], as one threshold.

    A token survives iff its logit >= threshold[row] ([rows, 1]); None when no row filters. The
    top token always survives, and so do tokens tied with the last one a filter keeps.
    top_p_on_device: as Sampler's.
    """
    vocab = logits.shape[1]
    top_k = [sp.top_k if 0 < sp.top_k < vocab else vocab for sp in params]  # vocab = off
    use_top_k_or_p = any(k < vocab for k in top_k) or any(sp.top_p < 1.0 for sp in params)
    use_min_p = any(sp.min_p > 0.0 for sp in params)
    if not (use_top_k_or_p or use_min_p):
        return None
    threshold = torch.full((len(params), 1), _NEG_INF, device=logits.device)  # [rows, 1]
    if use_top_k_or_p:
        on_device = top_p_on_device is True or (top_p_on_device is None and logits.is_cuda)
        threshold = _top_k_top_p_threshold(logits, params, top_k, on_device)
    if use_min_p:
        # prob < min_p * max prob  <=>  logit < max logit + log(min_p); log(0) = -inf keeps all.
        min_p = column([sp.min_p for sp in params], logits)
        threshold = torch.maximum(threshold, logits.amax(-1, keepdim=True) + min_p.log())
    return threshold


def _top_k_top_p_threshold(
    logits: torch.Tensor, params: list[SamplingParams], top_k: list[int], on_device: bool
) -> torch.Tensor:
    """Per-row logit threshold [rows, 1] for top_k and, over the top_k survivors, top_p (its
    cutoff decided on the device when `on_device`)."""
    vocab = logits.shape[1]
    use_top_p = any(sp.top_p < 1.0 for sp in params)
    if on_device and use_top_p and all(k == vocab for k in top_k):
        from mxserve.kernels.sampling_ops import top_p_search_rows

        # top_k off everywhere: no candidates, the whole-row search on every row (10 launches)
        return top_p_search_rows(logits, column([sp.top_p for sp in params], logits))
    num_candidates = max((k for k in top_k if k < vocab), default=0)
    if use_top_p:
        num_candidates = max(num_candidates, min(_TOP_P_CANDIDATES, vocab))
    values = logits.topk(num_candidates, dim=-1).values  # [rows, num_candidates], descending
    k = to_device([min(k, num_candidates) for k in top_k], torch.long, logits.device)
    k_on = to_device([k < vocab for k in top_k], torch.bool, logits.device).unsqueeze(1)
    threshold = torch.where(k_on, values.gather(1, k.unsqueeze(1) - 1), _NEG_INF)  # k-th largest
    if not use_top_p:
        return threshold
    # top_p renormalizes over what top_k kept, so its softmax denominator is over the survivors:
    # all among the candidates when top_k is on, the whole row when it is off.
    values = values.masked_fill_(values < threshold, _NEG_INF)
    log_total = values.logsumexp(-1, keepdim=True)
    if not all(k < vocab for k in top_k):
        log_total = torch.where(k_on, log_total, logits.logsumexp(-1, keepdim=True))
    if on_device:
        from mxserve.kernels.sampling_ops import top_p_threshold_rows

        top_p = column([sp.top_p for sp in params], logits)
        cut = top_p_threshold_rows(logits, values, log_total, top_p, ~k_on.view(-1))
        return torch.maximum(threshold, cut)
    return torch.maximum(threshold, _top_p_threshold(logits, values, log_total, params))


def _top_p_threshold(
    logits: torch.Tensor,
    values: torch.Tensor,
    log_total: torch.Tensor,
    params: list[SamplingParams],
) -> torch.Tensor:
    """Per-row logit threshold [rows, 1] for top_p, given the largest logits (descending) and the
    log of the softmax denominator over top_k's survivors.

    Keep the smallest prefix (in descending order) whose mass reaches top_p: token j survives iff
    the mass strictly before it is < top_p, so the top token always does. Usually the candidates
    in `values` hold that mass; if some row's do not, take _TOP_P_GROWTH times more (CUDA: all).
    Rows with top_p = 1 get -inf (a float cumsum can reach 1 early and would drop the tail).
    """
    top_p, vocab = column([sp.top_p for sp in params], logits), logits.shape[1]
    while True:
        probs = (values - log_total).exp_()  # [rows, num_candidates]
        mass = probs.cumsum(-1)
        short = (mass[:, -1:] < top_p) & (top_p < 1.0)  # rows whose cutoff lies further down
        if values.shape[1] == vocab or not bool(short.any()):
            break
        num_candidates = vocab if logits.is_cuda else min(values.shape[1] * _TOP_P_GROWTH, vocab)
        # A row with top_k on has all its mass within its first k candidates, so the tokens past
        # them (no longer masked here) never move its cutoff.
        values = logits.sort(dim=-1, descending=True).values if num_candidates == vocab \
            else logits.topk(num_candidates, dim=-1).values
    num_keep = ((mass - probs) < top_p).sum(-1, keepdim=True)
    return torch.where(top_p < 1.0, values.gather(1, num_keep - 1), _NEG_INF)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first maximal index. On CUDA, up to ARGMAX_TRITON_ROWS rows: two short
    kernels (kernels/sampling_ops.py) instead of torch.argmax's one block a row, which is far
    slower for a few rows; at many rows both read the logits at about the same speed and
    torch's single launch costs the host less (bench/results/decode_step_probe.json)."""
    if logits.is_cuda and logits.shape[0] <= ARGMAX_TRITON_ROWS:
        from mxserve.kernels.sampling_ops import argmax_rows

        return argmax_rows(logits)
    return logits.argmax(-1)


def _token_counts(token_lists: list[list[int]], like: torch.Tensor) -> torch.Tensor:
    """How often each id occurs in each row's list: [rows, vocab] float, like `like`."""
    counts = torch.zeros_like(like)
    index = _flat_index(token_lists, like)
    counts.index_put_(index, torch.ones(len(index[0]), device=like.device), accumulate=True)
    return counts


def _flat_index(
    token_lists: list[list[int]], like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, id) index tensors [num_tokens] each, over all lists; row j for token_lists[j]."""
    rows = [j for j, ids in enumerate(token_lists) for _ in ids]
    return index_on(rows, like), index_on(list(chain.from_iterable(token_lists)), like)


def column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    """Per-row values as a [rows, 1] tensor of like's dtype and device."""
    return to_device(values, like.dtype, like.device).unsqueeze(1)


def select_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """logits itself when rows is every row (in order), else a copy of those rows."""
    if len(rows) == logits.shape[0]:
        return logits
    return logits.index_select(0, index_on(rows, logits))


def write_rows(logits: torch.Tensor, rows: list[int], sub: torch.Tensor) -> None:
    """logits[rows] = sub (no copy when sub is logits itself)."""
    if sub is logits:
        return
    if len(rows) == logits.shape[0]:
        logits.copy_(sub)
    else:
        logits.index_copy_(0, index_on(rows, logits), sub)
