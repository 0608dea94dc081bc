"""Triton helpers of the FMA and tl.dot MX kernels (decode at other than bf16, prefill,
dequantize): a [BLOCK_N, BLOCK_K] tile of a weight's words turned into values by bit placement
and one scale multiply (`weight_tile`, `build_tile`), and the two tl.dot forms that multiply
it."""

from __future__ import annotations

from .mx_layout import HIGH_BITS, LOW_SLOTS
from .triton_compat import round_bf16, tl, to_f32, triton


def _nibbles(values: tuple[int, ...]) -> tl.constexpr:
    """values[u] in nibble u of one integer: mx_layout's tables as the kernels read them."""
    return tl.constexpr(sum(v << (4 * u) for u, v in enumerate(values)))


# placed_bits' view of the tables: e2m1 and e2m3 (EBITS 2) share theirs, e3m2 (EBITS 3)
_MAG_E2, _SIGN_E2 = (_nibbles(t) for t in HIGH_BITS["e2m3"])
_MAG_E3, _SIGN_E3 = (_nibbles(t) for t in HIGH_BITS["e3m2"])
_LOW = _nibbles(LOW_SLOTS)


@triton.jit
def _shl(v, D: tl.constexpr):
    """v << D, or v >> -D for negative D (arithmetic; callers mask the bits they keep)."""
    if D >= 0:
        return v << D
    else:
        return v >> (-D)


