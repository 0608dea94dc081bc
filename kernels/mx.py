"""OCP Microscaling (MX v1.0) formats: quantize / dequantize, Triton kernels and torch references.

The bit-exact contract is ARCHITECTURE.md, "MX formats": blocks of 32 elements along the last axis
share one E8M0 scale byte (2^(byte-127), 0xFF = NaN); elements round to nearest, ties to even, and
saturate. Canonical packing (what files and the wire use):

    FP4  two codes a byte, element 2i in the low nibble             data [..., K // 2]
    FP6  four codes in three bytes, element i at bits 6i..6i+5 of
         the little-endian 24-bit word                              data [..., K * 3 // 4]
    FP8  one code a byte                                            data [..., K]
    code = sign << (ebits + mbits) | exp << mbits | man             scales [..., K // 32]

Scale modes: "floor" (the OCP rule, the default) = floor(log2(amax)) - emax, clamped to
[-127, 127], an all-zero block -> byte 0; "ceil" = the smallest s with amax <= max_normal * 2^s
(never clips; a block whose amax is within half a step of fp32's max may round to 2^128, which
dequantizes to inf in fp32). Negative inputs keep their sign bit when they round to zero (-0
codes), as in IEEE rounding. Elements below the scale's reach (blocks clamped at 2^-127) round to 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .triton_compat import cast_out, interpreted_bf16, tl, to_f32, triton, use_triton

BLOCK_SIZE = 32  # elements sharing one scale byte
SCALE_MODES = ("floor", "ceil")
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class MXFormat:
    """One element format. e4m3 has no infinities: 0x7F/0xFF are NaN, so its max is 1.75 * 2^8."""

    name: str
    ebits: int
    mbits: int

    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits

    @property
    def bias(self) -> int:
        return 2 ** (self.ebits - 1) - 1

    @property
    def emin(self) -> int:  # exponent of the smallest normal; subnormals share its quantum
        return 1 - self.bias

    @property
    def max_code(self) -> int:  # largest finite magnitude code
        return 2 ** (self.ebits + self.mbits) - (2 if self.name == "e4m3" else 1)

    @property
    def emax(self) -> int:
        return (self.max_code >> self.mbits) - self.bias

    @property
    def max_mant_bits(self) -> int:  # fraction bits of max_normal, aligned to fp32's 23
        return (self.max_code & (2**self.mbits - 1)) << (23 - self.mbits)

    @property
    def max_normal(self) -> float:
        return (1 + self.max_mant_bits / 2**23) * 2.0**self.emax

    @property
    def pack(self) -> int:  # codes per packing group
        return {4: 2, 6: 4, 8: 1}[self.bits]

    @property
    def group_bytes(self) -> int:  # bytes per packing group
        return self.pack * self.bits // 8

    def packed_len(self, k: int) -> int:
        return k // self.pack * self.group_bytes


FORMATS = {f.name: f for f in (MXFormat("e2m1", 2, 1), MXFormat("e2m3", 2, 3),
                               MXFormat("e3m2", 3, 2), MXFormat("e4m3", 4, 3))}


def get_format(fmt: str) -> MXFormat:
    if fmt not in FORMATS:
        raise ValueError(f"unknown MX element format {fmt!r}; expected one of {sorted(FORMATS)}")
    return FORMATS[fmt]


@dataclass(frozen=True)
class MXTensor:
    """A tensor of logical `shape` [..., K] in MX format, canonical packing."""

    data: torch.Tensor  # uint8 [..., fmt.packed_len(K)]
    scales: torch.Tensor  # uint8 E8M0 [..., K // 32]
    fmt: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        f = get_format(self.fmt)
        *lead, k = self.shape
        for name, t, last in (("data", self.data, f.packed_len(k)),
                              ("scales", self.scales, k // BLOCK_SIZE)):
            if t.dtype != torch.uint8 or tuple(t.shape) != (*lead, last):
                raise ValueError(f"MXTensor.{name} must be uint8 {(*lead, last)}, "
                                 f"got {t.dtype} {tuple(t.shape)}")


# ---------------------------------------------------------------- validation and dispatch

def _check_input(x: torch.Tensor, fmt: str, scale_mode: str) -> MXFormat:
    f = get_format(fmt)
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"scale_mode must be one of {SCALE_MODES}, got {scale_mode!r}")
    if x.dtype not in INPUT_DTYPES:
        raise ValueError(f"quantize_mx: dtype must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] % BLOCK_SIZE:
        raise ValueError(f"quantize_mx: last dim K must be a multiple of {BLOCK_SIZE}, "
                         f"got shape {tuple(x.shape)}")
    num_bad = int((~torch.isfinite(x)).sum())  # a device sync: quantize at load, not per step
    if num_bad:
        raise ValueError(f"quantize_mx: input has {num_bad} NaN/Inf values; MX needs finite input")
    return f


# ---------------------------------------------------------------- shared Triton helpers

@triton.jit
def _shared_exponent(amax, EMAX: tl.constexpr, MAX_MANT: tl.constexpr, CEIL: tl.constexpr):
    """Scale exponent in [-127, 127] from a block's fp32 amax (0 or subnormal -> -127)."""
    bits = amax.to(tl.int32, bitcast=True)
    s = ((bits >> 23) & 0xFF) - 127 - EMAX  # floor(log2(amax)) - emax for normal amax
    if CEIL:  # smallest s with amax <= max_normal * 2^s
        s += ((bits & 0x7FFFFF) > MAX_MANT).to(tl.int32)
    return tl.minimum(tl.maximum(s, -127), 127)


