"""The MX linear weights' layout for the kernels (see PLANES): int32 word planes whose bit
placement lets a pair of elements decode to a bf16x2 word with one set of 32-bit ops, in spread
groups over k, stored tile-major where the groups are 16 words. `prepare_mx_weight` builds it once,
at load; `canonical_data` gives the canonical bytes back; `format_args` are the constexprs a
kernel takes for a weight."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .mx import MXTensor, get_format, pack_codes, unpack_codes
from .triton_compat import triton

# The kernels' layout: word groups of E elements of a row, in P int32 planes [P, N, K // E].
# Element e = 2u + h of a group sits in the half h of its word(s) (bit 16h up), so the two
# elements of a pair (2u, 2u + 1) are decoded to a bf16x2 word with one set of 32-bit ops.
# Each field sits where the fewest shifts move it to its bf16 bit (sign 15; magnitude from bit
# F - MBITS up, F = 7): a field already there is kept with one AND, fields that need the same
# shift share it.
#   FP4 (E 8, P 1):  magnitude (code & 7) at plane 0, bit MAG[u] + 16h; sign (code >> 3) at
#                    bit SIGN[u] + 16h (HIGH_BITS). Pair 0 is in place (one AND), pair 1 needs
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
# data movement between threads, and each pair needs one scale per row (mx_tiles.spread_tile4).
PLANES = {4: (8, 1), 8: (8, 2), 6: (16, 3)}  # bits -> (E, P)
MAX_GROUP = 16


# Tile-major planes (weights in spread groups of 16): each plane is stored as [N / TILE_ROWS,
# K / E / 16, TILE_ROWS, 16] words (rows padded to a whole tile with zeros), so a decode step's
# [rows, 16]-word tile is one contiguous run and a program's steps follow one another; the
# kernels address words through word_offsets: it raises the load ceilings past L2, most for
# FP6 (bench/results/mx_decode_probe.tiled_load.md). TILE_ROWS divides every tensor-core decode
# tile (64, 128 rows).
TILE_ROWS = 64


# format -> (MAG, SIGN): per pair u % 4, the bit of the (top 3) magnitude bits' LSB and of the
# sign in each half; the kernels hold them as nibble constants (placed_bits)
HIGH_BITS = {"e2m1": ((6, 0, 3, 11), (15, 9, 10, 14)), "e2m3": ((6, 0, 3, 11), (15, 9, 10, 14)),
              "e3m2": ((7, 3, 0, 12), (15, 11, 6, 10))}


LOW_SLOTS = (2, 1, 0, 3, 4, 5, 6, 7)  # FP6: per pair u, the 2-bit slot of code & 3 (plane 2)


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
    mag, sign = HIGH_BITS[fmt]
    if bits == 4:
        return [(0, mag[u] + 16 * h, 3, 0), (0, sign[u] + 16 * h, 1, 3)]
    return [(u // 4, mag[u % 4] + 16 * h, 3, 2), (u // 4, sign[u % 4] + 16 * h, 1, 5),
            (2, 2 * LOW_SLOTS[u] + 16 * h, 2, 0)]


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


def prepare_mx_weight(w: MXTensor, tiled: bool = True) -> MXLinearWeight:
    """Re-arrange a canonical [N, K] MXTensor for the linear kernels (a copy). Reads the scales
    once (a device sync): call at load. tiled False keeps spread groups of 16 row-major (the
    kernels read either; tests compare the two)."""
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
    tile = TILE_ROWS if tiled and group == MAX_GROUP else 0
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


def as_linear_weight(w: MXTensor | MXLinearWeight) -> MXLinearWeight:
    return w if isinstance(w, MXLinearWeight) else prepare_mx_weight(w)


def format_args(w: MXLinearWeight) -> dict:
    f = get_format(w.fmt)
    e, p = PLANES[f.bits]
    return dict(EBITS=f.ebits, MBITS=f.mbits, NAN_CODE=0x7F if w.fmt == "e4m3" else -1, E=e, P=p,
                S=w.group, FOLD=w.fold, TILE=w.tile)
