"""Sampling kernels (GPU): greedy's argmax over the vocabulary, and top_p's cutoff without a
host round trip.

argmax_rows: torch.argmax reduces a row in one thread block, a few percent of a 1B model's
batch-1 decode step on the H200 for a 128k-entry row (bench/results/engine_gpu.batch1_mx.json,
eager kernel profile). Here a row is cut into BLOCK-wide chunks, one program each (its maximum
and that maximum's first index), and then one program a row takes the first chunk holding the
row's maximum: the result is the first maximal index, as torch.argmax's. A NaN counts as +inf
here (torch.argmax returns the first NaN instead); such logits come from a broken model either
way.

top_p_threshold_rows: the sampler finds top_p's cutoff among a row's 256 largest logits, and
must look further when they hold less than top_p of the mass; asking whether they do makes the
host wait for the device every step (worker/sampler.py). Here the device decides: one program a
row takes the candidates' cutoff when they hold the mass, else an exact search of the whole row
runs, a radix select over the logits' ordered float bits (RADIX_BITS a level, each level one
launch with the row split over many programs, each summing its chunk's mass per bucket): one
program a row with a bisection over its values is far slower on a flat row
(bench/results/engine_gpu.sweep_last_size.md).
"""

from __future__ import annotations

import torch

from .triton_compat import tl, triton
from .triton_compat import use_triton as _use_triton

BLOCK = 2048  # vocabulary entries a stage-1 program reads (8 KB of fp32 logits)


@triton.jit
def _chunk_argmax_kernel(
    x_ptr, part_max_ptr, part_idx_ptr, thr_ptr,  # x [R, V]; parts [R, C]; thr [R] (HAS_THR)
    seed_ptr,  # int32 [1] (SEED_PTR)
    V, stride_x, NUM_CHUNKS, seed, RACE: tl.constexpr, HAS_THR: tl.constexpr,
    SEED_PTR: tl.constexpr, BLOCK: tl.constexpr,
):
    """Each chunk's largest score and the first index holding it (_pick_chunk_kernel's parts).
    The score is x itself (argmax_rows), or with RACE the exponential race's: x_i - log(q_i),
    q_i ~ Exp(1) from Philox (key `seed`, or with SEED_PTR the one at seed_ptr; counter row * V
    + i), tokens under the row's threshold out of it (race_rows). A NaN score counts as +inf."""
    row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + row * stride_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    if RACE:
        if SEED_PTR:
            seed = tl.load(seed_ptr)
        # u ~ U(0, 1] from 32 random bits, so q = -log(1 - u) keeps its resolution near 0
        # (where winners come from) at 2^-32 rather than fp32's 2^-24 near 1; a series where
        # 1 - u rounds
        r = tl.randint(seed, (row * V + offs).to(tl.int32)).to(tl.uint32, bitcast=True)
        u = (r.to(tl.float32) + 1.0) * 2.3283064365386963e-10  # (r + 1) / 2^32
        q = tl.where(u < 0.00390625, u * (1.0 + u * (0.5 + u * 0.3333333333)), -tl.log(1.0 - u))
        keep = offs < V
        if HAS_THR:
            keep = keep & (v >= tl.load(thr_ptr + row))
        v = tl.where(keep, v - tl.log(q), float("-inf"))
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
    _chunk_argmax_kernel[(rows, chunks)](logits, part_max, part_idx, part_max, part_idx, vocab,
                                         logits.stride(0), chunks, 0, RACE=False, HAS_THR=False,
                                         SEED_PTR=False, BLOCK=BLOCK)
    _pick_chunk_kernel[(rows,)](part_max, part_idx, out, chunks,
                                BLOCK_C=triton.next_power_of_2(chunks))
    return out


