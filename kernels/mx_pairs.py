"""The tensor-core decode's weight decode: a spread group of 16 word groups decoded pair by
pair to bf16x2 bits (one mul.rn.bf16x2 applies the scale) in the registers that load it, and
joined into wgmma's register operand with no data exchange (`tc_step`); and the whole-row form
kernels/gemv.py multiplies on the CUDA cores (`row_words`, `tc_pairs`)."""

from __future__ import annotations

from .mx_tiles import load_groups, placed_bits, spread_tile4, spread_tile8, word_offsets
from .triton_compat import tl, to_f32, triton


@triton.jit
def _bf16x2_mul(bits, f, INTERP: tl.constexpr):
    """(lo, hi) bf16 halves of the bf16x2 product bits * f (int32 bit patterns, f the same in
    both halves): one mul.rn.bf16x2 on a GPU; the interpreter (no inline asm) multiplies each
    half exactly in fp32 (the products are exact bf16 values)."""
    if INTERP:
        fl = (f << 16).to(tl.float32, bitcast=True)
        lo = (bits << 16).to(tl.float32, bitcast=True) * fl
        hi = (bits & -65536).to(tl.float32, bitcast=True) * fl
        lo = (lo.to(tl.int32, bitcast=True) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        hi = (hi.to(tl.int32, bitcast=True) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        return lo, hi
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t; mul.rn.bf16x2 t, $2, $3; mov.b32 {$0, $1}, t; }", "=h,=h,r,r",
            [bits, f], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)


