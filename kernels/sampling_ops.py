"""Sampling kernels (GPU): greedy's argmax over the vocabulary, and top_p's cutoff without a
host round trip.

argmax_rows: torch.argmax reduces a row in one thread block: a 128k-entry row took ~28 us on
the H200 at batch 1 (bench/results/engine_gpu.batch1_mx.json, eager kernel profile), 2-3% of a
1B model's decode step. Here a row is cut into BLOCK-wide chunks, one program each (its maximum
and that maximum's first index), and then one program a row takes the first chunk holding the
row's maximum: the result is the first maximal index, as torch.argmax's. A NaN counts as +inf
here (torch.argmax returns the first NaN instead); such logits come from a broken model either
way.

top_p_threshold_rows: the sampler finds top_p's cutoff among a row's 256 largest logits, and
must look further when they hold less than top_p of the mass; asking whether they do makes the
host wait for the device every step (worker/sampler.py). Here one program a row decides on the
device: the candidates' cutoff when they hold the mass, else an exact search of the whole row
(bisection over the logits' ordered float bits, each step summing the mass at or above a pivot).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_compat import use_triton as _use_triton

BLOCK = 2048  # vocabulary entries a stage-1 program reads (8 KB of fp32 logits)


@triton.jit
def _chunk_argmax_kernel(
    x_ptr, part_max_ptr, part_idx_ptr,  # x [R, V]; parts [R, C]
    V, stride_x, NUM_CHUNKS, BLOCK: tl.constexpr,
):
    row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + row * stride_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    v = tl.where(v != v, float("inf"), v)  # NaN as +inf
    best = tl.max(v, axis=0)
    first = tl.min(tl.where(v == best, offs, V), axis=0)  # the first index holding it
    tl.store(part_max_ptr + row * NUM_CHUNKS + chunk, best)
    tl.store(part_idx_ptr + row * NUM_CHUNKS + chunk, first)


@triton.jit
def _pick_chunk_kernel(part_max_ptr, part_idx_ptr, out_ptr, NUM_CHUNKS,
                       BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    mask = offs < NUM_CHUNKS
    best = tl.load(part_max_ptr + row * NUM_CHUNKS + offs, mask=mask, other=float("-inf"))
    top = tl.max(best, axis=0)
    chunk = tl.min(tl.where(mask & (best == top), offs, NUM_CHUNKS), axis=0)  # the first
    index = tl.load(part_idx_ptr + row * NUM_CHUNKS + chunk)
    tl.store(out_ptr + row, index.to(tl.int64))


def argmax_rows(logits: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """The first maximal index of each row of logits [R, V] (float, contiguous rows): int64
    [R] on logits' device. backend "auto": Triton on CUDA, torch.argmax on CPU."""
    if logits.dim() != 2 or not logits.is_floating_point() or logits.stride(-1) != 1:
        raise ValueError(f"argmax_rows: need a 2-D float tensor with contiguous rows, got "
                         f"{logits.dtype} {tuple(logits.shape)} strides {logits.stride()}")
    rows, vocab = logits.shape
    if vocab == 0:
        raise ValueError("argmax_rows: rows are empty")
    if not _use_triton(backend, logits):
        return logits.argmax(-1)
    out = torch.empty(rows, dtype=torch.long, device=logits.device)
    if rows == 0:
        return out
    chunks = triton.cdiv(vocab, BLOCK)
    part_max = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device)
    _chunk_argmax_kernel[(rows, chunks)](logits, part_max, part_idx, vocab, logits.stride(0),
                                         chunks, BLOCK=BLOCK)
    _pick_chunk_kernel[(rows,)](part_max, part_idx, out, chunks,
                                BLOCK_C=triton.next_power_of_2(chunks))
    return out


BISECT_BLOCK = 4096  # vocabulary entries a program sums at a time in the whole-row search
KEY_NEG_INF = tl.constexpr(-2139095041)  # _ordered keys of -inf and +inf
KEY_POS_INF = tl.constexpr(2139095040)


