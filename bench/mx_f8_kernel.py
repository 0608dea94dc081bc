"""A probe, not the library: few-row MXFP4 linear on FP8 tensor cores (bench/mx_f8_probe.py).

y [M, N] = x [M, K] @ dequantize(w).T with e2m1 weights, M <= 16, sm_90.

Every MX element format maps exactly into e4m3 by bit placement: e2m1 (and e2m3, e3m2) codes
have e4m3's subnormal structure with a smaller exponent bias, so a code's sign, exponent and
mantissa bits moved into an e4m3 byte (exponent field zero-extended) are its value times 2^-6
(2^-4 for e3m2), subnormals included. The weights are then an FP8 wgmma's register operand with
no multiply: ~5 integer ops a word of 8 FP4 codes (`_f8_tile`), where the bf16 decode
(mx_linear._mx_linear_decode_tc_kernel) spends ~11 and 4 mul.rn.bf16x2. The E8M0 scales cannot
ride on an FP8 operand (no FP8 arithmetic on the CUDA cores), so they go onto fp32 partial sums
of each 32-k block, and Triton waits for every such wgmma before its partial is read: one wait
a block (`TILE`), or one a step with the step's 4 blocks in 4 column groups of one k256 dot
(`STACK`, M <= 4, the fastest correct mode). `NO_SCALE` drops the scales (wrong values; the
time of the rest).

x must be FP8 too: `prepare_x` (its own launch) splits each row, scaled by a power of two so its
largest element is below 2^8, into hi + lo e4m3 parts (4 + 4 significant bits: a bf16 x exactly,
unless an element is under ~2^-10 of its row's largest), and the kernel runs both against the
same weight registers (`_dup`). `INKX` splits x in the kernel instead (a scale a row and block,
folded into the column factors): far slower, every program redoing it.

FP4 word layout (`prepare_weight`): word t (0..3) of a row's 32-block b holds in byte c the
elements k = 32b + 4t + c ("A": mantissa at bit 2, exponent 3-4, sign 7: in place for e4m3) and
k = 32b + 16 + 4t + c ("B": mantissa 0, exponent 1 and 6, sign 5: one shift left by 2 and one
right by 2). An A/B register of 4 bytes is then 4 consecutive k of one row, where a k32 wgmma's
register operand wants them; the bytes, split and joined back in order, compile to no data
movement. tile=64: [N / 64, K / 128, 64, 16] words, a row-step's word 4t + b (one load a step).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from mxserve.kernels.mx import MXTensor, _unpack_codes, get_format
from mxserve.kernels.mx_linear import _finish_decode, _word_offsets
from mxserve.kernels.triton_compat import interpreted_bf16

BLOCK = 32
X_HEADROOM = 7  # x's rows are scaled so their largest element is below 2^(X_HEADROOM + 1)


@dataclass(frozen=True)
class F8Weight:
    words: torch.Tensor  # int32 [N, K // 8]
    scales: torch.Tensor  # uint8 [N, K // 32]
    fmt: str
    shape: tuple[int, int]
    counters: torch.Tensor  # int32 split-K counters (zero between calls)
    nan_scales: bool  # some scale byte is 0xFF (NaN)
    tile: int = 0  # tile-major [N / tile, K / 128, tile, 16] words, word 4t + b of a row-step


def prepare_weight(w: MXTensor, tile: int = 0) -> F8Weight:
    if w.fmt != "e2m1" or len(w.shape) != 2 or w.shape[1] % BLOCK:
        raise ValueError("prepare_weight: an e2m1 MXTensor [N, K], K a multiple of 32")
    n, k = w.shape
    codes = _unpack_codes(w.data, get_format(w.fmt)).view(n, k // BLOCK, 2, 4, 4).long()
    a, b = codes[:, :, 0], codes[:, :, 1]  # [N, blocks, t, c]
    mag_a, sign_a = a & 7, a >> 3
    m_b, e_b, sign_b = b & 1, (b >> 1) & 3, b >> 3
    byte = (mag_a << 2) | (sign_a << 7) | m_b | ((e_b & 1) << 1) | ((e_b >> 1) << 6) | (sign_b << 5)
    word = (byte << (8 * torch.arange(4, device=byte.device))).sum(-1)  # [N, blocks, t]
    words = word.to(torch.int32).view(n, k // 8).contiguous()
    if tile:  # [N, K/128, b, t] -> [N/tile, K/128, tile, t, b]
        pad = -n % tile
        words = torch.cat([words, words.new_zeros(pad, k // 8)]) if pad else words
        words = words.view((n + pad) // tile, tile, k // 128, 4, 4).permute(0, 2, 1, 4, 3)
        words = words.contiguous().view(n + pad, k // 8)
    counters = torch.zeros(triton.cdiv(n, 8), dtype=torch.int32, device=words.device)
    nan_scales = bool((w.scales == 255).any()) if w.scales.numel() else False
    return F8Weight(words, w.scales.contiguous(), w.fmt, (n, k), counters, nan_scales, tile)


@triton.jit
def _round_e4m3(v):
    """fp32 v rounded (to nearest, ties even) to e4m3's 3 mantissa bits, in fp32: exactly an
    e4m3 value in e4m3's normal range, so the conversion after it does not round (the
    interpreter's conversion does not round to nearest)."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + (0x7FFFF + ((bits >> 20) & 1))) & -1048576  # 0xFFF00000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _x_split_kernel(x_ptr, out_ptr, scale_ptr, K, stride_xm, BLOCK_K: tl.constexpr,
                    HEADROOM: tl.constexpr):
    """One row of x -> e4m3 [K // 32, 64] (each block's hi, then lo) and its power-of-2 scale
    (x = (hi + lo) * scale)."""
    m = tl.program_id(0)
    amax = tl.zeros((BLOCK_K,), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(x_ptr + m * stride_xm + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    top = tl.max(amax, 0)
    # 2^e <= top < 2^(e + 1) (exponent bits; 0 for an all-zero row): scale = 2^(e - HEADROOM)
    e = ((top.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.where(top > 0, e - HEADROOM, 0)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)
    tl.store(scale_ptr + m, ((127 + e) << 23).to(tl.float32, bitcast=True))
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(x_ptr + m * stride_xm + offs, mask=offs < K, other=0.0).to(tl.float32) * inv
        hi = _round_e4m3(v)
        lo = _round_e4m3(v - hi)
        out = out_ptr + m * 2 * K + (offs // 32) * 64 + offs % 32
        tl.store(out, hi.to(tl.float8e4nv), mask=offs < K)
        tl.store(out + 32, lo.to(tl.float8e4nv), mask=offs < K)


def prepare_x(x2: torch.Tensor):
    m, k = x2.shape
    parts = torch.empty(m, k // 32, 64, dtype=torch.float8_e4m3fn, device=x2.device)
    scale = torch.empty(m, dtype=torch.float32, device=x2.device)
    _x_split_kernel[(m,)](x2, parts, scale, k, x2.stride(0),
                          BLOCK_K=min(4096, triton.next_power_of_2(k)), HEADROOM=X_HEADROOM)
    return parts, scale


@triton.jit
def _f8_tile(w):
    """e4m3 [BLOCK_N, 32] (k order) from the words [BLOCK_N, 4] of one 32-block (see above)."""
    ra = w & -1667457892  # 0x9C9C9C9C
    rb = ((w << 2) & -1936946036) | ((w >> 2) & 0x10101010)  # 0x8C8C8C8C
    # each register's bytes, joined back in order: the compiler keeps the register as it is
    ba = tl.join(tl.join(ra.to(tl.int8), (ra >> 16).to(tl.int8)),
                 tl.join((ra >> 8).to(tl.int8), (ra >> 24).to(tl.int8)))  # [BN, 4, 2, 2]
    bb = tl.join(tl.join(rb.to(tl.int8), (rb >> 16).to(tl.int8)),
                 tl.join((rb >> 8).to(tl.int8), (rb >> 24).to(tl.int8)))
    t = tl.permute(tl.join(ba, bb), (0, 4, 1, 2, 3))  # [BN, A/B, t, c >> 1, c & 1]
    return tl.reshape(t, (w.shape[0], 32)).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _block_factor(sw, B: tl.constexpr, NAN_SCALES: tl.constexpr):
    """fp32 2^(s - 127) * 2^6 of scale byte B of the int32 sw (a row's 4 blocks)."""
    s = (sw >> (8 * B)) & 0xFF
    f = ((s + 6) << 23).to(tl.float32, bitcast=True)
    if NAN_SCALES:
        f = tl.where(s == 255, float("nan"), f)
    return f


@triton.jit
def _dup(a):
    """[a, a] along k: the same registers against x's hi and lo parts."""
    return tl.reshape(tl.permute(tl.join(a, a), (0, 2, 1)), (a.shape[0], 2 * a.shape[1]))


@triton.jit
def _mx_linear_decode_f8_kernel(
    x_ptr, xscale_ptr, xb_ptr, words_ptr, scales_ptr, bias_ptr, out_ptr, partial_ptr,
    counter_ptr, M, N, num_words, split_k, words_per_split,
    stride_xm, stride_xbm, stride_wn, stride_sn, stride_om, stride_ps,
    NAN_SCALES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DUP: tl.constexpr, LAG: tl.constexpr, NO_SCALE: tl.constexpr, TILE: tl.constexpr,
    STACK: tl.constexpr, INKX: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
    INTERP_BF16: tl.constexpr,
):
    """x: [M, K // 32, 64] e4m3, each block's hi then lo parts (prepare_x); xb: x in bf16
    (INKX)."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1)
    offs_m = tl.arange(0, BLOCK_M)
    j_lo = pid_k * words_per_split
    j_hi = tl.minimum(j_lo + words_per_split, num_words)
    sw_ptrs = (scales_ptr + rows * stride_sn).to(tl.pointer_type(tl.int32), bitcast=True)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    tl.assume(j_lo < j_hi)
    if TILE:
        for j0 in range(j_lo, j_hi, 16):
            w16 = tl.load(words_ptr + _word_offsets(rows[:, None], (j0 + tl.arange(0, 16))[None, :],
                                                    num_words, stride_wn, TILE))
            e, o = tl.split(tl.reshape(w16, (BLOCK_N, 4, 2, 2)))  # [BN, t, b >> 1], b even/odd
            w0, w2 = tl.split(e)
            w1, w3 = tl.split(o)
            offs_k = (j0 // 4) * 64 + tl.arange(0, 64)
            xp = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None]
            xmask = offs_m[None, :] < M
            if STACK:  # M <= 4: block b's partials in columns 4b .. 4b + 3, one dot a step
                a = tl.reshape(tl.permute(tl.join(tl.join(_dup(_f8_tile(w0)), _dup(_f8_tile(w1))),
                                                  tl.join(_dup(_f8_tile(w2)), _dup(_f8_tile(w3)))),
                                          (0, 3, 2, 1)), (BLOCK_N, 256))
                kk = tl.arange(0, 256)
                cols = tl.arange(0, 16)
                if INKX:  # x (bf16 [M, K]) split here, a power-of-2 scale per row and block
                    m4 = tl.arange(0, 4)
                    k128 = tl.arange(0, 128)
                    xv = tl.load(xb_ptr + m4[:, None] * stride_xbm + j0 * 8 + k128[None, :],
                                 mask=m4[:, None] < M, other=0.0).to(tl.float32)
                    xv = tl.reshape(xv, (4, 4, 32))  # [m, b, k]
                    top = tl.max(tl.abs(xv), axis=2)
                    ex = ((top.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127 - 7
                    ex = tl.where(top > 0, ex, 0)  # [m, b]
                    v = xv * ((127 - ex) << 23).to(tl.float32, bitcast=True)[:, :, None]
                    hi = _round_e4m3(v)
                    lo = _round_e4m3(v - hi)
                    hl = tl.permute(tl.join(hi, lo), (1, 3, 2, 0))  # [b, part, k, m]
                    hl = tl.reshape(hl, (256, 4))
                    # block-diagonal: row k' of block k' // 64 in columns 4 (k' // 64) + m
                    diag = (kk // 64)[:, None, None] == tl.arange(0, 4)[None, :, None]
                    xt = tl.reshape(tl.where(diag, hl[:, None, :], 0.0),
                                    (256, 16)).to(tl.float8e4nv)
                    exc = tl.reshape(tl.permute(ex, (1, 0)), (16,))  # [b, m] -> column
                else:
                    xt = tl.load(x_ptr + (cols % 4)[None, :] * stride_xm + (j0 // 4) * 64
                                 + kk[:, None], mask=((kk // 64)[:, None] == (cols // 4)[None, :])
                                 & ((cols % 4)[None, :] < M), other=0.0)
                    exc = tl.zeros((16,), tl.int32)
                part = tl.dot(a, xt)
                sw = tl.load(sw_ptrs + j0 // 16)
                sb = (sw[:, None] >> (8 * (cols // 4))[None, :]) & 0xFF
                f = ((sb + 6 + exc[None, :]) << 23).to(tl.float32, bitcast=True)
                if NAN_SCALES:
                    f = tl.where(sb == 255, float("nan"), f)
                acc += part * f
            elif NO_SCALE:
                a = tl.reshape(tl.permute(tl.join(tl.join(_dup(_f8_tile(w0)), _dup(_f8_tile(w1))),
                                                  tl.join(_dup(_f8_tile(w2)), _dup(_f8_tile(w3)))),
                                          (0, 3, 2, 1)), (BLOCK_N, 256))
                offs_k4 = (j0 // 4) * 64 + tl.arange(0, 256)
                xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + offs_k4[:, None], mask=xmask,
                             other=0.0)
                acc = tl.dot(a, xt, acc)
            else:
                sw = tl.load(sw_ptrs + j0 // 16)
                # each block's partial is scaled after the next block's wgmma is issued
                p0 = tl.dot(_dup(_f8_tile(w0)), tl.load(xp, mask=xmask, other=0.0))
                p1 = tl.dot(_dup(_f8_tile(w1)), tl.load(xp + 64, mask=xmask, other=0.0))
                acc += p0 * _block_factor(sw, 0, NAN_SCALES)[:, None]
                p2 = tl.dot(_dup(_f8_tile(w2)), tl.load(xp + 128, mask=xmask, other=0.0))
                acc += p1 * _block_factor(sw, 1, NAN_SCALES)[:, None]
                p3 = tl.dot(_dup(_f8_tile(w3)), tl.load(xp + 192, mask=xmask, other=0.0))
                acc += p2 * _block_factor(sw, 2, NAN_SCALES)[:, None]
                acc += p3 * _block_factor(sw, 3, NAN_SCALES)[:, None]
    elif NO_SCALE:  # (bench: the time without the scales, one k256 dot a step; wrong values)
        for j0 in range(j_lo, j_hi, 16):
            a0 = _dup(_f8_tile(tl.load(words_ptr + rows[:, None] * stride_wn
                                       + (j0 + tl.arange(0, 4))[None, :])))
            a1 = _dup(_f8_tile(tl.load(words_ptr + rows[:, None] * stride_wn
                                       + (j0 + 4 + tl.arange(0, 4))[None, :])))
            a2 = _dup(_f8_tile(tl.load(words_ptr + rows[:, None] * stride_wn
                                       + (j0 + 8 + tl.arange(0, 4))[None, :])))
            a3 = _dup(_f8_tile(tl.load(words_ptr + rows[:, None] * stride_wn
                                       + (j0 + 12 + tl.arange(0, 4))[None, :])))
            a = tl.reshape(tl.permute(tl.join(tl.join(a0, a1), tl.join(a2, a3)), (0, 3, 2, 1)),
                           (BLOCK_N, 256))
            offs_k = (j0 // 4) * 64 + tl.arange(0, 256)
            xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None],
                         mask=offs_m[None, :] < M, other=0.0)
            acc = tl.dot(a, xt, acc)
    elif LAG:  # one block a step; a block's partial is scaled the step after its wgmma
        part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        f = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for j in range(j_lo, j_hi, 4):
            w = tl.load(words_ptr + rows[:, None] * stride_wn + (j + tl.arange(0, 4))[None, :])
            s = tl.load(scales_ptr + rows * stride_sn + j // 4).to(tl.int32)
            a = _f8_tile(w)
            a2 = tl.reshape(tl.permute(tl.join(a, a), (0, 2, 1)), (BLOCK_N, 64))
            offs_k = (j // 4) * 64 + tl.arange(0, 64)
            xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None],
                         mask=offs_m[None, :] < M, other=0.0)
            new = tl.dot(a2, xt)
            acc += part * f[:, None]
            part = new
            f = ((s + 6) << 23).to(tl.float32, bitcast=True)  # 2^(s - 127) * 2^6
            if NAN_SCALES:
                f = tl.where(s == 255, float("nan"), f)
        acc += part * f[:, None]
    else:
        for j0 in range(j_lo, j_hi, 16):  # 4 blocks a step: one int32 of scale bytes a row
            sw = tl.load(sw_ptrs + j0 // 16)
            for bb in tl.static_range(4):
                j = j0 + 4 * bb
                w = tl.load(words_ptr + rows[:, None] * stride_wn + (j + tl.arange(0, 4))[None, :])
                a = _f8_tile(w)
                if DUP:  # [a, a] against [hi; lo]: one k64 wgmma chain
                    a2 = tl.reshape(tl.permute(tl.join(a, a), (0, 2, 1)), (BLOCK_N, 64))
                    offs_k = (j // 4) * 64 + tl.arange(0, 64)
                    xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None],
                                 mask=offs_m[None, :] < M, other=0.0)
                    part = tl.dot(a2, xt)
                else:
                    offs_k = (j // 4) * 64 + tl.arange(0, 32)
                    xp = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None]
                    xh = tl.load(xp, mask=offs_m[None, :] < M, other=0.0)
                    xl = tl.load(xp + 32, mask=offs_m[None, :] < M, other=0.0)
                    part = tl.dot(a, xl, tl.dot(a, xh))
                s = (sw >> (8 * bb)) & 0xFF
                f = ((s + 6) << 23).to(tl.float32, bitcast=True)  # 2^(s - 127) * 2^6
                if NAN_SCALES:
                    f = tl.where(s == 255, float("nan"), f)
                acc += part * f[:, None]
    if STACK:
        acc4 = tl.sum(tl.reshape(acc, (BLOCK_N, 4, 4)), axis=1)
        offs_m4 = tl.arange(0, 4)
        if not INKX:
            acc4 = acc4 * tl.load(xscale_ptr + offs_m4, mask=offs_m4 < M, other=0.0)[None, :]
        _finish_decode(tl.trans(acc4), offs_m4, offs_n, pid_k, pid_n, M, N, split_k, bias_ptr,
                       out_ptr, partial_ptr, counter_ptr, stride_om, stride_ps, SPLIT, HAS_BIAS,
                       INTERP_BF16)
        return
    xs = tl.load(xscale_ptr + offs_m, mask=offs_m < M, other=0.0)
    acc = acc * xs[None, :]
    _finish_decode(tl.trans(acc), offs_m, offs_n, pid_k, pid_n, M, N, split_k, bias_ptr, out_ptr,
                   partial_ptr, counter_ptr, stride_om, stride_ps, SPLIT, HAS_BIAS, INTERP_BF16)


def mx_linear_f8(x: torch.Tensor, w: F8Weight, bias=None, block_n=128, num_warps=4,
                 num_stages=3, programs_per_sm=4, dup=True, lag=False, no_scale=False,
                 stack=False, inkx=False, block_m=None, split_k=None, x_parts=None):
    """The modes: see the module docstring (dup: x's parts against the duplicated weight
    registers, one k64 dot a block; lag: a block's partial scaled a step later, one block a
    step)."""
    n, k = w.shape
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if inkx:
        parts, xscale = x2, x2
    else:
        parts, xscale = x_parts if x_parts is not None else prepare_x(x2)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(n, block_n)
    groups = k // (BLOCK * 4)
    if split_k is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count \
            if x.is_cuda else 1
        split_k = max(1, min(programs_per_sm * sms // tiles, groups))
    split_k = triton.cdiv(groups, triton.cdiv(groups, split_k))
    words_per_split = triton.cdiv(groups, split_k) * 16
    counters = w.counters if w.counters.numel() >= tiles else \
        torch.zeros(tiles, dtype=torch.int32, device=x.device)
    partial = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device) \
        if split_k > 1 else out
    launch = dict(num_warps=num_warps, num_stages=num_stages) if x.is_cuda else {}
    _mx_linear_decode_f8_kernel[(tiles, split_k)](
        parts, xscale, x2, w.words, w.scales, bias if bias is not None else w.scales, out, partial,
        counters, m, n, k // 8, split_k, words_per_split,
        parts.stride(0), x2.stride(0), w.words.stride(0), w.scales.stride(0), out.stride(0),
        partial.stride(0) if split_k > 1 else 0,
        NAN_SCALES=w.nan_scales, BLOCK_M=block_m or max(16, triton.next_power_of_2(m)),
        BLOCK_N=block_n, DUP=dup, LAG=lag, NO_SCALE=no_scale, TILE=w.tile, STACK=stack,
        INKX=inkx, SPLIT=split_k > 1, HAS_BIAS=bias is not None,
        INTERP_BF16=interpreted_bf16(x.dtype, x), **launch)
    return out.view(*x.shape[:-1], n)