def race_rows(logits: torch.Tensor, threshold: torch.Tensor | None,
              seed: int | torch.Tensor) -> torch.Tensor:
    """One token a row [R] int64, drawn from softmax(logits) over the tokens at or above the
    row's threshold ([R, 1], None: all), as the sampler's exponential race (argmax of p / q, q ~
    Exp(1)) but fused: no softmax, no probability tensor, the draws from Philox (key `seed`;
    a caller passes a new one each call; or an int32 [1] tensor on the logits' device holding
    it, read when the kernel runs: a CUDA graph's input). Triton (CUDA, or the interpreter);
    logits fp32 [R, V] with contiguous rows, R * V < 2^31 (Philox counters)."""
    rows, vocab = logits.shape
    if logits.dtype != torch.float32 or logits.stride(-1) != 1 or vocab == 0 \
            or rows * vocab >= 2**31:
        raise ValueError(f"race_rows: need fp32 logits [R, V > 0] with contiguous rows and "
                         f"R * V < 2^31; got {logits.dtype} {tuple(logits.shape)}")
    out = torch.empty(rows, dtype=torch.long, device=logits.device)
    if rows == 0:
        return out
    block = min(BLOCK, triton.next_power_of_2(vocab))
    chunks = triton.cdiv(vocab, block)
    part_max = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device)
    thr = threshold.float().contiguous() if threshold is not None else part_max
    on_device = isinstance(seed, torch.Tensor)
    _chunk_argmax_kernel[(rows, chunks)](logits, part_max, part_idx, thr,
                                         seed if on_device else part_idx, vocab,
                                         logits.stride(0), chunks,
                                         0 if on_device else seed & 0x7FFFFFFF, RACE=True,
                                         HAS_THR=threshold is not None, SEED_PTR=on_device,
                                         BLOCK=block)
    _pick_chunk_kernel[(rows,)](part_max, part_idx, out, chunks,
                                BLOCK_C=triton.next_power_of_2(chunks))
    return out


# The whole-row search: a radix select over the logits' ordered float keys, RADIX_BITS a level
# from the top (RADIX_LEVELS levels cover 32 bits). A level is one launch over the row in
# RADIX_BLOCK chunks, one program each: every program sums the mass of its chunk's keys in each
# of the RADIX_BINS buckets under the prefix chosen so far, into its own slot (no atomics: the
# sums are read in a fixed order, so the cutoff is deterministic); the next level's programs
# each read the partials back and pick the bucket where the mass from the top crosses top_p.
RADIX_BITS = 4
RADIX_BINS = 1 << RADIX_BITS
RADIX_LEVELS = 32 // RADIX_BITS
RADIX_BLOCK = 1024
SEARCH_ALL = tl.constexpr(-1)  # prefix state: the row's float mass never reaches top_p: keep all


@triton.jit
def _ordered(bits):
    """int32 float bits -> an int32 key with the floats' order (negatives' magnitudes flipped);
    its own inverse."""
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _top_p_candidates_kernel(
    values_ptr, log_total_ptr, top_p_ptr, whole_ptr, out_ptr, need_ptr, target_ptr,
    C, stride_v, BLOCK_C: tl.constexpr,
):
    """out[row]: the largest logit t with mass(logits >= t) >= top_p (every token at or above it
    survives), from values = the row's C largest logits in descending order; -inf when top_p >=
    1. need[row]: the candidates fall short of top_p and the row's mass is the whole row's (top_k
    off, `whole`): the search below replaces out[row]; target[row] = top_p, what it must find."""
    row = tl.program_id(0).to(tl.int64)
    top_p = tl.load(top_p_ptr + row)
    offs_c = tl.arange(0, BLOCK_C)
    vals = tl.load(values_ptr + row * stride_v + offs_c, mask=offs_c < C, other=float("-inf"))
    probs = tl.exp(vals - tl.load(log_total_ptr + row))
    mass = tl.cumsum(probs, 0)
    keep = tl.sum(((mass - probs < top_p) & (offs_c < C)).to(tl.int32), 0)  # >= 1
    out = tl.sum(tl.where(offs_c == keep - 1, vals, 0.0), 0)  # vals[keep - 1]
    need = (tl.sum(probs, 0) < top_p) & (tl.load(whole_ptr + row) != 0) & (top_p < 1.0)
    tl.store(out_ptr + row, tl.where(top_p >= 1.0, float("-inf"), out))
    tl.store(need_ptr + row, need.to(tl.int32))
    tl.store(target_ptr + row, top_p)