@triton.jit
def _ordered(bits):
    """int32 float bits -> an int32 key with the floats' order (negatives' magnitudes flipped);
    its own inverse."""
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _top_p_threshold_kernel(
    logits_ptr, values_ptr, log_total_ptr, top_p_ptr, whole_ptr, out_ptr,
    V, C, stride_l, stride_v, BLOCK_C: tl.constexpr, BLOCK: tl.constexpr,
):
    """out[row]: the largest logit t with mass(logits >= t) >= top_p (every token at or above it
    survives), from values = the row's C largest logits in descending order; -inf when top_p >=
    1 or nothing reaches top_p. whole: the row's mass is the whole row's (top_k off); else the
    candidates hold all of it and their cutoff stands."""
    row = tl.program_id(0).to(tl.int64)
    top_p = tl.load(top_p_ptr + row)
    log_total = tl.load(log_total_ptr + row)
    offs_c = tl.arange(0, BLOCK_C)
    vals = tl.load(values_ptr + row * stride_v + offs_c, mask=offs_c < C, other=float("-inf"))
    probs = tl.exp(vals - log_total)
    mass = tl.cumsum(probs, 0)
    keep = tl.sum(((mass - probs < top_p) & (offs_c < C)).to(tl.int32), 0)  # >= 1
    out = tl.sum(tl.where(offs_c == keep - 1, vals, 0.0), 0)  # vals[keep - 1]
    if (tl.sum(probs, 0) < top_p) & (tl.load(whole_ptr + row) != 0):
        # the cutoff lies past the candidates: bisect over the ordered keys, keeping
        # mass(>= hi) < top_p (and mass(>= lo) >= top_p, unless the row's float sum never
        # reaches it: then lo stays -inf, all kept); adjacent keys end it, lo is then a logit
        offs = tl.arange(0, BLOCK)
        lo = tl.full((), KEY_NEG_INF, tl.int64)
        hi = tl.full((), KEY_POS_INF, tl.int64)
        for _ in range(33):  # the keys of the non-NaN floats span < 2^32
            if hi - lo > 1:
                mid = lo + (hi - lo) // 2
                pivot = _ordered(mid.to(tl.int32)).to(tl.float32, bitcast=True)
                m = tl.zeros((BLOCK,), tl.float32)
                for start in range(0, V, BLOCK):
                    x = tl.load(logits_ptr + row * stride_l + start + offs,
                                mask=start + offs < V, other=float("-inf"))
                    m += tl.where(x >= pivot, tl.exp(x - log_total), 0.0)
                if tl.sum(m, 0) >= top_p:
                    lo = mid
                else:
                    hi = mid
        out = _ordered(lo.to(tl.int32)).to(tl.float32, bitcast=True)
    out = tl.where(top_p >= 1.0, float("-inf"), out)
    tl.store(out_ptr + row, out)


def top_p_threshold_rows(logits: torch.Tensor, values: torch.Tensor, log_total: torch.Tensor,
                         top_p: torch.Tensor, whole: torch.Tensor, *,
                         backend: str = "auto") -> torch.Tensor:
    """top_p's logit cutoff [R, 1] of each row of logits [R, V] (fp32, contiguous rows): the
    largest logit t whose tokens at or above it hold >= top_p of the mass, -inf where top_p >= 1.
    values [R, C]: each row's C largest logits, descending (beyond top_k: -inf); log_total
    [R, 1]: the log of the softmax denominator; top_p [R, 1] fp32; whole [R] bool: the mass is
    the whole row's (top_k off), so the cutoff may lie past the candidates. Nothing here waits
    for the device. backend "auto": Triton on CUDA, else the same rule in torch (a full sort)."""
    rows, vocab = logits.shape
    if logits.dtype != torch.float32 or logits.stride(-1) != 1 or values.dim() != 2 \
            or values.shape[0] != rows or not 0 < values.shape[1] <= vocab:
        raise ValueError(f"top_p_threshold_rows: need fp32 logits [R, V] with contiguous rows "
                         f"and values [R, C <= V]; got {logits.dtype} {tuple(logits.shape)}, "
                         f"values {tuple(values.shape)}")
    if not _use_triton(backend, logits):
        return _top_p_threshold_torch(logits, values, log_total, top_p, whole)
    out = torch.empty(rows, 1, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return out
    values = values.contiguous()
    _top_p_threshold_kernel[(rows,)](
        logits, values, log_total.float().contiguous(), top_p.float().contiguous(),
        whole.to(torch.int8).contiguous(), out, vocab, values.shape[1], logits.stride(0),
        values.stride(0), BLOCK_C=triton.next_power_of_2(values.shape[1]), BLOCK=BISECT_BLOCK)
    return out


def _top_p_threshold_torch(logits, values, log_total, top_p, whole):
    """The reference: the candidates' cutoff, or (whole rows short of top_p) the whole row's."""
    def cutoff(v):
        probs = (v - log_total).exp()
        mass = probs.cumsum(-1)
        keep = ((mass - probs) < top_p).sum(-1, keepdim=True).clamp(min=1)
        return v.gather(1, keep - 1), mass[:, -1:]

    out, held = cutoff(values)
    short = (held < top_p) & whole.view(-1, 1)
    full, _ = cutoff(logits.sort(dim=-1, descending=True).values)
    out = torch.where(short, full, out)
    return torch.where(top_p >= 1.0, float("-inf"), out)