@triton.jit
def placed_bits(w0, w1, w2, T: tl.constexpr, EBITS: tl.constexpr, MBITS: tl.constexpr,
                 NAN_CODE: tl.constexpr, E: tl.constexpr, F: tl.constexpr, PAIR: tl.constexpr):
    """int32 bits of element T of each word group (see PLANES) as a float with F mantissa bits
    (7: bf16 in the low half, 23: fp32) whose value is the element's / 2^(127 - bias). PAIR
    (F = 7): elements T and T + 1 at once, T + 1 in the high half (a bf16x2 word)."""
    MS: tl.constexpr = F - MBITS  # where the code's mantissa LSB goes
    S: tl.constexpr = 2 * F + 1 if F == 7 else 31  # sign bit: 15 or 31
    SIGN: tl.constexpr = (1 << S) if S < 31 else -2147483648
    MAG: tl.constexpr = (1 << (EBITS + MBITS)) - 1
    U: tl.constexpr = T // 2
    H16: tl.constexpr = 16 * (T % 2)  # bit offset of element T's half
    REP: tl.constexpr = 0x10001 if PAIR else 1  # a mask for both halves
    SIGNS: tl.constexpr = -2147450880 if PAIR else SIGN  # 0x80008000
    # pair U's bits in HIGH_BITS / LOW_SLOTS
    MAGS: tl.constexpr = _MAG_E3 if EBITS == 3 else _MAG_E2
    SIGNS_AT: tl.constexpr = _SIGN_E3 if EBITS == 3 else _SIGN_E2
    MPOS: tl.constexpr = ((MAGS >> (4 * (U % 4))) & 15) + H16
    SPOS: tl.constexpr = ((SIGNS_AT >> (4 * (U % 4))) & 15) + H16
    if E == 16:  # FP6: top 3 magnitude bits and sign, then the 2 low bits (plane 2)
        LPOS: tl.constexpr = 2 * ((_LOW >> (4 * U)) & 15) + H16
        if U < 4:
            h = w0
        else:
            h = w1
        bits = (_shl(h, MS + 2 - MPOS) & ((7 << (MS + 2)) * REP)) | (_shl(h, S - SPOS) & SIGNS) \
            | (_shl(w2, MS - LPOS) & ((3 << MS) * REP))
    elif EBITS + MBITS == 3:  # FP4
        bits = (_shl(w0, MS - MPOS) & ((MAG << MS) * REP)) | (_shl(w0, S - SPOS) & SIGNS)
    else:
        BITS: tl.constexpr = 1 + EBITS + MBITS
        POS: tl.constexpr = BITS * (U % (16 // BITS)) + H16
        if U < 16 // BITS:
            w = w0
        else:
            w = w1
        bits = (_shl(w, MS - POS) & ((MAG << MS) * REP)) | (_shl(w, S - POS - BITS + 1) & SIGNS)
    if NAN_CODE >= 0:  # e4m3: magnitude 0x7F is NaN (not with PAIR)
        NAN_BITS: tl.constexpr = 0x7FC0 if F == 7 else 0x7FC00000
        bits = tl.where((bits & (MAG << MS)) == (MAG << MS), NAN_BITS, bits)
    return bits


@triton.jit
def _bits_to_float(bits, F: tl.constexpr):
    if F == 7:
        return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return bits.to(tl.float32, bitcast=True)


@triton.jit
def _scale_factors(s, F: tl.constexpr, BIAS: tl.constexpr, FOLD: tl.constexpr):
    """(f1, f2) with element = placed * f1 (* f2 unless FOLD), from int32 E8M0 bytes s. FOLD:
    f1 = 2^(s - bias), needs s <= 127 + bias. 0xFF -> NaN, byte 0 -> 2^-127 (subnormal)."""
    NAN_BITS: tl.constexpr = 0x7FC0 if F == 7 else 0x7FC00000
    if FOLD:
        f1 = _bits_to_float(tl.where(s == 255, NAN_BITS, (s + (127 - BIAS)) << F), F)
        f2 = f1
    else:
        f1 = _bits_to_float(tl.full(s.shape, (254 - BIAS) << F, tl.int32), F)  # 2^(127-bias)
        f2 = _bits_to_float(tl.where(s == 255, NAN_BITS,
                                     tl.where(s == 0, 1 << (F - 1), s << F)), F)
    return f1, f2


@triton.jit
def _element(w0, w1, w2, f1, f2, T: tl.constexpr, EBITS: tl.constexpr, MBITS: tl.constexpr,
             NAN_CODE: tl.constexpr, E: tl.constexpr, FOLD: tl.constexpr, F: tl.constexpr):
    """Dequantized element T of each word group, in the float type of F."""
    v = _bits_to_float(placed_bits(w0, w1, w2, T, EBITS, MBITS, NAN_CODE, E, F, False), F) * f1
    if not FOLD:
        v = v * f2
    return v


@triton.jit
def _pair(w0, w1, w2, f1, f2, U: tl.constexpr, EBITS: tl.constexpr, MBITS: tl.constexpr,
          E: tl.constexpr, FOLD: tl.constexpr):
    """bf16 elements 2U and 2U + 1 of each word group, decoded from one bf16x2 bit pattern."""
    bits = placed_bits(w0, w1, w2, 2 * U, EBITS, MBITS, -1, E, 7, True)
    lo = bits.to(tl.int16).to(tl.bfloat16, bitcast=True) * f1
    hi = (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True) * f1
    if not FOLD:
        lo = lo * f2
        hi = hi * f2
    return lo, hi


@triton.jit
def word_offsets(rows, j, num_words, stride_wn, TILE: tl.constexpr):
    """Offsets in a plane of words j of rows: row-major (TILE 0), or tile-major (TILE_ROWS)."""
    if TILE == 0:
        return rows * stride_wn + j
    else:
        return ((rows // TILE) * num_words + (j // 16) * 16) * TILE + (rows % TILE) * 16 + j % 16


@triton.jit
def load_groups(planes_ptr, offs_n, j0, N, num_words, stride_plane, stride_wn,
                 P: tl.constexpr, G: tl.constexpr, TILE: tl.constexpr = 0):
    """Words [*offs_n.shape, G] of word groups j0..j0+G of rows offs_n < N (0 elsewhere;
    num_words = K // E)."""
    j = j0 + tl.arange(0, G)
    rows = tl.expand_dims(offs_n, -1)
    mask = (rows < N) & (j < num_words)
    ptrs = planes_ptr + word_offsets(rows, j, num_words, stride_wn, TILE)
    w0 = tl.load(ptrs, mask=mask, other=0)
    w1 = w0
    w2 = w0
    if P > 1:
        w1 = tl.load(ptrs + stride_plane, mask=mask, other=0)
    if P > 2:
        w2 = tl.load(ptrs + 2 * stride_plane, mask=mask, other=0)
    return w0, w1, w2


@triton.jit
def _pair_scales(scales_ptr, offs_n, j0, N, num_words, stride_sn, U: tl.constexpr,
                 E: tl.constexpr, S: tl.constexpr, G: tl.constexpr):
    """int32 scale bytes [BLOCK_N, G] of pair U of word groups j0..j0+G (see PLANES: one block
    per pair and spread group)."""
    j = j0 + tl.arange(0, G)
    blk = (E * S * (j // S) + 2 * S * U) // 32
    mask = (offs_n[:, None] < N) & (j[None, :] < num_words)
    return tl.load(scales_ptr + offs_n[:, None] * stride_sn + blk[None, :], mask=mask,
                   other=127).to(tl.int32)


@triton.jit
def weight_tile(planes_ptr, scales_ptr, offs_n, j0, N, num_words, stride_plane, stride_wn,
                 stride_sn, EBITS: tl.constexpr, MBITS: tl.constexpr, NAN_CODE: tl.constexpr,
                 E: tl.constexpr, P: tl.constexpr, S: tl.constexpr, FOLD: tl.constexpr,
                 F: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 TILE: tl.constexpr = 0):
    """Dequantized w[offs_n, E*j0 : E*j0 + BLOCK_K] [BLOCK_N, BLOCK_K] in bf16 (F = 7) or fp32
    (F = 23); 0 outside N, K. (Word index j0, not k: Triton then sees its divisibility and
    issues 16-byte loads.) BLOCK_K is a multiple of E * S."""
    w0, w1, w2 = load_groups(planes_ptr, offs_n, j0, N, num_words, stride_plane, stride_wn, P,
                              BLOCK_K // E, TILE)
    return build_tile(w0, w1, w2, scales_ptr, offs_n, j0, N, num_words, stride_sn, EBITS, MBITS,
                       NAN_CODE, E, S, FOLD, F, BLOCK_N, BLOCK_K)


@triton.jit
def _decoded_pair(w0, w1, w2, scales_ptr, offs_n, j0, N, num_words, stride_sn, U: tl.constexpr,
                  EBITS: tl.constexpr, MBITS: tl.constexpr, NAN_CODE: tl.constexpr,
                  E: tl.constexpr, S: tl.constexpr, FOLD: tl.constexpr, F: tl.constexpr):
    """[BLOCK_N, G, 2]: elements 2U and 2U + 1 of each word group, dequantized."""
    BIAS: tl.constexpr = (1 << (EBITS - 1)) - 1
    s = _pair_scales(scales_ptr, offs_n, j0, N, num_words, stride_sn, U, E, S, w0.shape[1])
    f1, f2 = _scale_factors(s, F, BIAS, FOLD)
    if F == 7 and NAN_CODE < 0:  # one bf16x2 bit pattern for both
        lo, hi = _pair(w0, w1, w2, f1, f2, U, EBITS, MBITS, E, FOLD)
    else:
        lo = _element(w0, w1, w2, f1, f2, 2 * U, EBITS, MBITS, NAN_CODE, E, FOLD, F)
        hi = _element(w0, w1, w2, f1, f2, 2 * U + 1, EBITS, MBITS, NAN_CODE, E, FOLD, F)
    return tl.join(lo, hi)


@triton.jit
def spread_tile4(p0, p1, p2, p3, S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Pairs u = 0..3 [BLOCK_N, G, 2] (element 2u + h of word j at [j, h]) -> [BLOCK_N, BLOCK_K]
    in natural k order: k = 8*S*t + 2*S*u + 2*jj + h for word j = S*t + jj (see PLANES)."""
    w = tl.join(tl.join(p0, p1), tl.join(p2, p3))  # [BN, G, h, u & 1, u >> 1]
    if BLOCK_K == 8 * S:  # one group (no size-1 dim: Triton then keeps the tile in registers)
        w = tl.reshape(tl.permute(w, (0, 4, 3, 1, 2)), (BLOCK_N, BLOCK_K))
    else:
        w = tl.reshape(w, (BLOCK_N, BLOCK_K // (8 * S), S, 2, 2, 2))
        w = tl.reshape(tl.permute(w, (0, 1, 5, 4, 2, 3)), (BLOCK_N, BLOCK_K))
    return w


@triton.jit
def spread_tile8(p0, p1, p2, p3, p4, p5, p6, p7, S: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """spread_tile4 for 8 pairs (E = 16)."""
    w = tl.join(tl.join(tl.join(p0, p1), tl.join(p2, p3)),
                tl.join(tl.join(p4, p5), tl.join(p6, p7)))  # [BN, G, h, u0, u1, u2]
    if BLOCK_K == 16 * S:
        w = tl.reshape(tl.permute(w, (0, 5, 4, 3, 1, 2)), (BLOCK_N, BLOCK_K))
    else:
        w = tl.reshape(w, (BLOCK_N, BLOCK_K // (16 * S), S, 2, 2, 2, 2))
        w = tl.reshape(tl.permute(w, (0, 1, 6, 5, 4, 2, 3)), (BLOCK_N, BLOCK_K))
    return w


@triton.jit
def build_tile(w0, w1, w2, scales_ptr, offs_n, j0, N, num_words, stride_sn,
                EBITS: tl.constexpr, MBITS: tl.constexpr, NAN_CODE: tl.constexpr,
                E: tl.constexpr, S: tl.constexpr, FOLD: tl.constexpr, F: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] tile of loaded words (load_groups), natural k order; the scale
    bytes are read here, one per pair."""
    p0 = _decoded_pair(w0, w1, w2, scales_ptr, offs_n, j0, N, num_words, stride_sn, 0, EBITS,
                       MBITS, NAN_CODE, E, S, FOLD, F)
    p1 = _decoded_pair(w0, w1, w2, scales_ptr, offs_n, j0, N, num_words, stride_sn, 1, EBITS,
                       MBITS, NAN_CODE, E, S, FOLD, F)
    p2 = _decoded_pair(w0, w1, w2, scales_ptr, offs_n, j0, N, num_words, stride_sn, 2, EBITS,
                       MBITS, NAN_CODE, E, S, FOLD, F)
    p3 = _decoded_pair(w0, w1, w2, scales_ptr, offs_n, j0, N, num_words, stride_sn, 3, EBITS,
                       MBITS, NAN_CODE, E, S, FOLD, F)
    if E == 8:  # (if / else, not an early return: Triton compiles what follows a return)
        w = spread_tile4(p0, p1, p2, p3, S, BLOCK_N, BLOCK_K)
    else:
        p4 = _decoded_pair(w0, w1, w2, scales_ptr, offs_n, j0, N, num_words, stride_sn, 4,
                           EBITS, MBITS, NAN_CODE, E, S, FOLD, F)
        p5 = _decoded_pair(w0, w1, w2, scales_ptr, offs_n, j0, N, num_words, stride_sn, 5,
                           EBITS, MBITS, NAN_CODE, E, S, FOLD, F)
        p6 = _decoded_pair(w0, w1, w2, scales_ptr, offs_n, j0, N, num_words, stride_sn, 6,
                           EBITS, MBITS, NAN_CODE, E, S, FOLD, F)
        p7 = _decoded_pair(w0, w1, w2, scales_ptr, offs_n, j0, N, num_words, stride_sn, 7,
                           EBITS, MBITS, NAN_CODE, E, S, FOLD, F)
        w = spread_tile8(p0, p1, p2, p3, p4, p5, p6, p7, S, BLOCK_N, BLOCK_K)
    return w


@triton.jit
def dot_w_xt(w, x, acc, INTERP_BF16: tl.constexpr):
    """acc + w @ x.T (the transposed product: the dequantized weights are the left operand, which
    Hopper's wgmma reads from registers), with w rounded to x's dtype; see dot_wt."""
    if INTERP_BF16:
        return tl.dot(round_bf16(w.to(tl.float32)), tl.trans(to_f32(x, INTERP_BF16)), acc,
                      input_precision="ieee")
    return tl.dot(w.to(x.dtype), tl.trans(x), acc, input_precision="ieee")


@triton.jit
def dot_wt(x, w, acc, INTERP_BF16: tl.constexpr):
    """acc + x @ w.T with w rounded to x's dtype. INTERP_BF16 (the interpreter's bf16 tl.dot is
    wrong, its casts truncate): the same rounded operands multiplied in fp32, exact for bf16."""
    if INTERP_BF16:
        wt = tl.trans(round_bf16(w.to(tl.float32)))
        return tl.dot(to_f32(x, INTERP_BF16), wt, acc, input_precision="ieee")
    return tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision="ieee")