@triton.jit
def _pick_bucket(part_ptr, prefix_ptr, target_ptr, row, NUM_CHUNKS, BITS: tl.constexpr,
                 FIRST: tl.constexpr, BLOCK_C: tl.constexpr):
    """(prefix, target) after the level whose partials [R, NUM_CHUNKS, BINS] part_ptr holds:
    the bucket b (from the top) where the mass at or above it first reaches the target, so the
    cutoff key lies in it; target less the mass of the buckets above. When no bucket reaches it
    (float sums: the row's mass short of top_p), the lowest bucket with mass, keeping all of it
    (at the first level: SEARCH_ALL). The last level's prefix is the whole key (int32 bits of
    the unsigned order)."""
    BINS: tl.constexpr = 1 << BITS
    prefix = tl.load(prefix_ptr + row)
    target = tl.load(target_ptr + row)
    c = tl.arange(0, BLOCK_C)
    b = tl.arange(0, BINS)
    part = tl.load(part_ptr + (row * NUM_CHUNKS + c[:, None]) * BINS + b[None, :],
                   mask=c[:, None] < NUM_CHUNKS, other=0.0)
    h = tl.sum(part, 0)  # [BINS], chunks in a fixed order
    at_or_above = tl.sum(h, 0) - tl.cumsum(h, 0) + h  # mass in buckets >= b
    reach = tl.sum((at_or_above >= target).to(tl.int32), 0)  # buckets 0 .. reach - 1 reach it
    lowest = tl.min(tl.where(h > 0, b, BINS), 0)
    pick = tl.where(reach > 0, reach - 1, tl.where(lowest < BINS, lowest, 0))
    above = tl.sum(tl.where(b == pick, at_or_above - h, 0.0), 0)
    new_prefix = tl.where(prefix == SEARCH_ALL, SEARCH_ALL, (prefix << BITS) | pick)
    if FIRST:  # the whole row's float mass short of top_p: keep it all
        new_prefix = tl.where(reach > 0, new_prefix, SEARCH_ALL)
    return new_prefix, target - above


@triton.jit
def _top_p_level_kernel(
    logits_ptr, log_total_ptr, need_ptr, prefix_ptr, target_ptr, part_ptr, top_p_ptr, stats_ptr,
    R, V, stride_l, NUM_CHUNKS, LEVEL: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr,
    BLOCK_C: tl.constexpr, FROM_TOP_P: tl.constexpr,
):
    """One level of the whole-row search for rows that need it: pick the previous level's
    bucket (every program alike; chunk 0 stores the state), then sum this chunk's mass per
    bucket of the next BITS key bits under that prefix. State [2, R] and partials [2, R,
    NUM_CHUNKS, BINS], a level in slot LEVEL % 2 (level 0's state: prefix 0, target top_p).
    FROM_TOP_P (level 0 of top_p_search_rows): every row with top_p < 1 is searched, over the
    whole row; its log_total comes from _row_stats_kernel's chunk partials [R, NUM_CHUNKS, 2],
    and chunk 0 stores it with need and level 0's target for the levels after (and, at level
    0 in either mode, the prefix 0)."""
    row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    if FROM_TOP_P:
        top_p = tl.load(top_p_ptr + row)
        c = tl.arange(0, BLOCK_C)
        cmax = tl.load(stats_ptr + (row * NUM_CHUNKS + c) * 2, mask=c < NUM_CHUNKS,
                       other=float("-inf"))
        csum = tl.load(stats_ptr + (row * NUM_CHUNKS + c) * 2 + 1, mask=c < NUM_CHUNKS, other=0.0)
        big = tl.max(cmax, 0)
        log_total = big + tl.log(tl.sum(csum * tl.exp(cmax - big), 0))
        if chunk == 0:
            tl.store(need_ptr + row, (top_p < 1.0).to(tl.int32))
            tl.store(log_total_ptr + row, log_total)
            tl.store(target_ptr + row, top_p)
        if top_p >= 1.0:
            return
    elif tl.load(need_ptr + row) == 0:
        return
    BINS: tl.constexpr = 1 << BITS
    SLOT: tl.constexpr = LEVEL % 2
    PREV: tl.constexpr = 1 - SLOT
    if LEVEL == 0:
        prefix = 0  # nothing fixed yet
        if chunk == 0:
            tl.store(prefix_ptr + row, 0)
    else:
        prefix, target = _pick_bucket(part_ptr + PREV * R * NUM_CHUNKS * BINS,
                                      prefix_ptr + PREV * R, target_ptr + PREV * R, row,
                                      NUM_CHUNKS, BITS, LEVEL == 1, BLOCK_C)
        if chunk == 0:
            tl.store(prefix_ptr + SLOT * R + row, prefix)
            tl.store(target_ptr + SLOT * R + row, target)
    if prefix != SEARCH_ALL:
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(logits_ptr + row * stride_l + offs, mask=offs < V, other=float("-inf"))
        key = _ordered(x.to(tl.int32, bitcast=True)) ^ -2147483648  # unsigned order, as int32
        SHIFT: tl.constexpr = 32 - BITS * (LEVEL + 1)
        mine = (x > float("-inf")) & (offs < V)
        if LEVEL > 0:  # keys under the prefix: bits above SHIFT + BITS equal to it
            mine = mine & (((key >> (SHIFT + BITS)) & ((1 << (BITS * LEVEL)) - 1)) == prefix)
        bucket = (key >> SHIFT) & (BINS - 1)
        if not FROM_TOP_P:
            log_total = tl.load(log_total_ptr + row)
        mass = tl.where(mine, tl.exp(x - log_total), 0.0)
        b = tl.arange(0, BINS)
        h = tl.sum(tl.where(bucket[:, None] == b[None, :], mass[:, None], 0.0), 0)
        tl.store(part_ptr + ((SLOT * R + row) * NUM_CHUNKS + chunk) * BINS + b, h)