@triton.jit
def _bf16x2_mul_bits(bits, f, INTERP: tl.constexpr):
    """The bf16x2 bit pattern (int32) of bits * f, as _bf16x2_mul."""
    if INTERP:
        lo, hi = _bf16x2_mul(bits, f, True)
        return _bf16x2_bits(lo, hi)
    else:
        return tl.inline_asm_elementwise("mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [bits, f],
                                         dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _tc_pair(w0, w1, w2, sw, U: tl.constexpr, EBITS: tl.constexpr, MBITS: tl.constexpr,
             E: tl.constexpr, FOLD: tl.constexpr, NAN_SCALES: tl.constexpr,
             INTERP: tl.constexpr, F32: tl.constexpr = False):
    """[..., 2] bf16 (F32: the same values in fp32): pair U of each word group (words [...]);
    sw int32, broadcastable to the words, holds the scale bytes of pairs 4 (U // 4) ..
    4 (U // 4) + 3 (one block each, see PLANES). NAN_SCALES: some byte may be 0xFF (NaN);
    without it the factor is one multiply-add of the byte."""
    BIAS: tl.constexpr = (1 << (EBITS - 1)) - 1
    s = (sw >> (8 * (U % 4))) & 0xFF
    if FOLD:  # one factor, 2^(s - bias) (see _scale_factors)
        first = (s + (127 - BIAS)) << 7
        if NAN_SCALES:
            first = tl.where(s == 255, 0x7FC0, first)
        first = first * 65537
    else:  # 2^(127 - bias), then 2^(s - 127)
        first = ((254 - BIAS) << 7) * 65537 + 0 * s
        second = tl.where(s == 0, 1 << 6, s << 7)
        if NAN_SCALES:
            second = tl.where(s == 255, 0x7FC0, second)
        second = second * 65537
    bits = placed_bits(w0, w1, w2, 2 * U, EBITS, MBITS, -1, E, 7, True)
    if F32:  # the product's bf16x2 bits, each half widened by one integer op
        p = _bf16x2_mul_bits(bits, first, INTERP)
        if not FOLD:
            p = _bf16x2_mul_bits(p, second, INTERP)
        out = tl.join((p << 16).to(tl.float32, bitcast=True),
                      (p & -65536).to(tl.float32, bitcast=True))
    else:
        if FOLD:
            lo, hi = _bf16x2_mul(bits, first, INTERP)
        else:
            lo, hi = _bf16x2_mul(_bf16x2_mul_bits(bits, first, INTERP), second, INTERP)
        out = tl.join(lo, hi)
    return out


@triton.jit
def tc_pairs(w0, w1, w2, sa, sb, EBITS: tl.constexpr, MBITS: tl.constexpr, E: tl.constexpr,
              FOLD: tl.constexpr, NAN_SCALES: tl.constexpr, INTERP: tl.constexpr,
              F32: tl.constexpr = False):
    """Pairs 0..E/2-1 of each word group (_tc_pair; sa holds pairs 0..3's scale bytes, sb
    4..7's), as 8 results: E = 8 repeats the first four."""
    p0 = _tc_pair(w0, w1, w2, sa, 0, EBITS, MBITS, E, FOLD, NAN_SCALES, INTERP, F32)
    p1 = _tc_pair(w0, w1, w2, sa, 1, EBITS, MBITS, E, FOLD, NAN_SCALES, INTERP, F32)
    p2 = _tc_pair(w0, w1, w2, sa, 2, EBITS, MBITS, E, FOLD, NAN_SCALES, INTERP, F32)
    p3 = _tc_pair(w0, w1, w2, sa, 3, EBITS, MBITS, E, FOLD, NAN_SCALES, INTERP, F32)
    p4, p5, p6, p7 = p0, p1, p2, p3
    if E == 16:
        p4 = _tc_pair(w0, w1, w2, sb, 4, EBITS, MBITS, E, FOLD, NAN_SCALES, INTERP, F32)
        p5 = _tc_pair(w0, w1, w2, sb, 5, EBITS, MBITS, E, FOLD, NAN_SCALES, INTERP, F32)
        p6 = _tc_pair(w0, w1, w2, sb, 6, EBITS, MBITS, E, FOLD, NAN_SCALES, INTERP, F32)
        p7 = _tc_pair(w0, w1, w2, sb, 7, EBITS, MBITS, E, FOLD, NAN_SCALES, INTERP, F32)
    return p0, p1, p2, p3, p4, p5, p6, p7


@triton.jit
def _decoded_groups(w0, w1, w2, sa, sb, EBITS: tl.constexpr, MBITS: tl.constexpr,
                    E: tl.constexpr, FOLD: tl.constexpr, NAN_SCALES: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERP: tl.constexpr):
    """bf16 [BLOCK_N, BLOCK_K] in natural k order from the words
    [BLOCK_N, BLOCK_K // E] of whole spread groups of 16 (each pair decoded in the registers
    that hold its words, joined with no data exchange: spread_tile4/8); sa, sb: the groups'
    scale words (tc_scales), broadcastable to the words."""
    p0, p1, p2, p3, p4, p5, p6, p7 = tc_pairs(w0, w1, w2, sa, sb, EBITS, MBITS, E, FOLD,
                                               NAN_SCALES, INTERP)
    if E == 8:
        w = spread_tile4(p0, p1, p2, p3, 16, BLOCK_N, BLOCK_K)
    else:
        w = spread_tile8(p0, p1, p2, p3, p4, p5, p6, p7, 16, BLOCK_N, BLOCK_K)
    return w


@triton.jit
def row_words(planes_ptr, scales_ptr, rows, N, num_words, stride_plane, stride_wn, stride_sn,
               E: tl.constexpr, P: tl.constexpr, BLOCK_K: tl.constexpr, TILE: tl.constexpr = 0):
    """(w0, w1, w2, sa, sb): the words [*rows.shape, BLOCK_K // E] of whole rows (0 past K =
    E * num_words) of a weight in spread groups of 16, and the scale words of each word's group
    (tc_scales, one per word), for kernels that hold whole rows (kernels/gemv.py): every
    load at once. rows < N; decode with tc_pairs."""
    G: tl.constexpr = BLOCK_K // E  # words a row (BLOCK_K a power of 2 >= E * 16)
    whole = (num_words // 16) * 16  # (= num_words; so written, the loads are 16-byte vectors)
    w0, w1, w2 = load_groups(planes_ptr, rows, 0, N, whole, stride_plane, stride_wn, P, G, TILE)
    j = tl.arange(0, G)
    mask = j < whole
    blk = (E * 16 * (j // 16)) // 128  # int32 word of the group's first scale byte
    sw = tl.expand_dims((scales_ptr + rows * stride_sn).to(tl.pointer_type(tl.int32),
                                                          bitcast=True), -1)
    sa = tl.load(sw + blk, mask=mask, other=0)
    sb = sa
    if E == 16:
        sb = tl.load(sw + blk + 1, mask=mask, other=0)
    return w0, w1, w2, sa, sb


@triton.jit
def _bf16x2_bits(lo, hi):
    return (lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) | \
        (hi.to(tl.int16, bitcast=True).to(tl.int32) << 16)


@triton.jit
def tc_words(planes_ptr, rows, j0, num_words, stride_plane, stride_wn, P: tl.constexpr,
              TILE: tl.constexpr):
    """Words [BLOCK_N, 16] of the spread group at word group j0, rows `rows` (in range: the
    caller clamps them, so no load needs a mask)."""
    ptrs = planes_ptr + word_offsets(rows[:, None], (j0 + tl.arange(0, 16))[None, :], num_words,
                                      stride_wn, TILE)
    w0 = tl.load(ptrs)
    w1 = w0
    w2 = w0
    if P > 1:
        w1 = tl.load(ptrs + stride_plane)
    if P > 2:
        w2 = tl.load(ptrs + 2 * stride_plane)
    return w0, w1, w2


@triton.jit
def tc_scales(sw_ptrs, j0, E: tl.constexpr):
    """The scale words (4 bytes each, [BLOCK_N]) of the spread group at word group j0: pairs
    0..3 and (E = 16) 4..7. sw_ptrs: int32 pointers to the rows' scales (clamped rows)."""
    blk = (E * j0) // 128  # int32 word of the group's first scale byte
    sa = tl.load(sw_ptrs + blk)
    sb = sa
    if E == 16:
        sb = tl.load(sw_ptrs + blk + 1)
    return sa, sb


@triton.jit
def tc_step(acc, w0, w1, w2, sa, sb, x_ptr, offs_m, j0, M, stride_xm,
             EBITS: tl.constexpr, MBITS: tl.constexpr, E: tl.constexpr, FOLD: tl.constexpr,
             NAN_SCALES: tl.constexpr, BLOCK_N: tl.constexpr, INTERP_BF16: tl.constexpr):
    """acc + w @ x.T over the spread group of word groups j0..j0+16; sa, sb its scale words
    (tc_scales)."""
    S: tl.constexpr = 16
    BLOCK_K: tl.constexpr = E * S
    w = _decoded_groups(w0, w1, w2, sa[:, None], sb[:, None], EBITS, MBITS, E, FOLD, NAN_SCALES,
                        BLOCK_N, BLOCK_K, INTERP_BF16)
    offs_k = j0 * E + tl.arange(0, BLOCK_K)
    xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None],
                 mask=offs_m[None, :] < M, other=0.0)  # [BLOCK_K, BLOCK_M]
    if INTERP_BF16:
        acc = tl.dot(to_f32(w, True), to_f32(xt, True), acc, input_precision="ieee")
    else:
        acc = tl.dot(w, xt, acc)
    return acc