@triton.jit
def _encode(x, s, EBITS: tl.constexpr, MBITS: tl.constexpr, MAX_CODE: tl.constexpr):
    """Element codes of fp32 x / 2^s: integer round-half-even on fp32 bits, then saturate."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    mag = bits & 0x7FFFFFFF
    # (sig, e): |x| = sig * 2^(e - 150) with sig in [2^23, 2^24); fp32 subnormals are normalised
    # through an exact int -> float conversion of their fraction.
    sub_bits = mag.to(tl.float32).to(tl.int32, bitcast=True)
    is_sub = mag < 0x800000
    e = tl.where(is_sub, (sub_bits >> 23) - 149, mag >> 23)
    sig = tl.where(is_sub, sub_bits & 0x7FFFFF, mag & 0x7FFFFF) | 0x800000
    emin = 2 - (1 << (EBITS - 1))
    ey = e - 127 - s  # floor(log2(|x| / 2^s))
    ee = tl.maximum(ey, emin)  # binade whose quantum applies (subnormals use emin's)
    sh = tl.minimum(23 - MBITS + ee - ey, 25)  # sig >> 25 rounds to 0 like any larger shift
    q = sig >> sh
    rem = sig & ((1 << sh) - 1)
    half = 1 << (sh - 1)
    q += ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    code = tl.minimum(q + ((ee - emin) << MBITS), MAX_CODE)
    return code | (sign << (EBITS + MBITS))


@triton.jit
def _decode(code, EBITS: tl.constexpr, MBITS: tl.constexpr, NAN_CODE: tl.constexpr):
    """fp32 element values of int32 codes, by bit ops (no table). NAN_CODE < 0: format has none."""
    exp = (code >> MBITS) & ((1 << EBITS) - 1)
    man = code & ((1 << MBITS) - 1)
    bias = (1 << (EBITS - 1)) - 1
    normal = ((exp + 127 - bias) << 23) | (man << (23 - MBITS))
    step = tl.full(code.shape, (128 - bias - MBITS) << 23, tl.int32).to(tl.float32, bitcast=True)
    v = tl.where(exp == 0, man.to(tl.float32) * step, normal.to(tl.float32, bitcast=True))
    v = tl.where(((code >> (EBITS + MBITS)) & 1) == 1, -v, v)
    if NAN_CODE >= 0:
        nan = tl.full(code.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
        v = tl.where((code & ((1 << (EBITS + MBITS)) - 1)) == NAN_CODE, nan, v)
    return v


@triton.jit
def _scale_value(byte):
    """fp32 2^(byte - 127) of int32 E8M0 bytes; 0 -> 2^-127 (subnormal), 0xFF -> NaN."""
    bits = tl.where(byte == 0, 0x400000, tl.where(byte == 255, 0x7FC00000, byte << 23))
    return bits.to(tl.float32, bitcast=True)


# ---------------------------------------------------------------- quantize

@triton.jit
def _quantize_mx_kernel(
    # pointers: x is contiguous [num_blocks * 32]; data [num_blocks * bytes a block]; scales
    x_ptr, data_ptr, scales_ptr,
    # sizes
    num_blocks,
    # element format
    EBITS: tl.constexpr, MBITS: tl.constexpr, EMAX: tl.constexpr, MAX_CODE: tl.constexpr,
    MAX_MANT: tl.constexpr, PACK: tl.constexpr, GROUP_BYTES: tl.constexpr, CEIL: tl.constexpr,
    # tiling; INTERP_BF16: see to_f32
    BLOCK_B: tl.constexpr, INTERP_BF16: tl.constexpr,
):
    GROUPS: tl.constexpr = 32 // PACK
    blocks = (tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)
    bmask = blocks < num_blocks
    cols = tl.arange(0, 32)
    x = tl.load(x_ptr + blocks[:, None] * 32 + cols[None, :], mask=bmask[:, None], other=0.0)
    s = _shared_exponent(tl.max(tl.abs(to_f32(x, INTERP_BF16)), axis=1), EMAX, MAX_MANT, CEIL)
    tl.store(scales_ptr + blocks, (s + 127).to(tl.uint8), mask=bmask)

    g = tl.arange(0, GROUPS)
    word = tl.zeros((BLOCK_B, GROUPS), dtype=tl.int32)
    for t in tl.static_range(PACK):  # element g * PACK + t is code t of group g
        xt = to_f32(tl.load(x_ptr + blocks[:, None] * 32 + g[None, :] * PACK + t,
                             mask=bmask[:, None], other=0.0), INTERP_BF16)
        word |= _encode(xt, s[:, None], EBITS, MBITS, MAX_CODE) << (t * (1 + EBITS + MBITS))
    out = data_ptr + blocks[:, None] * (GROUPS * GROUP_BYTES) + g[None, :] * GROUP_BYTES
    for b in tl.static_range(GROUP_BYTES):  # little-endian bytes of each group's word
        tl.store(out + b, ((word >> (8 * b)) & 0xFF).to(tl.uint8), mask=bmask[:, None])


def quantize_mx(x: torch.Tensor, fmt: str, scale_mode: str = "floor", *, backend: str = "auto",
                out: MXTensor | None = None) -> MXTensor:
    """Quantize x [..., K] (fp32/bf16/fp16, finite, K % 32 == 0) to MX `fmt`, canonical layout.

    backend: "auto" (Triton on CUDA, torch on CPU), "triton" or "torch"; bit-identical results.
    Raises ValueError on a bad format, mode, dtype, K or NaN/Inf input (the NaN/Inf check syncs
    the device: quantize at load). `out` (optional) receives the result in place."""
    f = _check_input(x, fmt, scale_mode)
    if not use_triton(backend, x):
        ref = _quantize_torch(x, f, scale_mode)
        if out is not None:
            out.data.copy_(ref.data)
            out.scales.copy_(ref.scales)
        return ref if out is None else out
    *lead, k = x.shape
    if out is None:
        out = MXTensor(torch.empty(*lead, f.packed_len(k), dtype=torch.uint8, device=x.device),
                       torch.empty(*lead, k // BLOCK_SIZE, dtype=torch.uint8, device=x.device),
                       fmt, tuple(x.shape))
    if not (out.data.is_contiguous() and out.scales.is_contiguous()
            and (out.fmt, tuple(out.shape)) == (fmt, tuple(x.shape))):
        raise ValueError(f"quantize_mx: out must be a contiguous {fmt} MXTensor of x's shape")
    num_blocks = x.numel() // BLOCK_SIZE
    block_b = 64
    if num_blocks:
        _quantize_mx_kernel[(triton.cdiv(num_blocks, block_b),)](
            x.contiguous(), out.data, out.scales, num_blocks,
            EBITS=f.ebits, MBITS=f.mbits, EMAX=f.emax, MAX_CODE=f.max_code,
            MAX_MANT=f.max_mant_bits, PACK=f.pack, GROUP_BYTES=f.group_bytes,
            CEIL=scale_mode == "ceil", BLOCK_B=block_b, INTERP_BF16=interpreted_bf16(x.dtype, x))
    return out


def pack_codes(codes: torch.Tensor, f: MXFormat) -> torch.Tensor:
    """[..., K] int64 codes -> [..., packed_len(K)] uint8, canonical layout."""
    groups = codes.reshape(*codes.shape[:-1], -1, f.pack)  # [..., K // pack, pack]
    word = (groups << (torch.arange(f.pack, device=codes.device) * f.bits)).sum(-1)
    nbytes = (word[..., None] >> (8 * torch.arange(f.group_bytes, device=codes.device))) & 0xFF
    return nbytes.reshape(*codes.shape[:-1], -1).to(torch.uint8)


def unpack_codes(data: torch.Tensor, f: MXFormat) -> torch.Tensor:
    """[..., packed_len(K)] uint8 -> [..., K] int64 codes."""
    groups = data.reshape(*data.shape[:-1], -1, f.group_bytes).long()
    word = (groups << (8 * torch.arange(f.group_bytes, device=data.device))).sum(-1)
    codes = (word[..., None] >> (torch.arange(f.pack, device=data.device) * f.bits))
    return (codes & (2**f.bits - 1)).reshape(*data.shape[:-1], -1)


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """Exact float64 2^e of integer e (torch.ldexp would round through float32)."""
    return torch.exp2(e.to(torch.float64))


def quantize_mx_torch(x: torch.Tensor, fmt: str, scale_mode: str = "floor") -> MXTensor:
    """Reference: exact float64 arithmetic (x / 2^s is exact), torch.round = ties to even."""
    return _quantize_torch(x, _check_input(x, fmt, scale_mode), scale_mode)


def scale_exponent(amax: torch.Tensor, fmt: str, scale_mode: str = "floor") -> torch.Tensor:
    """int64 s of the E8M0 scale 2^s (byte s + 127) that quantize_mx gives a block whose largest
    magnitude is amax (float64, >= 0, finite)."""
    f = get_format(fmt)
    s = torch.frexp(amax).exponent.long() - 1 - f.emax  # floor(log2(amax)) - emax
    if scale_mode == "ceil":
        s = s + (amax > f.max_normal * _pow2(s)).long()
    return torch.where(amax == 0, -127, s).clamp(-127, 127)


def _round_magnitudes(y: torch.Tensor, f: MXFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Magnitudes y (float64, already divided by the block scale) to the grid of f, ties to
    even: (ee, q), the value q * 2^(ee - mbits) before saturation."""
    ee = torch.where(y == 0, f.emin, (torch.frexp(y).exponent.long() - 1).clamp(min=f.emin))
    return ee, torch.round(y * _pow2(f.mbits - ee)).long()


