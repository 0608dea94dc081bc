"""Paged attention over the KV layout of ARCHITECTURE.md, and the write of new K/V into it.

Caches: [num_blocks, PAGE_SIZE, Hkv, D] (K and V alike); position p of request r is in block
block_tables[r, p // PAGE_SIZE] at offset p % PAGE_SIZE. One kernel, _paged_attention_kernel,
does decode and prefill: a program owns (request x split, KV head, BLOCK_Q queries); its tile rows
are those queries x the GROUP query heads of that KV head (GQA packing: every gathered K/V tile is
read once for all of them; at least 16 rows for tl.dot). It walks its context range BLOCK_N tokens
at a time with an online softmax (running max and sum in fp32, base 2); q k^T and p v run on
tl.dot with fp32 accumulation, p rounded to the cache dtype for the second (as flash attention).
- decode (BLOCK_Q = 1, memory bound): the context may be split; each split writes an fp32 partial
  output and its log-sum-exp, merged by _merge_splits_kernel in a fixed order (no atomics).
  Default splits (_decode_splits): none when the batch fills two programs an SM, else four an
  SM, at least MIN_SPLIT_TOKENS tokens a split.
- prefill/extend: varlen chunks, causal over the cached context plus the chunk (K/V written first).
- attention mass (H2O), on request, added into a caller's fp32 [R, width] buffer:
  decode (folded): the attention kernel also stores, for every score s it computes (base 2), the
  p = exp2(s - m) its online softmax already has (m: the row's running max after that tile) in
  [B, Hq, width] and each tile's m in [B, Hq, tiles]; once the splits are merged,
  _decode_mass_kernel sums p * exp2(m - lse) = exp2(s - lse) over the heads with the final
  log-sum-exp. p <= 1, so it keeps its relative precision in float16 (SCORES_DTYPE): 2 or 4
  bytes a (position, query head) written and read back instead of K read again.
  prefill windows (second pass): the kernels keep each row's log-sum-exp, then _attn_mass_kernel
  recomputes the scores per (request, BLOCK_N positions) and sums exp2(s - lse) over heads and
  queries: one more pass over K, cheaper than storing a score per (query, head, position) for
  a window of many queries.
Index values (block ids, lengths) are the caller's contract and go unchecked: no host syncs.
"""

from __future__ import annotations

import torch

from .triton_compat import (
    cast_out,
    gdc_launch_dependents,
    interpreted_bf16,
    pdl_supported,
    round_bf16,
    tl,
    to_f32,
    triton,
)
from .triton_compat import use_triton as _use_triton

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LOG2E = 1.4426950408889634
MIN_SPLIT_TOKENS = 64
MAX_SPLITS = 64
# the folded mass's stored p (exp2(score - its tile's max) <= 1): float32 keeps the mass exact to
# fp32 rounding; float16 halves the bytes written and read again (2^-12 relative per term)
SCORES_DTYPE = torch.float32


@triton.jit
def _qk(q, k, INTERP_BF16: tl.constexpr):
    """fp32 [M, N] = q [M, D] @ k [N, D].T in the cache dtype (interpreted bf16: exact fp32)."""
    if INTERP_BF16:
        return tl.dot(to_f32(q, INTERP_BF16), tl.trans(to_f32(k, INTERP_BF16)),
                      input_precision="ieee")
    return tl.dot(q, tl.trans(k), input_precision="ieee")


