"""Weight-only MX linear: y = x @ dequantize(w).T + bias, activations fp32/bf16/fp16.

Weights live in the kernels' layout (`prepare_mx_weight`, once, at load): int32 word planes
[P, N, K // E], each word group holding E elements of a row (spread over k, see PLANES), stored
tile-major in 64-row tiles where the spread groups are 16 words (TILE_ROWS); every weight load
is a contiguous 16-byte vector. One tile builder (`weight_tile`) turns words into
values by bit placement: the code's sign, exponent and mantissa bits are moved straight into a
bf16 (or fp32) bit pattern, and one multiply by 2^(scale - bias) fixes the exponent bias and
applies the E8M0 scale at once (an element with exponent 0 lands on a subnormal of the target,
which that multiply scales exactly). Where a block's 2^(scale - bias) would overflow the target
(scale bytes above 127 + bias, checked at prepare) a second multiply splits it ("fold" off).

- decode (M <= 64 on a GPU), bf16 x, K a multiple of E * 16, not e4m3:
  `_mx_linear_decode_tc_kernel`, tensor cores for every M (x padded to 16, 32 or 64 rows, so
  each weight is decoded once for all rows); 3 pipeline stages. Per step one spread group (see
  PLANES) is decoded pair by pair (bf16x2 bits, one mul.rn.bf16x2 for the scale) in the
  registers that hold it and joined into wgmma's register operand without data exchange.
- decode otherwise (other x dtypes, e4m3, short K; the default on CPU): grid (N tiles, K
  splits); the next tile's words are loaded before the current one is decoded. M = 1 uses
  fp32 FMAs on a [BLOCK_N, BLOCK_K] tile (no tensor cores, no padding), M >= 2 dequantizes the
  tile to x's dtype and feeds tl.dot with BLOCK_M = 16 (rows past M masked). Both decode
  kernels reduce split-K partials in the same launch: the last program of a tile to finish (an
  atomic counter) sums them in fixed order (deterministic), adds the bias, writes y and re-arms
  the counter.
- prefill (M > 16, or > 64 where the tensor-core decode applies): on a GPU with 16-bit x the
  weight is dequantized once per call to x's dtype (one pass, `dequantize_linear_weight`) and
  cuBLAS runs the product: on the H200 that beats the fused kernel at large M and nearly ties
  it at M = 64 (bench/results/kernels_gpu.tune3.json).
  The fused kernel (grouped output tiles, dequantized tiles into tl.dot, computed transposed so
  the weights are wgmma's register operand) serves fp32 x and path="prefill", where a
  tl.dot_scaled variant (FP4/FP8 weights, 16-bit x) is used if the hardware has native MX MMA
  (sm_100+).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .mx import MXTensor, dequantize_mx_torch, get_format, pack_codes, unpack_codes
from .triton_compat import cast_out, interpreted_bf16, round_bf16, tl, to_f32, triton
from .triton_compat import use_triton as _use_triton

ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DECODE_MAX_M = 16
TC_DECODE_MAX_M = 64  # the tensor-core decode (bf16 x on a GPU) serves up to this many rows
PREFILL_DEQUANT_MIN_M = DECODE_MAX_M + 1

# The kernels' layout: word groups of E elements of a row, in P int32 planes [P, N, K // E].
# Element e = 2u + h of a group sits in the half h of its word(s) (bit 16h up), so the two
# elements of a pair (2u, 2u + 1) are decoded to a bf16x2 word with one set of 32-bit ops.
# Each field sits where the fewest shifts move it to its bf16 bit (sign 15; magnitude from bit
# F - MBITS up, F = 7): a field already there is kept with one AND, fields that need the same
# shift share it.
#   FP4 (E 8, P 1):  magnitude (code & 7) at plane 0, bit MAG[u] + 16h; sign (code >> 3) at
#                    bit SIGN[u] + 16h (_HIGH_BITS). Pair 0 is in place (one AND), pair 1 needs
#                    one shift (its sign 9 above its magnitude, as in bf16), pairs 2 and 3 two
#                    (no 4 such pairs tile 16 bits): 11 integer ops a word instead of 15 for
#                    nibbles in a row.
#   FP8 (E 8, P 2):  code at plane u // 2, bit 8 (u % 2) + 16h
#   FP6 (E 16, P 3): the top 3 magnitude bits ((code >> 2) & 7) and the sign (code >> 5) at
#                    plane u // 4 like FP4's pair u % 4 (tables per format, as e2m3 and e3m2
#                    put the magnitude 1 bit apart); code & 3 at plane 2, bit 2 LOW[u] + 16h,
#                    where e2m3's pair 0 is in place.
# Spread groups: word groups come in groups of S (a power of 2 <= 16, the largest with
# K % (E * S) == 0), and inside a group the element pairs are spread over k: pair u of group
# member jj holds k = E*S*t + 2*S*u + 2*jj + h (t: the group). S = 1 is plain k order. With
# S = 16 a tile of S words decodes pair u of every word into 32 consecutive k of one scale block,
# so a [BLOCK_N, E*S] tile in natural k order is a join / permute of the per-pair tiles with no
# data movement between threads, and each pair needs one scale per row (_spread_tile).
PLANES = {4: (8, 1), 8: (8, 2), 6: (16, 3)}  # bits -> (E, P)
MAX_GROUP = 16
# Tile-major planes (weights in spread groups of 16): each plane is stored as [N / TILE_ROWS,
# K / E / 16, TILE_ROWS, 16] words (rows padded to a whole tile with zeros), so a decode step's
# [rows, 16]-word tile is one contiguous run and a program's steps follow one another; the
# kernels address words through _word_offsets: it raises the load ceilings past L2, most for
# FP6 (bench/results/mx_decode_probe.tiled_load.md). TILE_ROWS divides every tensor-core decode
# tile (64, 128 rows).
TILE_ROWS = 64
# format -> (MAG, SIGN): per pair u % 4, the bit of the (top 3) magnitude bits' LSB and of the
# sign in each half; the kernels hold them as nibble constants (_placed_bits)
_HIGH_BITS = {"e2m1": ((6, 0, 3, 11), (15, 9, 10, 14)), "e2m3": ((6, 0, 3, 11), (15, 9, 10, 14)),
              "e3m2": ((7, 3, 0, 12), (15, 11, 6, 10))}
_LOW_SLOTS = (2, 1, 0, 3, 4, 5, 6, 7)  # FP6: per pair u, the 2-bit slot of code & 3 (plane 2)


def _nibbles(values: tuple[int, ...]) -> tl.constexpr:
    """values[u] in nibble u of one integer: the tables above as the kernels read them."""
    return tl.constexpr(sum(v << (4 * u) for u, v in enumerate(values)))


# _placed_bits' view of the tables: e2m1 and e2m3 (EBITS 2) share theirs, e3m2 (EBITS 3)
_MAG_E2, _SIGN_E2 = (_nibbles(t) for t in _HIGH_BITS["e2m3"])
_MAG_E3, _SIGN_E3 = (_nibbles(t) for t in _HIGH_BITS["e3m2"])
_LOW = _nibbles(_LOW_SLOTS)


def _group_words(e: int, k: int) -> int:
    """S of a weight with K = k (see PLANES)."""
    s = MAX_GROUP
    while k % (e * s):
        s //= 2
    return s


def _fields(fmt: str, e: int) -> list[tuple[int, int, int, int]]:
    """(plane, bit, width, code_shift) of element e of a word group (see PLANES)."""
    u, h = divmod(e, 2)
    bits = get_format(fmt).bits
    if bits == 8:
        return [(u // 2, 8 * (u % 2) + 16 * h, 8, 0)]
    mag, sign = _HIGH_BITS[fmt]
    if bits == 4:
        return [(0, mag[u] + 16 * h, 3, 0), (0, sign[u] + 16 * h, 1, 3)]
    return [(u // 4, mag[u % 4] + 16 * h, 3, 2), (u // 4, sign[u % 4] + 16 * h, 1, 5),
            (2, 2 * _LOW_SLOTS[u] + 16 * h, 2, 0)]


@dataclass(frozen=True)
class MXLinearWeight:
    """An [N, K] MX weight in the kernels' layout. Build with prepare_mx_weight, once.

    `counters` is the split-K scratch of the decode kernel (zero between calls): use one weight
    object from one stream at a time."""

    planes: torch.Tensor  # int32 [P, N, K // E], see PLANES
    scales: torch.Tensor  # uint8 [N, K // 32], canonical
    fmt: str
    shape: tuple[int, int]  # (N, K)
    fold: bool  # every scale byte <= 127 + bias (or 255): 2^(scale - bias) fits the target
    counters: torch.Tensor  # int32 [>= N // 8]
    group: int = 1  # S, word groups per spread group (see PLANES)
    nan_scales: bool = True  # some scale byte is 0xFF (NaN): the kernels must check for it
    tile: int = 0  # 0: planes row-major; else tile-major in tiles of `tile` rows (see TILE_ROWS)


def prepare_mx_weight(w: MXTensor) -> MXLinearWeight:
    """Re-arrange a canonical [N, K] MXTensor for the linear kernels (a copy). Reads the scales
    once (a device sync): call at load."""
    if not isinstance(w, MXTensor) or len(w.shape) != 2:
        raise ValueError("prepare_mx_weight expects a 2-D MXTensor [N, K]")
    f = get_format(w.fmt)
    n, k = w.shape
    e, p = PLANES[f.bits]
    group = _group_words(e, k)
    codes = _spread(unpack_codes(w.data, f), e, group).view(n, k // e, e)
    planes = torch.zeros(p, n, k // e, dtype=torch.int64, device=codes.device)
    for i in range(e):
        for plane, bit, width, shift in _fields(w.fmt, i):
            planes[plane] |= ((codes[..., i] >> shift) & (2**width - 1)) << bit
    planes = planes.to(torch.int32)  # wraps bit 31
    tile = TILE_ROWS if group == MAX_GROUP else 0
    if tile:
        planes = _tiled(planes, tile)
    s = w.scales.clone()  # contiguous and aligned: the decode kernel reads 4 bytes at once
    fold = bool(((s <= 127 + f.bias) | (s == 255)).all()) if s.numel() else True
    nan_scales = bool((s == 255).any()) if s.numel() else False
    counters = torch.zeros(triton.cdiv(n, 8), dtype=torch.int32, device=codes.device)
    return MXLinearWeight(planes, s, w.fmt, (n, k), fold, counters, group, nan_scales, tile)


def _tiled(planes: torch.Tensor, tile: int, inverse: bool = False, n: int = 0) -> torch.Tensor:
    """Row-major planes [P, N, W] -> tile-major, rows padded to a multiple of `tile` (same
    shape [P, N', W], words in [P, N' / tile, W / 16, tile, 16] order); inverse: back, [P, n, W]."""
    p, rows, w = planes.shape
    if inverse:
        t = planes.reshape(p, rows // tile, w // 16, tile, 16).permute(0, 1, 3, 2, 4)
        return t.reshape(p, rows, w)[:, :n]
    pad = -rows % tile
    if pad:
        planes = torch.cat([planes, planes.new_zeros(p, pad, w)], 1)
    t = planes.reshape(p, (rows + pad) // tile, tile, w // 16, 16).permute(0, 1, 3, 2, 4)
    return t.contiguous().view(p, rows + pad, w)


def _spread(codes: torch.Tensor, e: int, group: int, inverse: bool = False) -> torch.Tensor:
    """[N, K] codes in natural k order -> element order of the word groups (see PLANES)."""
    n, k = codes.shape
    natural = (n, k // (e * group), e // 2, group, 2)  # [N, t, u, jj, h]
    stored = (n, k // (e * group), group, e // 2, 2)  # [N, t, jj, u, h]
    src = codes.reshape(stored if inverse else natural)
    return src.permute(0, 1, 3, 2, 4).reshape(n, k)


def canonical_data(w: MXLinearWeight) -> torch.Tensor:
    """The canonical packed bytes [N, packed K] of a prepared weight."""
    f = get_format(w.fmt)
    n, k = w.shape
    e, _ = PLANES[f.bits]
    planes = _tiled(w.planes, w.tile, inverse=True, n=n) if w.tile else w.planes
    planes = planes.long() & 0xFFFFFFFF
    codes = torch.zeros(n, k // e, e, dtype=torch.int64, device=planes.device)
    for i in range(e):
        for plane, bit, width, shift in _fields(w.fmt, i):
            codes[..., i] |= ((planes[plane] >> bit) & (2**width - 1)) << shift
    return pack_codes(_spread(codes.view(n, k), e, w.group, inverse=True), f)


def _as_linear_weight(w: MXTensor | MXLinearWeight) -> MXLinearWeight:
    return w if isinstance(w, MXLinearWeight) else prepare_mx_weight(w)


# ---------------------------------------------------------------- weight tiles

@triton.jit
def _shl(v, D: tl.constexpr):
    """v << D, or v >> -D for negative D (arithmetic; callers mask the bits they keep)."""
    if D >= 0:
        return v << D
    else:
        return v >> (-D)


@triton.jit
def _placed_bits(w0, w1, w2, T: tl.constexpr, EBITS: tl.constexpr, MBITS: tl.constexpr,
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
    # pair U's bits in _HIGH_BITS / _LOW_SLOTS
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
    v = _bits_to_float(_placed_bits(w0, w1, w2, T, EBITS, MBITS, NAN_CODE, E, F, False), F) * f1
    if not FOLD:
        v = v * f2
    return v


@triton.jit
def _pair(w0, w1, w2, f1, f2, U: tl.constexpr, EBITS: tl.constexpr, MBITS: tl.constexpr,
          E: tl.constexpr, FOLD: tl.constexpr):
    """bf16 elements 2U and 2U + 1 of each word group, decoded from one bf16x2 bit pattern."""
    bits = _placed_bits(w0, w1, w2, 2 * U, EBITS, MBITS, -1, E, 7, True)
    lo = bits.to(tl.int16).to(tl.bfloat16, bitcast=True) * f1
    hi = (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True) * f1
    if not FOLD:
        lo = lo * f2
        hi = hi * f2
    return lo, hi


@triton.jit
def _word_offsets(rows, j, num_words, stride_wn, TILE: tl.constexpr):
    """Offsets in a plane of words j of rows: row-major (TILE 0), or tile-major (TILE_ROWS)."""
    if TILE == 0:
        return rows * stride_wn + j
    else:
        return ((rows // TILE) * num_words + (j // 16) * 16) * TILE + (rows % TILE) * 16 + j % 16


@triton.jit
def _load_groups(planes_ptr, offs_n, j0, N, num_words, stride_plane, stride_wn,
                 P: tl.constexpr, G: tl.constexpr, TILE: tl.constexpr = 0):
    """Words [*offs_n.shape, G] of word groups j0..j0+G of rows offs_n < N (0 elsewhere;
    num_words = K // E)."""
    j = j0 + tl.arange(0, G)
    rows = tl.expand_dims(offs_n, -1)
    mask = (rows < N) & (j < num_words)
    ptrs = planes_ptr + _word_offsets(rows, j, num_words, stride_wn, TILE)
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
    w0, w1, w2 = _load_groups(planes_ptr, offs_n, j0, N, num_words, stride_plane, stride_wn, P,
                              BLOCK_K // E, TILE)
    return _build_tile(w0, w1, w2, scales_ptr, offs_n, j0, N, num_words, stride_sn, EBITS, MBITS,
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
def _spread_tile4(p0, p1, p2, p3, S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
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
def _spread_tile8(p0, p1, p2, p3, p4, p5, p6, p7, S: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """_spread_tile4 for 8 pairs (E = 16)."""
    w = tl.join(tl.join(tl.join(p0, p1), tl.join(p2, p3)),
                tl.join(tl.join(p4, p5), tl.join(p6, p7)))  # [BN, G, h, u0, u1, u2]
    if BLOCK_K == 16 * S:
        w = tl.reshape(tl.permute(w, (0, 5, 4, 3, 1, 2)), (BLOCK_N, BLOCK_K))
    else:
        w = tl.reshape(w, (BLOCK_N, BLOCK_K // (16 * S), S, 2, 2, 2, 2))
        w = tl.reshape(tl.permute(w, (0, 1, 6, 5, 4, 2, 3)), (BLOCK_N, BLOCK_K))
    return w


@triton.jit
def _build_tile(w0, w1, w2, scales_ptr, offs_n, j0, N, num_words, stride_sn,
                EBITS: tl.constexpr, MBITS: tl.constexpr, NAN_CODE: tl.constexpr,
                E: tl.constexpr, S: tl.constexpr, FOLD: tl.constexpr, F: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] tile of loaded words (_load_groups), natural k order; the scale
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
        w = _spread_tile4(p0, p1, p2, p3, S, BLOCK_N, BLOCK_K)
    else:
        p4 = _decoded_pair(w0, w1, w2, scales_ptr, offs_n, j0, N, num_words, stride_sn, 4,
                           EBITS, MBITS, NAN_CODE, E, S, FOLD, F)
        p5 = _decoded_pair(w0, w1, w2, scales_ptr, offs_n, j0, N, num_words, stride_sn, 5,
                           EBITS, MBITS, NAN_CODE, E, S, FOLD, F)
        p6 = _decoded_pair(w0, w1, w2, scales_ptr, offs_n, j0, N, num_words, stride_sn, 6,
                           EBITS, MBITS, NAN_CODE, E, S, FOLD, F)
        p7 = _decoded_pair(w0, w1, w2, scales_ptr, offs_n, j0, N, num_words, stride_sn, 7,
                           EBITS, MBITS, NAN_CODE, E, S, FOLD, F)
        w = _spread_tile8(p0, p1, p2, p3, p4, p5, p6, p7, S, BLOCK_N, BLOCK_K)
    return w


@triton.jit
def _dot_w_xt(w, x, acc, INTERP_BF16: tl.constexpr):
    """acc + w @ x.T (the transposed product: the dequantized weights are the left operand, which
    Hopper's wgmma reads from registers), with w rounded to x's dtype; see _dot_wt."""
    if INTERP_BF16:
        return tl.dot(round_bf16(w.to(tl.float32)), tl.trans(to_f32(x, INTERP_BF16)), acc,
                      input_precision="ieee")
    return tl.dot(w.to(x.dtype), tl.trans(x), acc, input_precision="ieee")


@triton.jit
def _dot_wt(x, w, acc, INTERP_BF16: tl.constexpr):
    """acc + x @ w.T with w rounded to x's dtype. INTERP_BF16 (the interpreter's bf16 tl.dot is
    wrong, its casts truncate): the same rounded operands multiplied in fp32, exact for bf16."""
    if INTERP_BF16:
        wt = tl.trans(round_bf16(w.to(tl.float32)))
        return tl.dot(to_f32(x, INTERP_BF16), wt, acc, input_precision="ieee")
    return tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision="ieee")


# ---------------------------------------------------------------- decode (M <= 16)

@triton.jit
def _mx_linear_decode_kernel(
    # pointers: x [M, K]; weight planes [P, N, K // E] int32, scales [N, K // 32]; bias [N]
    # (read only if HAS_BIAS); out [M, N]; split-K partials [split_k, M, N] fp32 and per-tile
    # counters (zero on entry and exit; read only if SPLIT)
    x_ptr, planes_ptr, scales_ptr, bias_ptr, out_ptr, partial_ptr, counter_ptr,
    # sizes; num_words = K // E; words_per_split is a multiple of BLOCK_K // E
    M, N, K, num_words, split_k, words_per_split,
    # strides
    stride_xm, stride_plane, stride_wn, stride_sn, stride_om, stride_ps,
    # element format and layout (see PLANES, _scale_factors)
    EBITS: tl.constexpr, MBITS: tl.constexpr, NAN_CODE: tl.constexpr, E: tl.constexpr,
    P: tl.constexpr, S: tl.constexpr, FOLD: tl.constexpr, TILE: tl.constexpr,
    # tiling. USE_DOT: tensor cores on a dequantized tile in x's dtype (bf16 bits straight from
    # the codes when WBF16), BLOCK_M 16; else BLOCK_M 1 and fp32 FMAs. PREFETCH: load the next
    # tile's words before decoding this one (more bytes in flight)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr,
    PREFETCH: tl.constexpr, WBF16: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
    INTERP_BF16: tl.constexpr,
):
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    G: tl.constexpr = BLOCK_K // E
    j_lo = pid_k * words_per_split
    j_hi = tl.minimum(j_lo + words_per_split, num_words)
    F: tl.constexpr = 7 if USE_DOT and WBF16 else 23
    if USE_DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:  # BLOCK_M == 1: fp32 products, summed over k at the end
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    if PREFETCH:  # the next tile's words are loaded before this one is used
        n0, n1, n2 = _load_groups(planes_ptr, offs_n, j_lo, tl.where(j_lo < j_hi, N, 0),
                                  num_words, stride_plane, stride_wn, P, G, TILE)
    for j0 in range(j_lo, j_hi, G):
        if PREFETCH:
            w0, w1, w2 = n0, n1, n2
            n0, n1, n2 = _load_groups(planes_ptr, offs_n, j0 + G, tl.where(j0 + G < j_hi, N, 0),
                                      num_words, stride_plane, stride_wn, P, G, TILE)
        else:
            w0, w1, w2 = _load_groups(planes_ptr, offs_n, j0, N, num_words, stride_plane,
                                      stride_wn, P, G, TILE)
        w = _build_tile(w0, w1, w2, scales_ptr, offs_n, j0, N, num_words, stride_sn, EBITS, MBITS,
                        NAN_CODE, E, S, FOLD, F, BLOCK_N, BLOCK_K)
        offs_k = j0 * E + tl.arange(0, BLOCK_K)
        if USE_DOT:
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                        mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
            acc = _dot_wt(x, w, acc, INTERP_BF16)
        else:
            x = tl.load(x_ptr + pid_m * stride_xm + offs_k, mask=offs_k < K, other=0.0)
            acc2 += w * to_f32(x, INTERP_BF16)[None, :]
    if not USE_DOT:
        acc = tl.sum(acc2, axis=1)[None, :]  # [1, BLOCK_N]
    _finish_decode(acc, offs_m, offs_n, pid_k, pid_m * tl.num_programs(0) + pid_n, M, N,
                   split_k, bias_ptr, out_ptr, partial_ptr, counter_ptr, stride_om, stride_ps,
                   SPLIT, HAS_BIAS, INTERP_BF16)


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
    bits = _placed_bits(w0, w1, w2, 2 * U, EBITS, MBITS, -1, E, 7, True)
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
    that hold its words, joined with no data exchange: _spread_tile4/8); sa, sb: the groups'
    scale words (_tc_scales), broadcastable to the words."""
    p0, p1, p2, p3, p4, p5, p6, p7 = tc_pairs(w0, w1, w2, sa, sb, EBITS, MBITS, E, FOLD,
                                               NAN_SCALES, INTERP)
    if E == 8:
        w = _spread_tile4(p0, p1, p2, p3, 16, BLOCK_N, BLOCK_K)
    else:
        w = _spread_tile8(p0, p1, p2, p3, p4, p5, p6, p7, 16, BLOCK_N, BLOCK_K)
    return w


@triton.jit
def row_words(planes_ptr, scales_ptr, rows, N, num_words, stride_plane, stride_wn, stride_sn,
               E: tl.constexpr, P: tl.constexpr, BLOCK_K: tl.constexpr, TILE: tl.constexpr = 0):
    """(w0, w1, w2, sa, sb): the words [*rows.shape, BLOCK_K // E] of whole rows (0 past K =
    E * num_words) of a weight in spread groups of 16, and the scale words of each word's group
    (_tc_scales, one per word), for kernels that hold whole rows (kernels/gemv.py): every
    load at once. rows < N; decode with tc_pairs."""
    G: tl.constexpr = BLOCK_K // E  # words a row (BLOCK_K a power of 2 >= E * 16)
    whole = (num_words // 16) * 16  # (= num_words; so written, the loads are 16-byte vectors)
    w0, w1, w2 = _load_groups(planes_ptr, rows, 0, N, whole, stride_plane, stride_wn, P, G, TILE)
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
def _tc_words(planes_ptr, rows, j0, num_words, stride_plane, stride_wn, P: tl.constexpr,
              TILE: tl.constexpr):
    """Words [BLOCK_N, 16] of the spread group at word group j0, rows `rows` (in range: the
    caller clamps them, so no load needs a mask)."""
    ptrs = planes_ptr + _word_offsets(rows[:, None], (j0 + tl.arange(0, 16))[None, :], num_words,
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
def _tc_scales(sw_ptrs, j0, E: tl.constexpr):
    """The scale words (4 bytes each, [BLOCK_N]) of the spread group at word group j0: pairs
    0..3 and (E = 16) 4..7. sw_ptrs: int32 pointers to the rows' scales (clamped rows)."""
    blk = (E * j0) // 128  # int32 word of the group's first scale byte
    sa = tl.load(sw_ptrs + blk)
    sb = sa
    if E == 16:
        sb = tl.load(sw_ptrs + blk + 1)
    return sa, sb


@triton.jit
def _tc_step(acc, w0, w1, w2, sa, sb, x_ptr, offs_m, j0, M, stride_xm,
             EBITS: tl.constexpr, MBITS: tl.constexpr, E: tl.constexpr, FOLD: tl.constexpr,
             NAN_SCALES: tl.constexpr, BLOCK_N: tl.constexpr, INTERP_BF16: tl.constexpr):
    """acc + w @ x.T over the spread group of word groups j0..j0+16; sa, sb its scale words
    (_tc_scales)."""
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


@triton.jit
def _mx_linear_decode_tc_kernel(
    # pointers: x [M, K] bf16; weight planes [P, N, K // E] int32 in spread groups of 16,
    # scales [N, K // 32] (4-byte aligned rows); bias, out, partials, counters as in
    # _mx_linear_decode_kernel
    x_ptr, planes_ptr, scales_ptr, bias_ptr, out_ptr, partial_ptr, counter_ptr,
    # sizes; num_words = K // E; words_per_split is a multiple of 16
    M, N, K, num_words, split_k, words_per_split,
    # strides
    stride_xm, stride_plane, stride_wn, stride_sn, stride_om, stride_ps,
    # element format (no NaN codes: not e4m3); NAN_SCALES: some scale byte may be 0xFF
    EBITS: tl.constexpr, MBITS: tl.constexpr, E: tl.constexpr, P: tl.constexpr,
    FOLD: tl.constexpr, NAN_SCALES: tl.constexpr, TILE: tl.constexpr,
    # tiling; BLOCK_M (16, 32 or 64) >= M: every row of x in one program
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
    INTERP_BF16: tl.constexpr,
):
    """Decode (M <= 64) on tensor cores: per step one spread group (16 word groups, E * 16 k)
    of BLOCK_N rows; each pair's [BLOCK_N, 16, 2] tile is decoded in the registers that hold
    its words and the tiles are joined into the dot's left operand with no data exchange
    between threads (_spread_tile4/8). acc = w @ x.T [BLOCK_N, BLOCK_M] in fp32 (rows of x
    past M are zero): each weight is decoded once for all M rows. Rows past N are read as row
    N - 1 (no masks on the weight loads; the store drops them); a split covers whole spread
    groups. The loads are software-pipelined by Triton (num_stages). INTERP_BF16: the Triton
    interpreter, which has no inline asm and whose bf16 tl.dot is wrong: the same bf16
    weights, multiplied in fp32."""
    S: tl.constexpr = 16
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1)
    offs_m = tl.arange(0, BLOCK_M)
    j_lo = pid_k * words_per_split
    j_hi = tl.minimum(j_lo + words_per_split, num_words)
    sw_ptrs = (scales_ptr + rows * stride_sn).to(tl.pointer_type(tl.int32), bitcast=True)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # every split holds a group (_launch_decode_tc): declared, the loop has no zero-trip path,
    # whose zeroed accumulators made ptxas serialize the wgmma chain (tests/cpu/
    # test_wgmma_pipeline.py)
    tl.assume(j_lo < j_hi)
    for j0 in range(j_lo, j_hi, S):
        w0, w1, w2 = _tc_words(planes_ptr, rows, j0, num_words, stride_plane, stride_wn, P, TILE)
        sa, sb = _tc_scales(sw_ptrs, j0, E)
        acc = _tc_step(acc, w0, w1, w2, sa, sb, x_ptr, offs_m, j0, M, stride_xm, EBITS, MBITS,
                       E, FOLD, NAN_SCALES, BLOCK_N, INTERP_BF16)
    _finish_decode(tl.trans(acc), offs_m, offs_n, pid_k, pid_n, M, N, split_k, bias_ptr, out_ptr,
                   partial_ptr, counter_ptr, stride_om, stride_ps, SPLIT, HAS_BIAS, INTERP_BF16)


@triton.jit
def _finish_decode(acc, offs_m, offs_n, pid_k, tile, M, N, split_k, bias_ptr, out_ptr,
                   partial_ptr, counter_ptr, stride_om, stride_ps, SPLIT: tl.constexpr,
                   HAS_BIAS: tl.constexpr, INTERP_BF16: tl.constexpr):
    """Write acc [BLOCK_M, BLOCK_N] (+ bias) to out, or, with SPLIT, this split's partial; the
    last split of a tile to finish (an atomic counter) sums the partials in fixed order
    (deterministic), adds the bias, writes out and re-arms the counter."""
    BLOCK_M: tl.constexpr = acc.shape[0]
    BLOCK_N: tl.constexpr = acc.shape[1]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SPLIT:
        tile_ptrs = offs_m[:, None] * N + offs_n[None, :]
        tl.store(partial_ptr + pid_k * stride_ps + tile_ptrs, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the release below
        done = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if done == split_k - 1:  # the last split of this tile: sum in fixed order
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(split_k):
                acc += tl.load(partial_ptr + s * stride_ps + tile_ptrs, mask=mask, other=0.0,
                               cache_modifier=".cg")
            tl.atomic_xchg(counter_ptr + tile, 0)  # re-arm for the next call
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(
                    tl.float32)[None, :]
            out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
            tl.store(out, cast_out(acc, out_ptr.dtype.element_ty, INTERP_BF16), mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out, cast_out(acc, out_ptr.dtype.element_ty, INTERP_BF16), mask=mask)


# ---------------------------------------------------------------- prefill (M > 16)

@triton.jit
def _mx_linear_prefill_kernel(
    # pointers: x [M, K]; weight planes [P, N, K // E] int32 (packed bytes [N, K // 2] for
    # DOT_SCALED_FMT), scales [N, K // 32]; bias [N] (read only if HAS_BIAS); out [M, N]
    x_ptr, planes_ptr, scales_ptr, bias_ptr, out_ptr,
    # sizes; num_words = K // E
    M, N, K, num_words,
    # strides
    stride_xm, stride_plane, stride_wn, stride_sn, stride_om,
    # element format; DOT_SCALED_FMT: "" or tl.dot_scaled's name for the weight format
    EBITS: tl.constexpr, MBITS: tl.constexpr, NAN_CODE: tl.constexpr, E: tl.constexpr,
    P: tl.constexpr, S: tl.constexpr, FOLD: tl.constexpr, TILE: tl.constexpr, PACK: tl.constexpr,
    DOT_SCALED_FMT: tl.constexpr,
    X_FMT: tl.constexpr,
    # tiling
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    WBF16: tl.constexpr, HAS_BIAS: tl.constexpr, INTERP_BF16: tl.constexpr,
):
    # grouped ordering: GROUP_M row tiles share each weight column tile while it is in L2
    pid = tl.program_id(0)
    num_pid_m, num_pid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    first_m = pid // (GROUP_M * num_pid_n) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_pid_n)) % group_size
    pid_n = (pid % (GROUP_M * num_pid_n)) // group_size
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # out.T
    for j0 in range(0, num_words, BLOCK_K // E):
        k0 = j0 * E
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
        if DOT_SCALED_FMT == "":
            w = weight_tile(planes_ptr, scales_ptr, offs_n, j0, N, num_words, stride_plane,
                             stride_wn, stride_sn, EBITS, MBITS, NAN_CODE, E, P, S, FOLD,
                             7 if WBF16 else 23, BLOCK_N, BLOCK_K, TILE)
            acc = _dot_w_xt(w, x, acc, INTERP_BF16)
        else:  # packed codes [BLOCK_K // PACK, BLOCK_N] and raw scales [BLOCK_N, BLOCK_K // 32]
            g = k0 // PACK + tl.arange(0, BLOCK_K // PACK)
            wq = tl.load(planes_ptr + offs_n[None, :] * stride_wn + g[:, None],
                         mask=(offs_n[None, :] < N) & (g[:, None] < K // PACK), other=0)
            kb = k0 // 32 + tl.arange(0, BLOCK_K // 32)
            s = tl.load(scales_ptr + offs_n[:, None] * stride_sn + kb[None, :],
                        mask=(offs_n[:, None] < N) & (kb[None, :] < K // 32), other=127)
            acc = tl.trans(tl.dot_scaled(x, None, X_FMT, wq, s, DOT_SCALED_FMT,
                                         acc=tl.trans(acc)))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(out, cast_out(acc, out_ptr.dtype.element_ty, INTERP_BF16),
             mask=(offs_m[None, :] < M) & (offs_n[:, None] < N))


@triton.jit
def _mx_linear_dequant_kernel(
    # pointers: weight planes [P, N, K // E] int32, scales [N, K // 32]; out [N, K]
    planes_ptr, scales_ptr, out_ptr,
    # sizes (num_words = K // E) and strides
    N, K, num_words, stride_plane, stride_wn, stride_sn, stride_on,
    # element format and layout
    EBITS: tl.constexpr, MBITS: tl.constexpr, NAN_CODE: tl.constexpr, E: tl.constexpr,
    P: tl.constexpr, S: tl.constexpr, FOLD: tl.constexpr, TILE: tl.constexpr,
    # tiling
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WBF16: tl.constexpr,
    INTERP_BF16: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    w = weight_tile(planes_ptr, scales_ptr, offs_n, tl.program_id(1) * (BLOCK_K // E), N,
                     num_words, stride_plane, stride_wn, stride_sn, EBITS, MBITS, NAN_CODE, E, P,
                     S, FOLD, 7 if WBF16 else 23, BLOCK_N, BLOCK_K, TILE)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    v = w if WBF16 else cast_out(w, out_ptr.dtype.element_ty, INTERP_BF16)
    tl.store(out_ptr + offs_n[:, None] * stride_on + offs_k[None, :], v,
             mask=(offs_n[:, None] < N) & (offs_k[None, :] < K))


# ---------------------------------------------------------------- launch

def format_args(w: MXLinearWeight) -> dict:
    f = get_format(w.fmt)
    e, p = PLANES[f.bits]
    return dict(EBITS=f.ebits, MBITS=f.mbits, NAN_CODE=0x7F if w.fmt == "e4m3" else -1, E=e, P=p,
                S=w.group, FOLD=w.fold, TILE=w.tile)


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" \
        else 1


# decode configs: (BLOCK_N, BLOCK_K, num_warps, num_stages) for the FMA path (M = 1) and the
# tl.dot path (M >= 2); GPU only, the interpreter uses small tiles. Tuned on the H200 (bench/).
_DECODE_FMA = (8, 512, 4, 1)
_DECODE_DOT = (32, 256, 4, 1)
_DECODE_TARGET_PROGRAMS_PER_SM = 4
_DECODE_PREFETCH = True


def _tc_config(e: int, m: int, n: int, sms: int) -> tuple[tuple[int, int, int], int]:
    """The tensor-core decode's (BLOCK_N, num_warps, num_stages) and programs per SM (split-K),
    from an H200 sweep over the 1B/8B decode shapes with the weights cycled past L2, as a model
    reads them (bench/results/mx_decode_probe.past_l2.json; a sweep over one weight read again
    and again, half of it from L2, would pick otherwise):
    - FP4 at one row: 128-row tiles, 4 programs an SM;
      at more rows 64-row tiles (128 lose there), 4 programs an SM unless the tiles alone
      outnumber 2 an SM, then 8 (the 28672-row weights are slower at 4);
    - FP6 (~160 registers: ~3 programs fit an SM): 2 programs an SM, one wave, unless the tiles
      alone outnumber that, then 8, finer splits evening out the waves."""
    many_tiles = triton.cdiv(n, 64) > 2 * sms
    if e == 8:
        return ((128, 4, 3), 4) if m == 1 else ((64, 4, 3), 8 if many_tiles else 4)
    return (64, 4, 3), (8 if many_tiles else 2)


def _tc_ok(x2: torch.Tensor, w: MXLinearWeight) -> bool:
    """The tensor-core decode kernel applies: bf16 x, spread groups of 16 (K > 0), no NaN
    codes."""
    return x2.dtype == torch.bfloat16 and w.group == MAX_GROUP and w.fmt != "e4m3" \
        and w.shape[1] > 0


def _launch_decode_tc(x2, w, out2, bias, split_k, config=None, programs_per_sm=None):
    (m, k), n = x2.shape, w.shape[0]
    on_gpu = x2.is_cuda
    e, _ = PLANES[get_format(w.fmt).bits]
    tuned, tuned_pps = _tc_config(e, m, n, _num_sms(x2.device))
    block_n, num_warps, num_stages, *maxnreg = (config or tuned) if on_gpu else (16, 4, 1)
    launch = dict(num_warps=num_warps, num_stages=num_stages) if on_gpu else {}
    if maxnreg:  # (bench/: a register cap for ptxas)
        launch["maxnreg"] = maxnreg[0]
    tiles = triton.cdiv(n, block_n)
    groups = k // (e * MAX_GROUP)
    if split_k is None:
        want = (programs_per_sm or tuned_pps) * _num_sms(x2.device)
        split_k = max(1, min(want // tiles, groups))
    split_k = triton.cdiv(groups, triton.cdiv(groups, max(1, min(split_k, groups))))
    words_per_split = triton.cdiv(groups, split_k) * MAX_GROUP
    interp_bf16 = interpreted_bf16(x2.dtype, x2)
    counters = w.counters
    if split_k > 1 and counters.numel() < tiles:
        counters = torch.zeros(tiles, dtype=torch.int32, device=x2.device)
    partial = torch.empty(split_k, m, n, dtype=torch.float32, device=x2.device) \
        if split_k > 1 else out2
    f = get_format(w.fmt)
    _mx_linear_decode_tc_kernel[(tiles, split_k)](
        x2, w.planes, w.scales, bias if bias is not None else w.scales, out2, partial, counters,
        m, n, k, k // e, split_k, words_per_split, x2.stride(0), w.planes.stride(0),
        w.planes.stride(1), w.scales.stride(0), out2.stride(0),
        partial.stride(0) if split_k > 1 else 0,
        EBITS=f.ebits, MBITS=f.mbits, E=e, P=PLANES[f.bits][1], FOLD=w.fold,
        NAN_SCALES=w.nan_scales, TILE=w.tile, BLOCK_M=max(16, triton.next_power_of_2(m)),
        BLOCK_N=block_n,
        SPLIT=split_k > 1,
        HAS_BIAS=bias is not None, INTERP_BF16=interp_bf16, **launch)


def launch_decode(x2, w, out2, bias, split_k, config=None, use_dot=None, programs_per_sm=None,
                   prefetch=None, tc=None):
    """config (BLOCK_N, BLOCK_K, num_warps, num_stages), use_dot, programs_per_sm, tc (the
    tensor-core kernel; default: where it applies, on a GPU): overrides of the tuned choices
    (bench/)."""
    if tc is None:  # past TC_DECODE_MAX_M rows the kernel below takes any M
        tc = x2.is_cuda and _tc_ok(x2, w) and x2.shape[0] <= TC_DECODE_MAX_M
    if tc:
        if not _tc_ok(x2, w) or x2.shape[0] > TC_DECODE_MAX_M:
            raise ValueError("mx_linear: the tensor-core decode needs bf16 x, K a multiple of "
                             f"E * 16, no e4m3 and at most {TC_DECODE_MAX_M} rows")
        return _launch_decode_tc(x2, w, out2, bias, split_k, config, programs_per_sm)
    (m, k), n = x2.shape, w.shape[0]
    on_gpu = x2.is_cuda
    use_dot = m > 1 if use_dot is None else use_dot or m > 1
    block_m = 16 if use_dot else 1
    if config is None:
        config = (_DECODE_DOT if use_dot else _DECODE_FMA) if on_gpu else (16, 128, 4, 1)
    block_n, block_k, num_warps, num_stages = config
    e, _ = PLANES[get_format(w.fmt).bits]
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    if split_k is None:  # enough programs in flight to hide the memory latency
        want = (programs_per_sm or _DECODE_TARGET_PROGRAMS_PER_SM) * _num_sms(x2.device)
        split_k = max(1, min(want // tiles, triton.cdiv(k, block_k)))
    block_k = max(e * w.group, min(block_k, max(2 * e, triton.next_power_of_2(
        triton.cdiv(k, split_k)))))
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    words_per_split = k_per_split // e
    interp_bf16 = interpreted_bf16(x2.dtype, x2)
    counters = w.counters
    if split_k > 1 and counters.numel() < tiles:
        counters = torch.zeros(tiles, dtype=torch.int32, device=x2.device)
    partial = torch.empty(split_k, m, n, dtype=torch.float32, device=x2.device) \
        if split_k > 1 else out2
    grid = (triton.cdiv(n, block_n), split_k, triton.cdiv(m, block_m))
    _mx_linear_decode_kernel[grid](
        x2, w.planes, w.scales, bias if bias is not None else w.scales, out2, partial, counters,
        m, n, k, k // e, split_k, words_per_split, x2.stride(0), w.planes.stride(0),
        w.planes.stride(1), w.scales.stride(0), out2.stride(0),
        partial.stride(0) if split_k > 1 else 0,
        **format_args(w), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, USE_DOT=use_dot,
        PREFETCH=_DECODE_PREFETCH if prefetch is None else prefetch,
        WBF16=x2.dtype == torch.bfloat16 and not interp_bf16, SPLIT=split_k > 1,
        HAS_BIAS=bias is not None, INTERP_BF16=interp_bf16,
        **(dict(num_warps=num_warps, num_stages=num_stages) if on_gpu else {}))


# BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages. Not 3 stages: with Triton 3.6 on the H200,
# (128, 128, 64, 8, 3) returns garbage (inf, ~3e38) for e2m1 weights with a bias from M ~ 1024
# rows on, while every other tile tried is exact; 2 stages is as fast over the four formats
# (bench/results/kernels_gpu.prefill_config.json).
_PREFILL = (128, 128, 64, 8, 2)


def launch_prefill(x2, w, out2, bias, use_dot_scaled, config=None):
    (m, k), n = x2.shape, w.shape[0]
    on_gpu = x2.is_cuda
    block_m, block_n, block_k, num_warps, num_stages = config or (
        _PREFILL if on_gpu else (32, 32, 64, 4, 1))
    f = get_format(w.fmt)
    if PLANES[f.bits][0] * w.group > block_k:  # whole spread groups; x's smem tile must fit
        block_k = PLANES[f.bits][0] * w.group
        block_m = min(block_m, 64)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    planes = canonical_data(w) if use_dot_scaled else w.planes  # bytes [N, K // PACK]
    interp_bf16 = interpreted_bf16(x2.dtype, x2)
    _mx_linear_prefill_kernel[grid](
        x2, planes, w.scales, bias if bias is not None else w.scales, out2, m, n, k,
        k // PLANES[f.bits][0], x2.stride(0), w.planes.stride(0), planes.stride(-2),
        w.scales.stride(0), out2.stride(0),
        **format_args(w), PACK=f.pack, DOT_SCALED_FMT=w.fmt if use_dot_scaled else "",
        X_FMT={torch.bfloat16: "bf16", torch.float16: "fp16"}.get(x2.dtype, ""),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8,
        WBF16=x2.dtype == torch.bfloat16 and not interp_bf16, HAS_BIAS=bias is not None,
        INTERP_BF16=interp_bf16,
        **(dict(num_warps=num_warps, num_stages=num_stages) if on_gpu else {}))


# (BLOCK_N, BLOCK_K, num_warps) of the dequantize kernel on the GPU: small tiles, many programs
# (the winner of bench/tune/mx_dequant_tune.py on the H200)
_DEQUANT = (16, 256, 2)


def dequantize_linear_weight(w: MXTensor | MXLinearWeight, dtype: torch.dtype,
                             *, backend: str = "auto") -> torch.Tensor:
    """w as a dense [N, K] `dtype` tensor (exact in fp32, one rounding to dtype)."""
    w = _as_linear_weight(w)
    n, k = w.shape
    if not _use_triton(backend, w.planes):
        return dequantize_mx_torch(MXTensor(canonical_data(w), w.scales, w.fmt, (n, k)), dtype)
    out = torch.empty(n, k, dtype=dtype, device=w.planes.device)
    on_gpu = w.planes.is_cuda
    block_n, block_k, num_warps = _DEQUANT if on_gpu else (16, 64, 4)
    block_k = max(block_k, PLANES[get_format(w.fmt).bits][0] * w.group)
    interp_bf16 = interpreted_bf16(dtype, out)
    _mx_linear_dequant_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        w.planes, w.scales, out, n, k, k // PLANES[get_format(w.fmt).bits][0],
        w.planes.stride(0), w.planes.stride(1),
        w.scales.stride(0), out.stride(0), **format_args(w), BLOCK_N=block_n, BLOCK_K=block_k,
        WBF16=dtype == torch.bfloat16 and not interp_bf16, INTERP_BF16=interp_bf16,
        **(dict(num_warps=num_warps) if on_gpu else {}))
    return out


def _check_linear(x: torch.Tensor, w: MXLinearWeight, bias: torch.Tensor | None) -> None:
    if x.dtype not in ACT_DTYPES:
        raise ValueError(f"mx_linear: x dtype must be float32, bfloat16 or float16, got {x.dtype}")
    n, k = w.shape
    if x.dim() == 0 or x.shape[-1] != k:
        raise ValueError(f"mx_linear: x {tuple(x.shape)} does not match weight [N={n}, K={k}]")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"mx_linear: bias must have shape ({n},), got {tuple(bias.shape)}")


def mx_linear(x: torch.Tensor, w: MXTensor | MXLinearWeight, bias: torch.Tensor | None = None,
              *, backend: str = "auto", path: str = "auto", split_k: int | None = None,
              use_dot_scaled: bool | None = None, out: torch.Tensor | None = None,
              out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y [..., N] = x [..., K] @ dequantize(w).T + bias, in x's dtype, accumulated in fp32.

    out_dtype: None (x's) or float32: the decode path stores its fp32 sums as they are (logits);
    the other paths round to x's dtype first.

    Pass a prepared MXLinearWeight (prepare_mx_weight, at load); an MXTensor is prepared per call.
    path: "auto" (decode when M <= 16, dense dequantize + cuBLAS from PREFILL_DEQUANT_MIN_M rows
    of 16-bit x on a GPU), "decode", "prefill" (always the fused kernel) or "dequant".
    use_dot_scaled (prefill): None = only where MX MMA is native (sm_100+); needs e2m1/e4m3
    weights and 16-bit x. fp16 x: the dequantized weights must fit fp16's range. Raises
    ValueError on bad input."""
    w = _as_linear_weight(w)
    _check_linear(x, w, bias)
    if path not in ("auto", "decode", "prefill", "dequant"):
        raise ValueError(f"mx_linear: path must be auto, decode, prefill or dequant, got {path!r}")
    if out_dtype not in (None, x.dtype, torch.float32):
        raise ValueError(f"mx_linear: out_dtype must be x's dtype or float32, got {out_dtype}")
    out_dtype = out_dtype or x.dtype
    if not _use_triton(backend, x):
        ref = mx_linear_torch(x, w, bias, out_dtype=out_dtype)
        return ref if out is None else out.copy_(ref)
    n, k = w.shape
    x2 = x.reshape(-1, k)  # [M, K]
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    m = x2.shape[0]
    tc_rows = TC_DECODE_MAX_M if x.is_cuda and _tc_ok(x2, w) else DECODE_MAX_M
    decode = path == "decode" or (path == "auto" and m <= tc_rows)
    if not decode and out_dtype != x.dtype:  # rounded to x's dtype by the paths below
        y = mx_linear(x, w, bias, backend=backend, path=path, use_dot_scaled=use_dot_scaled)
        return y.to(out_dtype) if out is None else out.copy_(y)
    if out is None:
        out = torch.empty(*x.shape[:-1], n, dtype=out_dtype, device=x.device)
    if not out.is_contiguous() or out.shape != (*x.shape[:-1], n) or out.dtype != out_dtype:
        raise ValueError(f"mx_linear: out must be contiguous {out_dtype} {(*x.shape[:-1], n)}")
    if m == 0:
        return out
    out2 = out.view(-1, n)  # [M, N]
    if decode:
        launch_decode(x2, w, out2, bias, split_k)
        return out
    if path == "dequant" or (path == "auto" and x.is_cuda and x.dtype != torch.float32
                             and m >= PREFILL_DEQUANT_MIN_M):
        wd = dequantize_linear_weight(w, x.dtype, backend=backend)
        torch.matmul(x2, wd.T, out=out2) if bias is None else \
            torch.addmm(bias, x2, wd.T, out=out2)
        return out
    can_dot_scaled = w.fmt in ("e2m1", "e4m3") and x.dtype != torch.float32
    if use_dot_scaled is None:  # emulated (upcast to bf16) below sm_100: no gain there
        use_dot_scaled = can_dot_scaled and x.is_cuda and \
            torch.cuda.get_device_capability(x.device)[0] >= 10
    elif use_dot_scaled and not can_dot_scaled:
        raise ValueError("mx_linear: tl.dot_scaled needs e2m1/e4m3 weights and 16-bit x")
    launch_prefill(x2, w, out2, bias, use_dot_scaled)
    return out


def mx_linear_torch(x: torch.Tensor, w: MXTensor | MXLinearWeight,
                    bias: torch.Tensor | None = None, *,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Reference: dequantize w exactly, matmul in fp32, add bias, cast to out_dtype (x's)."""
    w = _as_linear_weight(w)
    _check_linear(x, w, bias)
    n, k = w.shape
    wf = dequantize_mx_torch(MXTensor(canonical_data(w), w.scales, w.fmt, (n, k)), torch.float32)
    y = x.float() @ wf.T
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype)