def round_to_grid(y: torch.Tensor, fmt: str) -> torch.Tensor:
    """float64: each element of y (already divided by its block's scale) as the nearest `fmt`
    value, ties to even, saturating: what quantize_mx stores for it, decoded."""
    f = get_format(fmt)
    y = y.double()
    ee, q = _round_magnitudes(y.abs(), f)
    mag = torch.clamp(q * _pow2(ee - f.mbits), max=f.max_normal)
    return torch.where(torch.signbit(y), -mag, mag)


def _quantize_torch(x: torch.Tensor, f: MXFormat, scale_mode: str) -> MXTensor:
    xb = x.double().reshape(*x.shape[:-1], -1, BLOCK_SIZE)  # [..., K // 32, 32]
    return _encode_blocks(x, scale_exponent(xb.abs().amax(-1), f.name, scale_mode), f)


def quantize_with_exponents(x: torch.Tensor, fmt: str, s: torch.Tensor) -> MXTensor:
    """x [..., K] as an MXTensor whose block scales are 2^s (s int64 [..., K // 32], in
    [-127, 127]) instead of ones quantize_mx picks: each element x / 2^s rounded to the grid as
    quantize_mx rounds it (GPTQ, worker/model/gptq.py, chooses its own scales). x may also be
    float64 (GPTQ's working precision)."""
    f = _check_input(x.float() if x.dtype == torch.float64 else x, fmt, "floor")
    if s.shape != (*x.shape[:-1], x.shape[-1] // BLOCK_SIZE) or s.min() < -127 or s.max() > 127:
        raise ValueError(f"quantize_with_exponents: s must be [..., K // 32] in [-127, 127], "
                         f"got {tuple(s.shape)} for x {tuple(x.shape)}")
    return _encode_blocks(x, s.long(), f)


def _encode_blocks(x: torch.Tensor, s: torch.Tensor, f: MXFormat) -> MXTensor:
    xb = x.double().reshape(*x.shape[:-1], -1, BLOCK_SIZE)
    ee, q = _round_magnitudes(xb.abs() * _pow2(-s[..., None]), f)
    codes = (q + ((ee - f.emin) << f.mbits)).clamp(max=f.max_code)
    codes = codes | (torch.signbit(xb).long() << (f.ebits + f.mbits))
    data = pack_codes(codes.reshape(x.shape), f)
    return MXTensor(data, (s + 127).to(torch.uint8), f.name, tuple(x.shape))


# ---------------------------------------------------------------- dequantize

@triton.jit
def _dequantize_mx_kernel(
    # pointers: data [num_blocks * bytes a block]; scales [num_blocks]; out contiguous
    data_ptr, scales_ptr, out_ptr,
    # sizes
    num_blocks,
    # element format
    EBITS: tl.constexpr, MBITS: tl.constexpr, NAN_CODE: tl.constexpr, PACK: tl.constexpr,
    GROUP_BYTES: tl.constexpr,
    # tiling; INTERP_BF16: see cast_out
    BLOCK_B: tl.constexpr, INTERP_BF16: tl.constexpr,
):
    GROUPS: tl.constexpr = 32 // PACK
    blocks = (tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)
    bmask = blocks < num_blocks
    g = tl.arange(0, GROUPS)
    src = data_ptr + blocks[:, None] * (GROUPS * GROUP_BYTES) + g[None, :] * GROUP_BYTES
    word = tl.zeros((BLOCK_B, GROUPS), dtype=tl.int32)
    for b in tl.static_range(GROUP_BYTES):
        word |= tl.load(src + b, mask=bmask[:, None], other=0).to(tl.int32) << (8 * b)
    scale = _scale_value(tl.load(scales_ptr + blocks, mask=bmask, other=127).to(tl.int32))
    for t in tl.static_range(PACK):
        code = (word >> (t * (1 + EBITS + MBITS))) & ((1 << (1 + EBITS + MBITS)) - 1)
        v = _decode(code, EBITS, MBITS, NAN_CODE) * scale[:, None]
        tl.store(out_ptr + blocks[:, None] * 32 + g[None, :] * PACK + t,
                 cast_out(v, out_ptr.dtype.element_ty, INTERP_BF16), mask=bmask[:, None])


def _check_mx(t: MXTensor, dtype: torch.dtype) -> MXFormat:
    if not isinstance(t, MXTensor):
        raise ValueError(f"dequantize_mx expects an MXTensor, got {type(t).__name__}")
    if dtype not in INPUT_DTYPES:
        raise ValueError(f"dequantize_mx: dtype must be float32, bfloat16 or float16, got {dtype}")
    return get_format(t.fmt)


def dequantize_mx(t: MXTensor, dtype: torch.dtype = torch.float32, *, backend: str = "auto",
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Values of `t` as `dtype` [t.shape]: exact in fp32, then one rounding to `dtype`."""
    f = _check_mx(t, dtype)
    if not use_triton(backend, t.data):
        ref = dequantize_mx_torch(t, dtype)
        return ref if out is None else out.copy_(ref)
    if out is None:
        out = torch.empty(t.shape, dtype=dtype, device=t.data.device)
    if not out.is_contiguous() or tuple(out.shape) != tuple(t.shape) or out.dtype != dtype:
        raise ValueError(f"dequantize_mx: out must be contiguous {dtype} {tuple(t.shape)}")
    num_blocks = t.scales.numel()
    block_b = 64
    if num_blocks:
        _dequantize_mx_kernel[(triton.cdiv(num_blocks, block_b),)](
            t.data.contiguous(), t.scales.contiguous(), out, num_blocks,
            EBITS=f.ebits, MBITS=f.mbits, NAN_CODE=0x7F if f.name == "e4m3" else -1,
            PACK=f.pack, GROUP_BYTES=f.group_bytes, BLOCK_B=block_b,
            INTERP_BF16=interpreted_bf16(dtype, out))
    return out


def element_values(fmt: str) -> torch.Tensor:
    """float64 [2^bits] value of every code of `fmt` (NaN for e4m3's NaN codes)."""
    f = get_format(fmt)
    codes = torch.arange(2**f.bits)
    exp, man = (codes >> f.mbits) & (2**f.ebits - 1), codes & (2**f.mbits - 1)
    mag = torch.where(exp == 0, man.double() * 2.0 ** (f.emin - f.mbits),
                      (1 + man.double() / 2**f.mbits) * _pow2(exp - f.bias))
    vals = torch.where(codes >> (f.ebits + f.mbits) == 1, -mag, mag)
    if f.name == "e4m3":
        vals[(codes & 0x7F) == 0x7F] = float("nan")
    return vals


def dequantize_mx_torch(t: MXTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reference: table lookup of element values times 2^(byte-127), in float64."""
    f = _check_mx(t, dtype)
    codes = unpack_codes(t.data, f)  # [..., K]
    vals = element_values(t.fmt).to(codes.device)[codes]
    vals = vals.reshape(*codes.shape[:-1], -1, BLOCK_SIZE)  # [..., K // 32, 32]
    s = t.scales.long()
    scale = torch.where(s == 255, float("nan"), _pow2(s - 127))
    return (vals * scale[..., None]).reshape(t.shape).to(dtype)