@triton.jit
def _kv_offsets(bt_row_ptr, pos, valid, kv_head, offs_d, stride_cb, stride_cs, stride_ch,
                PAGE_SIZE: tl.constexpr):
    """Cache element offsets [BLOCK_N, BLOCK_D] of positions `pos` of one KV head of a request."""
    blk = tl.load(bt_row_ptr + pos // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
    rows = blk * stride_cb + (pos % PAGE_SIZE) * stride_cs + kv_head * stride_ch
    return rows[:, None] + offs_d[None, :]


@triton.jit
def _attend(q, k_ptrs, v_ptrs, kv_mask, keep, m, den, acc, qk_scale, INTERP_BF16: tl.constexpr):
    """One online-softmax step over a gathered K/V tile; keep [M, N] marks attended pairs.
    Returns the new (max, sum, accumulator) and the tile's p = exp2(s - new max) [M, N]."""
    k = tl.load(k_ptrs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
    v = tl.load(v_ptrs, mask=kv_mask, other=0.0)  # issued with k: a short decode split is one
    s = tl.where(keep, _qk(q, k, INTERP_BF16) * qk_scale, float("-inf"))  # tile, all latency
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    den = den * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    if INTERP_BF16:
        acc = tl.dot(round_bf16(p), to_f32(v, INTERP_BF16), acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
    return m_new, den, acc, p


@triton.jit
def _finish(m, den, acc):
    """(out [M, D] fp32, lse [M] base 2); a row that attended nothing gets 0 and -inf."""
    has = den > 0
    safe = tl.where(has, den, 1.0)
    return acc / safe[:, None], tl.where(has, m + tl.log2(safe), float("-inf"))


@triton.jit
def _request(r, qsl_ptr, ctx_lens_ptr, seq_lens_ptr, IS_DECODE: tl.constexpr):
    """(first query row, query count, context length, seq_len) of request r."""
    seq_len = tl.load(seq_lens_ptr + r)
    if IS_DECODE:  # one query, at position seq_len - 1
        q_start, q_len, ctx = r, 1, seq_len - 1
    else:
        q_start = tl.load(qsl_ptr + r)
        q_len, ctx = tl.load(qsl_ptr + r + 1) - q_start, tl.load(ctx_lens_ptr + r)
    return q_start, q_len, ctx, seq_len


@triton.jit
def _tile_rows(q0, kv_head, q_len, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
               BLOCK_M: tl.constexpr):
    """Tile row i = (query q0 + i // BLOCK_G, head kv_head * GROUP + i % BLOCK_G): the query
    heads sharing a KV head sit in one tile, so K/V tiles are loaded once for all of them."""
    rows = tl.arange(0, BLOCK_M)
    qi, g = q0 + rows // BLOCK_G, rows % BLOCK_G
    return qi, kv_head * GROUP + g, (qi < q_len) & (g < GROUP)


@triton.jit
def _store_scores(row_ptr, s, qi, kv_head, pos, hi, stride_sh, GROUP: tl.constexpr,
                  BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  EVICT: tl.constexpr):
    """A decode tile's p [BLOCK_M, BLOCK_N] (rows: its one query's BLOCK_G heads, then padding)
    into row_ptr [Hq, width] (the buffer's dtype) at positions pos < hi: the [BLOCK_G, BLOCK_N]
    of real rows taken out first and stored on their own, which writes faster than the masked
    whole tile (bench/results/h2o_fold_probe.json). EVICT: the store's L2 eviction policy
    (evict_last unsplit: more of p is still in L2 when the mass kernel reads it,
    bench/results/h2o_l2_probe.json)."""
    s_g = tl.sum(tl.reshape(tl.where((qi == 0)[:, None], s, 0.0),
                            [BLOCK_M // BLOCK_G, BLOCK_G, BLOCK_N]), axis=0)
    g = tl.arange(0, BLOCK_G)
    tl.store(row_ptr + (kv_head * GROUP + g)[:, None] * stride_sh + pos[None, :],
             s_g.to(row_ptr.dtype.element_ty), mask=(g < GROUP)[:, None] & (pos < hi)[None, :],
             eviction_policy=EVICT)


@triton.jit
def _paged_attention_kernel(
    # pointers: q [T, Hq, D]; caches [num_blocks, PAGE_SIZE, Hkv, D]; block_tables [R, max_blocks];
    # query_start_loc [R + 1] and context_lens [R] (unless IS_DECODE); seq_lens [R];
    # out [T, Hq, D] (one split) or fp32 partials [T, Hq, S, D]; lse [T, Hq, S] (if STORE_LSE);
    # if STORE_SCORES (decode only): scores [B, Hq, width] (fp32 or fp16), every attended
    # position's p = exp2(s - m), m its tile's running max, stored in tile_max [B, Hq, tiles] fp32
    q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, qsl_ptr, ctx_lens_ptr, seq_lens_ptr, out_ptr,
    lse_ptr, scores_ptr, tile_max_ptr,
    # scalars: scale * log2(e); context tokens a split (a multiple of BLOCK_N; the last: the rest)
    qk_scale, tokens_per_split,
    # strides (every last dim is contiguous); stride_os is 0 with one split
    stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt, stride_ot, stride_oh,
    stride_os, stride_lt, stride_lh, stride_st, stride_sh, stride_xt, stride_xh,
    # tiles of BLOCK_M = BLOCK_Q queries x BLOCK_G heads (GROUP of them real), see _tile_rows
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, IS_DECODE: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    STORE_LSE: tl.constexpr, STORE_SCORES: tl.constexpr, INTERP_BF16: tl.constexpr,
):
    pid_rs, kv_head, pid_q = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    r, split = pid_rs // NUM_SPLITS, pid_rs % NUM_SPLITS
    q_start, q_len, ctx, seq_len = _request(r, qsl_ptr, ctx_lens_ptr, seq_lens_ptr, IS_DECODE)
    if pid_q * BLOCK_Q >= q_len:
        return
    qi, heads, row_ok = _tile_rows(pid_q * BLOCK_Q, kv_head, q_len, GROUP, BLOCK_G, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_mask = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + (q_start + qi)[:, None] * stride_qt + heads[:, None] * stride_qh
                + offs_d[None, :], mask=row_mask, other=0.0)  # [BLOCK_M, BLOCK_D]
    m = tl.full((BLOCK_M,), -1e30, tl.float32)
    den = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    kv_end = tl.minimum(seq_len, ctx + (pid_q + 1) * BLOCK_Q)  # causal: later keys never seen
    lo = split * tokens_per_split
    hi = tl.where(split == NUM_SPLITS - 1, kv_end, tl.minimum(lo + tokens_per_split, kv_end))
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < hi
        offs = _kv_offsets(bt_ptr + r * stride_bt, pos, valid, kv_head, offs_d, stride_cb,
                           stride_cs, stride_ch, PAGE_SIZE)
        kv_mask = valid[:, None] & (offs_d < HEAD_DIM)[None, :]
        keep = valid[None, :] & (pos[None, :] <= (ctx + qi)[:, None])
        m, den, acc, p = _attend(q, k_cache_ptr + offs, v_cache_ptr + offs, kv_mask, keep, m,
                                 den, acc, qk_scale, INTERP_BF16)
        if STORE_SCORES:  # decode: the mass's numerators, normalised once splits are merged
            _store_scores(scores_ptr + q_start * stride_st, p, qi, kv_head, pos, hi, stride_sh,
                          GROUP, BLOCK_G, BLOCK_M, BLOCK_N,
                          "evict_last" if NUM_SPLITS == 1 else "")
            tl.store(tile_max_ptr + q_start * stride_xt + heads * stride_xh + start // BLOCK_N,
                     m, mask=row_ok)
    o, lse = _finish(m, den, acc)
    out = (out_ptr + (q_start + qi)[:, None] * stride_ot + heads[:, None] * stride_oh
           + split * stride_os + offs_d[None, :])
    if NUM_SPLITS == 1:
        tl.store(out, cast_out(o, out_ptr.dtype.element_ty, INTERP_BF16), mask=row_mask)
    else:
        tl.store(out, o, mask=row_mask)
    if STORE_LSE:
        tl.store(lse_ptr + (q_start + qi) * stride_lt + heads * stride_lh + split, lse,
                 mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    # pointers: fp32 partials [T, Hq, S, D] and lse [T, Hq, S]; out [T, Hq, D]; lse_out [T, Hq]
    part_ptr, part_lse_ptr, out_ptr, lse_out_ptr,
    # strides
    stride_pt, stride_ph, stride_ps, stride_ot, stride_oh,
    # shapes and tiling
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, TRIGGER: tl.constexpr,
    INTERP_BF16: tl.constexpr,
):
    if TRIGGER:  # the next kernel (o_proj's GEMV) may start loading its weights
        gdc_launch_dependents()
    t, h = tl.program_id(0), tl.program_id(1)
    offs_s, offs_d = tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_D)
    lse = tl.load(part_lse_ptr + (t * NUM_HEADS + h) * NUM_SPLITS + offs_s,
                  mask=offs_s < NUM_SPLITS, other=float("-inf"))  # [BLOCK_S], base 2
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # 0 for empty splits
    den = tl.sum(w, axis=0)
    safe = tl.where(den > 0, den, 1.0)
    mask = (offs_s < NUM_SPLITS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    part = tl.load(part_ptr + t * stride_pt + h * stride_ph + offs_s[:, None] * stride_ps
                   + offs_d[None, :], mask=mask, other=0.0)  # [BLOCK_S, BLOCK_D]
    o = tl.sum(w[:, None] * part, axis=0) / safe
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d,
             cast_out(o, out_ptr.dtype.element_ty, INTERP_BF16), mask=offs_d < HEAD_DIM)
    tl.store(lse_out_ptr + t * NUM_HEADS + h, tl.where(den > 0, m + tl.log2(safe), float("-inf")))


@triton.jit
def _decode_mass_kernel(
    # pointers: scores [B, Hq, width] (p, written up to seq_len) and tile_max [B, Hq, tiles] as
    # the attention kernel stored them; lse [B, Hq] (base 2, merged); seq_lens [B];
    # mass [B, >= width] fp32, added into
    scores_ptr, tile_max_ptr, lse_ptr, seq_lens_ptr, mass_ptr,
    # scalars
    width,
    # strides
    stride_st, stride_sh, stride_xt, stride_xh, stride_lt, stride_mr,
    # shapes and tiling (TILE_N: the attention kernel's BLOCK_N)
    NUM_HEADS: tl.constexpr, TILE_N: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
    TRIGGER: tl.constexpr, EVICT: tl.constexpr = "",  # p's L2 policy: read once, last use
):
    if TRIGGER:  # the next kernel (o_proj's GEMV) may start loading its weights
        gdc_launch_dependents()
    b, pid_p = tl.program_id(0), tl.program_id(1)
    end = tl.minimum(tl.load(seq_lens_ptr + b), width)
    if pid_p * BLOCK_P >= end:
        return
    TILES: tl.constexpr = BLOCK_P // TILE_N  # the program's positions start a tile
    pos, offs_h = pid_p * BLOCK_P + tl.arange(0, BLOCK_P), tl.arange(0, BLOCK_H)
    tiles = pid_p * TILES + tl.arange(0, TILES)
    valid = pos < end
    mass = tl.zeros((BLOCK_P,), tl.float32)
    for h0 in range(0, NUM_HEADS, BLOCK_H):
        heads = h0 + offs_h
        lse = tl.load(lse_ptr + b * stride_lt + heads, mask=heads < NUM_HEADS, other=0.0)
        tile_mask = (heads < NUM_HEADS)[:, None] & (tiles * TILE_N < end)[None, :]
        tile_max = tl.load(tile_max_ptr + b * stride_xt + heads[:, None] * stride_xh
                           + tiles[None, :], mask=tile_mask, other=0.0)  # [BLOCK_H, TILES]
        scale = tl.where(tile_mask, tl.exp2(tile_max - lse[:, None]), 0.0)  # one a tile
        p = tl.load(scores_ptr + b * stride_st + heads[:, None] * stride_sh + pos[None, :],
                    mask=(heads < NUM_HEADS)[:, None] & valid[None, :],
                    other=0.0, eviction_policy=EVICT).to(tl.float32)  # [BLOCK_H, BLOCK_P]
        scaled = tl.reshape(p, [BLOCK_H, TILES, TILE_N]) * scale[:, :, None]
        mass += tl.reshape(tl.sum(scaled, axis=0), [BLOCK_P])
    row = mass_ptr + b * stride_mr + pos
    tl.store(row, tl.load(row, mask=valid, other=0.0) + mass, mask=valid)


@triton.jit
def _attn_mass_kernel(
    # pointers: as _paged_attention_kernel; lse [T, Hq] (base 2); mass [R, >= width], added into
    q_ptr, k_cache_ptr, bt_ptr, qsl_ptr, ctx_lens_ptr, seq_lens_ptr, lse_ptr, mass_ptr,
    # scalars
    qk_scale, width,
    # strides
    stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt, stride_lt, stride_mr,
    # shapes and tiling
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, IS_DECODE: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, INTERP_BF16: tl.constexpr,
):
    r, pid_n = tl.program_id(0), tl.program_id(1)
    q_start, q_len, ctx, seq_len = _request(r, qsl_ptr, ctx_lens_ptr, seq_lens_ptr, IS_DECODE)
    end = tl.minimum(seq_len, width)
    if pid_n * BLOCK_N >= end:
        return
    pos, offs_d = pid_n * BLOCK_N + tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_D)
    valid = pos < end
    kv_mask = valid[:, None] & (offs_d < HEAD_DIM)[None, :]
    mass = tl.zeros((BLOCK_N,), tl.float32)
    for kv_head in range(NUM_KV_HEADS):
        offs = _kv_offsets(bt_ptr + r * stride_bt, pos, valid, kv_head, offs_d, stride_cb,
                           stride_cs, stride_ch, PAGE_SIZE)
        k = tl.load(k_cache_ptr + offs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        for q0 in range(0, q_len, BLOCK_Q):
            qi, heads, row_ok = _tile_rows(q0, kv_head, q_len, GROUP, BLOCK_G, BLOCK_M)
            q = tl.load(q_ptr + (q_start + qi)[:, None] * stride_qt + heads[:, None] * stride_qh
                        + offs_d[None, :], mask=row_ok[:, None] & (offs_d < HEAD_DIM)[None, :],
                        other=0.0)
            lse = tl.load(lse_ptr + (q_start + qi) * stride_lt + heads, mask=row_ok, other=0.0)
            s = _qk(q, k, INTERP_BF16) * qk_scale  # [BLOCK_M, BLOCK_N]
            keep = row_ok[:, None] & valid[None, :] & (pos[None, :] <= (ctx + qi)[:, None])
            mass += tl.sum(tl.where(keep, tl.exp2(s - lse[:, None]), 0.0), axis=0)
    row = mass_ptr + r * stride_mr + pos
    tl.store(row, tl.load(row, mask=valid, other=0.0) + mass, mask=valid)


@triton.jit
def _write_kv_kernel(
    # pointers: k, v [T, Hkv, D]; caches [num_blocks, PAGE_SIZE, Hkv, D]; slots [T] (< 0: skip)
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
    # strides
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
    # shapes and tiling
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot >= 0:
        offs_h, offs_d = tl.arange(0, BLOCK_H), tl.arange(0, BLOCK_D)
        mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
        dst = ((slot // PAGE_SIZE) * stride_cb + (slot % PAGE_SIZE) * stride_cs
               + offs_h[:, None] * stride_ch + offs_d[None, :])
        src = offs_h[:, None] * stride_kh + offs_d[None, :]
        tl.store(k_cache_ptr + dst, tl.load(k_ptr + t * stride_kt + src, mask=mask), mask=mask)
        src = offs_h[:, None] * stride_vh + offs_d[None, :]
        tl.store(v_cache_ptr + dst, tl.load(v_ptr + t * stride_vt + src, mask=mask), mask=mask)


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" \
        else 1


def _decode_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device) -> int:
    """No split when the (request, KV head) programs already fill two an SM; else enough splits
    for four an SM, >= MIN_SPLIT_TOKENS each. Swept on the H200 (bench/tune/paged_decode_tune.py):
    a long single context gains from four an SM over two, while a batch of 64 x 4096 is fastest
    unsplit. The minimum split matters for short contexts in the CUDA graphs (split for
    max_model_len): 64 tokens gave the fastest batch-1 replay
    (bench/results/decode_step_probe.json)."""
    programs, sms = num_seqs * num_kv_heads, _num_sms(device)
    if programs >= 2 * sms:
        return 1
    return max(1, min(triton.cdiv(4 * sms, programs), triton.cdiv(max_seq_len, MIN_SPLIT_TOKENS),
                      MAX_SPLITS))


def _tiles(q: torch.Tensor, group: int, is_decode: bool) -> tuple[int, int, int, int, dict]:
    """(BLOCK_Q, BLOCK_G, BLOCK_M, BLOCK_N, launch options); tile rows: BLOCK_Q queries x BLOCK_G
    heads, at least 16 for tl.dot. Starting points, to be tuned on the H200 (bench/)."""
    block_g = triton.next_power_of_2(group)
    rows, block_n, opts = (64, 64 if q.shape[-1] <= 128 else 32, dict(num_warps=4)) if q.is_cuda \
        else (16, 16, {})
    block_q = 1 if is_decode else max(1, rows // block_g)
    return block_q, block_g, max(16, block_q * block_g), block_n, opts


def check_attention_args(fn: str, q, k_cache, v_cache, out, **index) -> None:
    """Shapes, dtypes, devices, strides; index: name=(int32 tensor, shape with None = any)."""
    if q.dtype not in DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"{fn}: q and the caches must share one dtype of float32, bfloat16, "
                         f"float16; got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape \
            or k_cache.stride() != v_cache.stride():
        raise ValueError(f"{fn}: need q [tokens, Hq, D] and k_cache, v_cache of one shape and "
                         f"strides [num_blocks, block_size, Hkv, D]; got {tuple(q.shape)}, "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if k_cache.shape[3] != q.shape[2] or q.shape[1] % k_cache.shape[2] or q.shape[2] < 16:
        raise ValueError(f"{fn}: need one head_dim >= 16 and Hq a multiple of Hkv; got q "
                         f"{tuple(q.shape)}, caches {tuple(k_cache.shape)}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError(f"{fn}: q and the caches must be contiguous along head_dim")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1):
        raise ValueError(f"{fn}: out must be {q.dtype} {tuple(q.shape)}, contiguous along head_dim")
    for t in (k_cache, v_cache, out, *(t for t, _ in index.values())):
        if t is not None and t.device != q.device:
            raise ValueError(f"{fn}: all tensors must be on {q.device}, got one on {t.device}")
    for name, (t, shape) in index.items():
        if t.dtype != torch.int32 or t.dim() != len(shape) or t.stride(-1) != 1 or any(
                s is not None and s != n for s, n in zip(shape, t.shape)):
            raise ValueError(f"{fn}: {name} must be int32 of shape {shape} (None: any) with a "
                             f"unit last stride; got {t.dtype} {tuple(t.shape)}")


def _launch(q, k_cache, v_cache, index, out, scale, width, *, is_decode, num_splits,
            max_query_len, mass, fold_mass):
    """Attention (+ split merge, + mass) kernels; index: block_tables, query_start_loc,
    context_lens, seq_lens (the middle two unread when is_decode). mass: None, or fp32
    [R, >= width] to add the attention mass into; fold_mass: take it from the scores the
    attention kernel stores (decode) rather than from a second pass over K."""
    (total_q, num_heads, head_dim), num_kv_heads = q.shape, k_cache.shape[2]
    block_tables, seq_lens = index[0], index[3]
    num_seqs, group = seq_lens.shape[0], num_heads // num_kv_heads
    block_q, block_g, block_m, block_n, opts = _tiles(q, group, is_decode)
    tokens_per_split = triton.cdiv(triton.cdiv(max(width, 1), num_splits), block_n) * block_n
    num_splits = triton.cdiv(max(width, 1), tokens_per_split)
    f32 = dict(dtype=torch.float32, device=q.device)
    lse = torch.empty(total_q, num_heads, num_splits, **f32) \
        if num_splits > 1 or mass is not None else None  # [T, Hq, S], base 2
    part = out if num_splits == 1 else torch.empty(total_q, num_heads, num_splits, head_dim, **f32)
    lse_arg = part if lse is None else lse
    fold = mass is not None and fold_mass and is_decode and width > 0
    scores, tile_max = (torch.empty(total_q, num_heads, width, dtype=SCORES_DTYPE, device=q.device),
                        torch.empty(total_q, num_heads, triton.cdiv(width, block_n), **f32)) \
        if fold else (lse_arg, lse_arg)
    meta = dict(GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=k_cache.shape[1], IS_DECODE=is_decode,
                BLOCK_Q=block_q, BLOCK_G=block_g, BLOCK_M=block_m, BLOCK_N=block_n,
                BLOCK_D=triton.next_power_of_2(head_dim),
                INTERP_BF16=interpreted_bf16(q.dtype, q), **opts)
    if total_q and num_seqs:
        grid = (num_seqs * num_splits, num_kv_heads, triton.cdiv(max_query_len, block_q))
        _paged_attention_kernel[grid](
            q, k_cache, v_cache, *index, part, lse_arg, scores, tile_max, scale * LOG2E,
            tokens_per_split,
            q.stride(0), q.stride(1), *k_cache.stride()[:3], block_tables.stride(0),
            part.stride(0), part.stride(1), 0 if num_splits == 1 else part.stride(2),
            lse_arg.stride(0), lse_arg.stride(1), scores.stride(0), scores.stride(1),
            tile_max.stride(0), tile_max.stride(1), NUM_SPLITS=num_splits,
            STORE_LSE=lse is not None, STORE_SCORES=fold, **meta)
    if num_splits > 1 and total_q:
        final = torch.empty(total_q, num_heads, 1, **f32)  # merged lse
        _merge_splits_kernel[(total_q, num_heads)](
            part, lse, out, final, part.stride(0), part.stride(1), part.stride(2), out.stride(0),
            out.stride(1), NUM_HEADS=num_heads, HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=meta["BLOCK_D"],
            TRIGGER=pdl_supported(q), INTERP_BF16=meta["INTERP_BF16"])
        lse = final
    if mass is None or not (total_q and num_seqs and width):
        return out
    if fold:
        block_p, block_h = _mass_tiles(num_seqs, num_heads, width, q.device)
        _decode_mass_kernel[(num_seqs, triton.cdiv(width, block_p))](
            scores, tile_max, lse, seq_lens, mass, width, scores.stride(0), scores.stride(1),
            tile_max.stride(0), tile_max.stride(1), lse.stride(0), mass.stride(0),
            NUM_HEADS=num_heads, TILE_N=block_n, BLOCK_H=block_h, BLOCK_P=block_p,
            TRIGGER=pdl_supported(q), EVICT="evict_first" if num_splits == 1 else "",
            **({"num_warps": 4} if q.is_cuda else {}))
    else:
        _attn_mass_kernel[(num_seqs, triton.cdiv(width, block_n))](
            q, k_cache, block_tables, index[1], index[2], seq_lens, lse, mass, scale * LOG2E,
            width, q.stride(0), q.stride(1), *k_cache.stride()[:3], block_tables.stride(0),
            lse.stride(0), mass.stride(0), NUM_KV_HEADS=num_kv_heads, **meta)
    return out


def _mass_tiles(num_seqs: int, num_heads: int, width: int, device) -> tuple[int, int]:
    """(BLOCK_P, BLOCK_H) of _decode_mass_kernel: 4096 scores a load; long rows of positions
    once the batch fills two programs an SM, else all heads at once over short rows (swept on
    the H200: bench/tune/h2o_fold_probe.py, results/h2o_fold_probe.json)."""
    if device.type != "cuda":  # (two attention tiles a program, as on the GPU: several)
        return 32, min(4, triton.next_power_of_2(num_heads))
    block_p = 512 if num_seqs * triton.cdiv(width, 512) >= 2 * _num_sms(device) else 128
    return block_p, min(triton.next_power_of_2(num_heads), 4096 // block_p)


def _mass_buffer(fn: str, mass, num_seqs: int, width: int, q) -> torch.Tensor:
    """The caller's mass buffer, checked, or a new zeroed one [R, width] fp32."""
    if mass is None:
        return torch.zeros(num_seqs, width, dtype=torch.float32, device=q.device)
    if mass.dtype != torch.float32 or mass.dim() != 2 or mass.shape[0] != num_seqs \
            or mass.shape[1] < width or mass.stride(-1) != 1 or mass.device != q.device:
        raise ValueError(f"{fn}: mass must be float32 [{num_seqs}, >= {width}] on {q.device} "
                         f"with a unit last stride; got {mass.dtype} {tuple(mass.shape)}")
    return mass


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float | None = None, *, num_splits: int | None = None,
                           return_attn_mass: bool = False, out: torch.Tensor | None = None,
                           mass: torch.Tensor | None = None, max_seq_len: int | None = None,
                           backend: str = "auto"):
    """out [B, Hq, D]: request b's one query q[b] attends to its cached positions
    0 .. seq_lens[b] - 1 (its own K/V written first); query head h reads KV head h // (Hq // Hkv).

    scale: default head_dim ** -0.5. num_splits: None = _decode_splits. max_seq_len: a host bound
    on seq_lens (default block_tables.shape[1] * block_size): the mass width and the basis of the
    splits. return_attn_mass: also mass [B, max_seq_len] fp32, each position's softmax probability
    summed over query heads (0 beyond seq_len); with `mass` (fp32 [B, >= max_seq_len], unit last
    stride) it is added into mass[:, :max_seq_len] instead, and mass returned (one buffer summed
    over layers, as a CUDA graph needs). seq_lens[b] == 0 gives zeros. backend: "auto"
    (Triton on CUDA), "triton" or "torch". ValueError unless q and the caches share a dtype of
    fp32/bf16/fp16, head_dim >= 16, last dims contiguous, index tensors int32 of matching shape."""
    num_seqs = q.shape[0] if q.dim() == 3 else -1
    check_attention_args("paged_decode_attention", q, k_cache, v_cache, out,
           block_tables=(block_tables, (num_seqs, None)), seq_lens=(seq_lens, (num_seqs,)))
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"paged_decode_attention: num_splits must be >= 1, got {num_splits}")
    if mass is not None and not return_attn_mass:
        raise ValueError("paged_decode_attention: mass is given but return_attn_mass is False")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    width = block_tables.shape[1] * k_cache.shape[1] if max_seq_len is None else max_seq_len
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    if return_attn_mass:
        mass = _mass_buffer("paged_decode_attention", mass, q.shape[0], width, q)
    if not _use_triton(backend, q):
        ref = paged_decode_attention_torch(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                           return_attn_mass=True, max_seq_len=width)
        out.copy_(ref[0])
        if return_attn_mass:
            mass[:, :width] += ref[1]
        return (out, mass) if return_attn_mass else out
    splits = num_splits or _decode_splits(q.shape[0], k_cache.shape[2], width, q.device)
    _launch(q, k_cache, v_cache, (block_tables, seq_lens, seq_lens, seq_lens), out, scale, width,
            is_decode=True, num_splits=splits, max_query_len=1, mass=mass, fold_mass=True)
    return (out, mass) if return_attn_mass else out


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                            seq_lens: torch.Tensor, context_lens: torch.Tensor,
                            scale: float | None = None, *, return_attn_mass: bool = False,
                            out: torch.Tensor | None = None, mass: torch.Tensor | None = None,
                            max_query_len: int | None = None,
                            max_seq_len: int | None = None, num_splits: int | None = 1,
                            backend: str = "auto"):
    """out [total_q, Hq, D]: request i's queries q[query_start_loc[i]:query_start_loc[i + 1]], at
    positions context_lens[i] .. seq_lens[i] - 1, attend causally to positions 0 .. their own (all
    K/V already in the caches). max_query_len: a host bound on the chunk lengths (default total_q).
    return_attn_mass: also mass [R, max_seq_len] fp32, each position's softmax probability summed
    over query heads and the request's queries (by a second pass over K: a score stored per
    query, head and position would cost more for a chunk of many queries); `mass` as
    paged_decode_attention's. num_splits: context splits, as decode's (None: the
    decode rule, for short query runs such as a speculative verify's k + 1 tokens; long chunks
    fill the device with query tiles and take 1). A request whose seq_len is 0 gives zeros.
    Otherwise as paged_decode_attention."""
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    check_attention_args("paged_prefill_attention", q, k_cache, v_cache, out,
           block_tables=(block_tables, (num_seqs, None)),
           query_start_loc=(query_start_loc, (num_seqs + 1,)), seq_lens=(seq_lens, (num_seqs,)),
           context_lens=(context_lens, (num_seqs,)))
    if mass is not None and not return_attn_mass:
        raise ValueError("paged_prefill_attention: mass is given but return_attn_mass is False")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    width = block_tables.shape[1] * k_cache.shape[1] if max_seq_len is None else max_seq_len
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    if return_attn_mass:
        mass = _mass_buffer("paged_prefill_attention", mass, num_seqs, width, q)
    index = (block_tables, query_start_loc, context_lens, seq_lens)
    if not _use_triton(backend, q):
        ref = paged_prefill_attention_torch(q, k_cache, v_cache, block_tables, query_start_loc,
                                            seq_lens, context_lens, scale,
                                            return_attn_mass=True, max_seq_len=width)
        out.copy_(ref[0])
        if return_attn_mass:
            mass[:, :width] += ref[1]
        return (out, mass) if return_attn_mass else out
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"paged_prefill_attention: num_splits must be >= 1, got {num_splits}")
    splits = num_splits or _decode_splits(num_seqs, k_cache.shape[2], width, q.device)
    _launch(q, k_cache, v_cache, index, out, scale, width, is_decode=False, num_splits=splits,
            max_query_len=q.shape[0] if max_query_len is None else max_query_len, mass=mass,
            fold_mass=False)
    return (out, mass) if return_attn_mass else out


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                   backend: str = "auto") -> None:
    """k_cache/v_cache[slot // block_size, slot % block_size] = k/v [T, Hkv, D] for each token's
    slot_mapping [T] (int32/int64); negative slots (padding) are skipped. In place."""
    if k.dim() != 3 or k.shape != v.shape or k_cache.dim() != 4 or k_cache.shape != v_cache.shape \
            or k_cache.stride() != v_cache.stride() or k.shape[1:] != k_cache.shape[2:] \
            or len({k.dtype, v.dtype, k_cache.dtype, v_cache.dtype}) != 1 or k.dtype not in DTYPES \
            or slot_mapping.dtype not in (torch.int32, torch.int64) \
            or slot_mapping.shape != k.shape[:1] \
            or any(t.stride(-1) != 1 for t in (k, v, k_cache, slot_mapping)) \
            or len({t.device for t in (k, v, k_cache, v_cache, slot_mapping)}) != 1:
        raise ValueError(
            "write_kv_cache: need k, v [T, Hkv, D], caches of one shape and strides [num_blocks, "
            "block_size, Hkv, D], all of one float dtype, slot_mapping int32/int64 [T], one "
            f"device, unit last strides; got k {k.dtype} {tuple(k.shape)}, v {tuple(v.shape)}, "
            f"caches {k_cache.dtype} {tuple(k_cache.shape)}, slot_mapping {slot_mapping.dtype} "
            f"{tuple(slot_mapping.shape)}")
    if not _use_triton(backend, k):
        write_kv_cache_torch(k, v, k_cache, v_cache, slot_mapping)
    elif k.shape[0]:
        _write_kv_kernel[(k.shape[0],)](
            k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0),
            v.stride(1), *k_cache.stride()[:3], NUM_KV_HEADS=k.shape[1], HEAD_DIM=k.shape[2],
            PAGE_SIZE=k_cache.shape[1], BLOCK_H=triton.next_power_of_2(k.shape[1]),
            BLOCK_D=triton.next_power_of_2(k.shape[2]))


# ---------------------------------------------------------------- plain-torch references

def write_kv_cache_torch(k, v, k_cache, v_cache, slot_mapping) -> None:
    keep = slot_mapping >= 0
    slots, block_size = slot_mapping[keep].long(), k_cache.shape[1]
    k_cache[slots // block_size, slots % block_size] = k[keep]
    v_cache[slots // block_size, slots % block_size] = v[keep]


def paged_prefill_attention_torch(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                                  context_lens, scale=None, *, return_attn_mass=False,
                                  max_seq_len=None):
    """Per request: gather positions 0 .. seq_len - 1, causal softmax in fp32, cast to q.dtype."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    block_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    width = block_tables.shape[1] * block_size if max_seq_len is None else max_seq_len
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    mass = torch.zeros(seq_lens.shape[0], width, dtype=torch.float32, device=q.device)
    bounds = query_start_loc.tolist()
    for i, (seq_len, ctx) in enumerate(zip(seq_lens.tolist(), context_lens.tolist())):
        pos = torch.arange(seq_len, device=q.device)
        blocks = block_tables[i, pos // block_size].long()
        keys = k_cache[blocks, pos % block_size].float().repeat_interleave(group, 1)  # [L, Hq, D]
        values = v_cache[blocks, pos % block_size].float().repeat_interleave(group, 1)
        qi = q[bounds[i]:bounds[i + 1]].float()  # [n, Hq, D]
        q_pos = ctx + torch.arange(qi.shape[0], device=q.device)
        s = torch.einsum("nhd,lhd->nhl", qi, keys) * scale
        s = s.masked_fill(pos[None, None, :] > q_pos[:, None, None], float("-inf"))
        p = torch.softmax(s, dim=-1)  # [n, Hq, L]
        out[bounds[i]:bounds[i + 1]] = torch.einsum("nhl,lhd->nhd", p, values)
        mass[i, :min(seq_len, width)] = p.sum((0, 1))[:width]
    out = out.to(q.dtype)
    return (out, mass) if return_attn_mass else out


def paged_decode_attention_torch(q, k_cache, v_cache, block_tables, seq_lens, scale=None, *,
                                 return_attn_mass=False, max_seq_len=None):
    """Decode is prefill with one query a request, at position seq_len - 1."""
    qsl = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return paged_prefill_attention_torch(q, k_cache, v_cache, block_tables, qsl, seq_lens,
                                         (seq_lens - 1).clamp(min=0), scale,
                                         return_attn_mass=return_attn_mass,
                                         max_seq_len=max_seq_len)