@triton.jit
def _top_p_finish_kernel(
    need_ptr, prefix_ptr, target_ptr, part_ptr, out_ptr, R, NUM_CHUNKS,
    LEVELS: tl.constexpr, BITS: tl.constexpr, BLOCK_C: tl.constexpr,
    UNSEARCHED_INF: tl.constexpr,
):
    """out[row] for searched rows: the last level's bucket completes the key, a logit of the
    row (-inf when the row's float mass never reached top_p: all kept). UNSEARCHED_INF: the
    other rows get -inf (top_p_search_rows: their top_p >= 1); else out keeps their value."""
    row = tl.program_id(0).to(tl.int64)
    if UNSEARCHED_INF and tl.load(need_ptr + row) == 0:
        tl.store(out_ptr + row, float("-inf"))
    if tl.load(need_ptr + row) != 0:
        BINS: tl.constexpr = 1 << BITS
        SLOT: tl.constexpr = (LEVELS - 1) % 2
        key, _ = _pick_bucket(part_ptr + SLOT * R * NUM_CHUNKS * BINS, prefix_ptr + SLOT * R,
                              target_ptr + SLOT * R, row, NUM_CHUNKS, BITS, LEVELS == 1,
                              BLOCK_C)
        cut = _ordered(key ^ -2147483648).to(tl.float32, bitcast=True)
        tl.store(out_ptr + row, tl.where(key == SEARCH_ALL, float("-inf"), cut))


def top_p_threshold_rows(logits: torch.Tensor, values: torch.Tensor, log_total: torch.Tensor,
                         top_p: torch.Tensor, whole: torch.Tensor, *,
                         backend: str = "auto") -> torch.Tensor:
    """top_p's logit cutoff [R, 1] of each row of logits [R, V] (fp32, contiguous rows): the
    largest logit t whose tokens at or above it hold >= top_p of the mass, -inf where top_p >= 1.
    values [R, C]: each row's C largest logits, descending (beyond top_k: -inf); log_total
    [R, 1]: the log of the softmax denominator; top_p [R, 1] fp32; whole [R] bool: the mass is
    the whole row's (top_k off), so the cutoff may lie past the candidates. Nothing here waits
    for the device: rows the candidates serve skip the search's launches at once. backend
    "auto": Triton on CUDA, else the same rule in torch (a full sort)."""
    rows, vocab = logits.shape
    if logits.dtype != torch.float32 or logits.stride(-1) != 1 or values.dim() != 2 \
            or values.shape[0] != rows or not 0 < values.shape[1] <= vocab:
        raise ValueError(f"top_p_threshold_rows: need fp32 logits [R, V] with contiguous rows "
                         f"and values [R, C <= V]; got {logits.dtype} {tuple(logits.shape)}, "
                         f"values {tuple(values.shape)}")
    if not _use_triton(backend, logits):
        return _top_p_threshold_torch(logits, values, log_total, top_p, whole)
    dev = logits.device
    out = torch.empty(rows, 1, dtype=torch.float32, device=dev)
    if rows == 0:
        return out
    values = values.contiguous()
    log_total = log_total.float().contiguous()
    need = torch.empty(rows, dtype=torch.int32, device=dev)
    target = torch.empty(2, rows, dtype=torch.float32, device=dev)
    _top_p_candidates_kernel[(rows,)](
        values, log_total, top_p.float().contiguous(), whole.to(torch.int8).contiguous(), out,
        need, target, values.shape[1], values.stride(0),
        BLOCK_C=triton.next_power_of_2(values.shape[1]))
    _radix_search(logits, log_total, need, target, out)
    return out


def _radix_search(logits, log_total, need, target, out, top_p=None, stats=None) -> None:
    """The whole-row search's launches: rows flagged in need [R] (int32), target[0] [R] what
    each must find, cutoffs into out. With top_p and stats (top_p_search_rows), level 0 writes
    need, target[0] and log_total from them (FROM_TOP_P) and the rows not searched get -inf."""
    rows, vocab = logits.shape
    chunks = triton.cdiv(vocab, RADIX_BLOCK)
    block_c = triton.next_power_of_2(chunks)
    prefix = torch.empty(2, rows, dtype=torch.int32, device=logits.device)
    part = torch.empty(2, rows, chunks, RADIX_BINS, dtype=torch.float32, device=logits.device)
    for level in range(RADIX_LEVELS):
        from_top_p = level == 0 and top_p is not None
        _top_p_level_kernel[(rows, chunks)](
            logits, log_total, need, prefix, target, part, top_p if from_top_p else log_total,
            stats if from_top_p else log_total, rows, vocab, logits.stride(0), chunks,
            LEVEL=level, BITS=RADIX_BITS, BLOCK=RADIX_BLOCK, BLOCK_C=block_c,
            FROM_TOP_P=from_top_p)
    _top_p_finish_kernel[(rows,)](need, prefix, target, part, out, rows, chunks,
                                  LEVELS=RADIX_LEVELS, BITS=RADIX_BITS, BLOCK_C=block_c,
                                  UNSEARCHED_INF=top_p is not None)


@triton.jit
def _row_stats_kernel(logits_ptr, stats_ptr, V, stride_l, NUM_CHUNKS, BLOCK: tl.constexpr):
    """stats[row, chunk] = (max, sum of exp(x - max)) of the chunk's logits."""
    row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + row * stride_l + offs, mask=offs < V, other=float("-inf"))
    big = tl.max(x, 0)
    total = tl.sum(tl.exp(x - tl.where(big > float("-inf"), big, 0.0)), 0)  # (-inf - -inf: NaN)
    tl.store(stats_ptr + (row * NUM_CHUNKS + chunk) * 2, big)
    tl.store(stats_ptr + (row * NUM_CHUNKS + chunk) * 2 + 1, total)


def top_p_search_rows(logits: torch.Tensor, top_p: torch.Tensor, *,
                      backend: str = "auto") -> torch.Tensor:
    """top_p's logit cutoff [R, 1] over whole rows (top_k off): as top_p_threshold_rows, with
    the softmax denominator taken here and no candidates; every row with top_p < 1 is searched
    (-inf where top_p >= 1). 10 launches, nothing before them: no topk, no logsumexp, which
    cost far more launches and host time (bench/results/sampler_probe.radix.md)."""
    rows, vocab = logits.shape
    if logits.dtype != torch.float32 or logits.stride(-1) != 1 or vocab == 0:
        raise ValueError(f"top_p_search_rows: need fp32 logits [R, V > 0] with contiguous rows; "
                         f"got {logits.dtype} {tuple(logits.shape)}")
    if not _use_triton(backend, logits):
        log_total = logits.logsumexp(-1, keepdim=True)
        whole = torch.ones(rows, dtype=torch.bool, device=logits.device)
        return _top_p_threshold_torch(logits, logits.amax(-1, keepdim=True), log_total, top_p,
                                      whole)  # the largest logit as the one candidate
    dev = logits.device
    out = torch.empty(rows, 1, dtype=torch.float32, device=dev)
    if rows == 0:
        return out
    chunks = triton.cdiv(vocab, RADIX_BLOCK)
    f32 = dict(dtype=torch.float32, device=dev)
    stats = torch.empty(rows, chunks, 2, **f32)
    _row_stats_kernel[(rows, chunks)](logits, stats, vocab, logits.stride(0), chunks,
                                      BLOCK=RADIX_BLOCK)
    _radix_search(logits, torch.empty(rows, **f32), torch.empty(rows, dtype=torch.int32,
                                                                device=dev),
                  torch.empty(2, rows, **f32), out, top_p.float().contiguous(), stats)
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
