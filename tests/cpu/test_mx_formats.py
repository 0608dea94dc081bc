"""MX quantize / dequantize (kernels/mx.py) against an independent, element-by-element reference.

The reference below is written from the OCP MX v1.0 text and ARCHITECTURE.md ("MX formats") in
plain Python with exact Fractions; it does not call into kernels/mx.py. Both backends (the torch
reference and the Triton kernels, run by the Triton interpreter) must match it bit for bit.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import bisect  # noqa: E402
import math  # noqa: E402
import zlib  # noqa: E402
from fractions import Fraction  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from mxserve.kernels.mx import FORMATS, MXTensor, dequantize_mx, quantize_mx  # noqa: E402

# ---------------------------------------------------------------- the per-spec reference

# name: (exponent bits, mantissa bits, emax, largest normal) as the spec tables give them
SPEC = {"e2m1": (2, 1, 2, 6.0), "e2m3": (2, 3, 2, 7.5), "e3m2": (3, 2, 4, 28.0),
        "e4m3": (4, 3, 8, 448.0)}
FMTS = list(SPEC)
BACKENDS = ["torch", "triton"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
POISON = 0xA5
# random scale bytes overflow fp16 (and 448 * 2^127 fp32) to inf, as on a GPU; numpy warns
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


def spec_value(fmt: str, code: int) -> float:
    """Value of an element code; NaN for e4m3's S.1111.111."""
    e, m, _, _ = SPEC[fmt]
    bias = 2 ** (e - 1) - 1
    sign = -1.0 if code >> (e + m) else 1.0
    mag = code & (2 ** (e + m) - 1)
    if fmt == "e4m3" and mag == 0x7F:
        return math.nan
    exp, man = mag >> m, mag & (2**m - 1)
    if exp == 0:
        return sign * man * 2.0 ** (1 - bias - m)
    return sign * (1 + man / 2**m) * 2.0 ** (exp - bias)


def spec_grid(fmt: str) -> list[tuple[Fraction, int]]:
    """All finite non-negative (value, code) pairs, ascending."""
    e, m, _, _ = SPEC[fmt]
    vals = [(spec_value(fmt, c), c) for c in range(2 ** (e + m))]
    return [(Fraction(v), c) for v, c in vals if not math.isnan(v)]


def spec_scale(block: list[float], fmt: str, mode: str) -> int:
    amax = max(abs(v) for v in block)
    if amax == 0:
        return -127
    _, _, emax, max_normal = SPEC[fmt]
    if mode == "floor":  # floor(log2(amax)) - emax; frexp is exact
        s = math.frexp(amax)[1] - 1 - emax
    else:  # ceil(log2(amax / max_normal)): the smallest s with amax <= max_normal * 2^s
        ratio, s = Fraction(amax) / Fraction(max_normal), -400
        while Fraction(2) ** s < ratio:
            s += 1
    return max(-127, min(127, s))


def spec_encode(v: float, s: int, fmt: str) -> int:
    """Nearest code to v / 2^s, ties to the even code, saturating; the sign bit follows v's."""
    e, m, _, _ = SPEC[fmt]
    grid = spec_grid(fmt)
    y = abs(Fraction(v)) / Fraction(2) ** s
    vals = [g for g, _ in grid]
    i = bisect.bisect_left(vals, y)
    if i == len(vals):
        code = grid[-1][1]
    elif vals[i] == y or i == 0:
        code = grid[i][1]
    else:
        lo, hi = grid[i - 1], grid[i]
        d_lo, d_hi = y - lo[0], hi[0] - y
        code = lo[1] if d_lo < d_hi or (d_lo == d_hi and lo[1] % 2 == 0) else hi[1]
    return code | (int(math.copysign(1.0, v) < 0) << (e + m))


def spec_pack(codes: list[int], fmt: str) -> list[int]:
    if fmt == "e2m1":  # element 2i in the low nibble
        return [codes[i] | codes[i + 1] << 4 for i in range(0, len(codes), 2)]
    if fmt in ("e2m3", "e3m2"):  # element i at bits 6i.. of a little-endian 24-bit word
        out = []
        for i in range(0, len(codes), 4):
            word = sum(c << (6 * j) for j, c in enumerate(codes[i:i + 4]))
            out += [word & 0xFF, word >> 8 & 0xFF, word >> 16]
        return out
    return list(codes)


def spec_quantize(x: torch.Tensor, fmt: str, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(data, scales) for a 2-D x, one row at a time, one 32-element block at a time."""
    data, scales = [], []
    for row in x.float().tolist():
        codes, row_scales = [], []
        for b in range(0, len(row), 32):
            block = row[b:b + 32]
            s = spec_scale(block, fmt, mode)
            row_scales.append(s + 127)
            codes += [spec_encode(v, s, fmt) for v in block]
        data.append(spec_pack(codes, fmt))
        scales.append(row_scales)
    return torch.tensor(data, dtype=torch.uint8), torch.tensor(scales, dtype=torch.uint8)


# ---------------------------------------------------------------- helpers

def poisoned_mx(x: torch.Tensor, fmt: str) -> MXTensor:
    *lead, k = x.shape
    nbytes = k * (1 + SPEC[fmt][0] + SPEC[fmt][1]) // 8
    return MXTensor(torch.full((*lead, nbytes), POISON, dtype=torch.uint8),
                    torch.full((*lead, k // 32), POISON, dtype=torch.uint8), fmt, tuple(x.shape))


def run_quantize(x, fmt, mode, backend):
    out = poisoned_mx(x, fmt) if backend == "triton" else None
    return quantize_mx(x, fmt, mode, backend=backend, out=out)


def seeded(*key) -> torch.Generator:
    """A generator seeded from the test's parameters: fresh inputs per case, reproducible."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def random_blocks(rows: int, k: int, gen: torch.Generator, max_exp: int = 20) -> torch.Tensor:
    """Normal values with a random power-of-two magnitude per block, some exact zeros."""
    x = torch.randn(rows, k, generator=gen)
    x *= torch.exp2(torch.randint(-max_exp, max_exp, (rows, k // 32, 1), generator=gen).float()) \
        .repeat_interleave(32, 1).reshape(rows, k)
    x[torch.rand(rows, k, generator=gen) < 0.05] = 0.0
    return x


def assert_matches_spec(x, fmt, mode, backend):
    got = run_quantize(x, fmt, mode, backend)
    data, scales = spec_quantize(x.reshape(-1, x.shape[-1]), fmt, mode)
    assert got.fmt == fmt and tuple(got.shape) == tuple(x.shape)
    assert torch.equal(got.scales.reshape(scales.shape), scales)
    assert torch.equal(got.data.reshape(data.shape), data)


# ---------------------------------------------------------------- quantize is bit-exact

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["floor", "ceil"])
@pytest.mark.parametrize("fmt", FMTS)
def test_quantize_random_matches_spec(fmt, mode, dtype, backend):
    x = random_blocks(3, 96, seeded(fmt, mode, dtype, backend),
                      max_exp=10 if dtype == torch.float16 else 20).to(dtype)
    assert_matches_spec(x, fmt, mode, backend)


def edge_blocks(fmt: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One 32-element block a row: zeros, subnormal results, ties, saturation, extreme amax."""
    _, _, emax, max_normal = SPEC[fmt]
    grid = [float(v) for v, _ in spec_grid(fmt)]
    mids = [(a + b) / 2 for a, b in zip(grid, grid[1:], strict=False)]  # exact ties
    k = 3  # block scale 2^k for the tie and subnormal rows: amax = 2^emax * 2^k
    rows = [
        [0.0] * 32,
        [-0.0] * 16 + [0.0] * 16,
        *[[2.0**emax * 2**k] + [(-1) ** i * v * 2**k for i, v in enumerate(mids[j:j + 31])]
          for j in range(0, len(mids), 31)],
        [max_normal * 2**k] + [v * 2**k * 2.0**-j for j in range(1, 11) for v in (1, 0.75, 1.25)],
        [(2.0**(emax + 1) - 2.0**-10) * 2**k, max_normal * 2**k * 1.01, -max_normal * 2**k * 1.5,
         (max_normal + 2.0**(emax - 4)) * 2**k],
        [2.0**-127, 1.5 * 2**-127, -(2.0**-130), 2.0**-149, 3 * 2.0**-149],
        [2.0**-126, -(2.0**-127), 2.0**-133],
        [2.0**-149] * 3,
        [2.0**127, 1.5 * 2**127, -(2.0**100), 1.0],
        [torch.finfo(dtype).max, -torch.finfo(dtype).max, 2.0**120],
        [1.0] * 32,
        [-(2.0**-20)] * 32,
    ]
    return torch.tensor([r + [r[i % len(r)] * 0.5 for i in range(32 - len(r))] for r in rows]) \
        .to(dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["floor", "ceil"])
@pytest.mark.parametrize("fmt", FMTS)
def test_quantize_edge_cases_match_spec(fmt, mode, dtype, backend):
    x = edge_blocks(fmt, dtype)
    assert_matches_spec(x, fmt, mode, backend)
    got = run_quantize(x, fmt, mode, backend)
    assert got.scales[0].item() == 0 and got.scales[1].item() == 0  # all-zero blocks -> byte 0


@pytest.mark.parametrize("fmt", FMTS)
def test_spec_table_and_module_table_agree(fmt):
    e, m, emax, max_normal = SPEC[fmt]
    assert max(float(v) for v, _ in spec_grid(fmt)) == max_normal
    f = FORMATS[fmt]
    assert (f.ebits, f.mbits, f.emax, f.max_normal) == (e, m, emax, max_normal)


@pytest.mark.parametrize("backend", BACKENDS)
def test_quantize_keeps_leading_dims(backend):
    x = torch.randn(2, 3, 64)
    got = quantize_mx(x, "e2m3", backend=backend)
    assert got.shape == (2, 3, 64) and got.data.shape == (2, 3, 48)
    assert got.scales.shape == (2, 3, 2)
    assert torch.equal(got.data.reshape(6, 48), quantize_mx(x.reshape(6, 64), "e2m3").data)


# ---------------------------------------------------------------- dequantize

def spec_dequantize(t: MXTensor, dtype: torch.dtype) -> torch.Tensor:
    e, m, _, _ = SPEC[t.fmt]
    bits, rows = 1 + e + m, []
    for data_row, scale_row in zip(t.data.reshape(-1, t.data.shape[-1]).tolist(),
                                   t.scales.reshape(-1, t.scales.shape[-1]).tolist(), strict=True):
        word = sum(b << (8 * i) for i, b in enumerate(data_row))  # the row as one integer
        codes = [word >> (bits * i) & (2**bits - 1) for i in range(t.shape[-1])]
        scale = [math.nan if s == 255 else 2.0 ** (s - 127) for s in scale_row]
        rows.append([spec_value(t.fmt, c) * scale[i // 32] for i, c in enumerate(codes)])
    return torch.tensor(rows, dtype=torch.float64).to(dtype).reshape(t.shape)


def random_mx(fmt: str, shape: tuple[int, int], gen: torch.Generator, nan_bytes: bool) -> MXTensor:
    bits = 1 + SPEC[fmt][0] + SPEC[fmt][1]
    data = torch.randint(0, 256, (shape[0], shape[1] * bits // 8), generator=gen, dtype=torch.uint8)
    if fmt == "e4m3" and not nan_bytes:
        data[(data & 0x7F) == 0x7F] = 0x7E
    scales = torch.randint(0, 256 if nan_bytes else 255, (shape[0], shape[1] // 32), generator=gen,
                           dtype=torch.uint8)
    scales[0, 0] = 0  # 2^-127: element values times a subnormal scale
    return MXTensor(data, scales, fmt, shape)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FMTS)
def test_dequantize_matches_spec(fmt, dtype, backend):
    t = random_mx(fmt, (4, 64), seeded(fmt, dtype, backend), nan_bytes=False)
    out = torch.full(t.shape, math.nan, dtype=dtype)  # poison
    got = dequantize_mx(t, dtype, backend=backend, out=out)
    assert got.dtype == dtype and got.shape == t.shape
    torch.testing.assert_close(got, spec_dequantize(t, dtype), rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", FMTS)
def test_dequantize_nan_encodings(fmt, backend):
    t = random_mx(fmt, (4, 64), seeded(fmt, backend), nan_bytes=True)
    t.scales[1, 1] = 255
    out = torch.full(t.shape, 12345.0)  # poison that no MX value takes
    got = dequantize_mx(t, backend=backend, out=out)
    torch.testing.assert_close(got, spec_dequantize(t, torch.float32), rtol=0, atol=0,
                               equal_nan=True)
    assert got[1, 32:64].isnan().all()


def roundtrip_bound(x: torch.Tensor, fmt: str, mode: str) -> torch.Tensor:
    """Per-element |dequantize(quantize(x)) - x| allowed: half a quantum of the element's binade
    (the subnormal quantum below the normal range), or the distance to the saturated max."""
    e, m, emax, max_normal = SPEC[fmt]
    emin = 2 - 2 ** (e - 1)
    xb = x.double().reshape(*x.shape[:-1], -1, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    s = torch.tensor([[[spec_scale(b, fmt, mode)] for b in r] for r in xb.tolist()],
                     dtype=torch.float64)
    y = xb.abs() / torch.exp2(s)
    binade = torch.frexp(y).exponent.double().sub(1).clamp(min=emin)
    half_quantum = torch.exp2(binade - m - 1)
    bound = torch.where(y > max_normal, y - max_normal, half_quantum) * torch.exp2(s)
    assert mode == "floor" or (y <= max_normal).all()  # ceil never clips
    return torch.where(amax == 0, 0.0, bound).reshape(x.shape)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["floor", "ceil"])
@pytest.mark.parametrize("fmt", FMTS)
def test_roundtrip_error_within_format_bound(fmt, mode, backend):
    x = torch.cat([random_blocks(3, 64, seeded(fmt, mode, backend)),
                   edge_blocks(fmt).reshape(-1, 64)])
    t = quantize_mx(x, fmt, mode, backend=backend)
    got = dequantize_mx(t, backend=backend).double()
    # ceil mode may round fp32's max up to 2^128, an MX value that dequantizes to inf in fp32
    too_big = spec_dequantize(t, torch.float64).abs() > torch.finfo(torch.float32).max
    assert got[too_big].isinf().all() and (mode == "ceil" or not too_big.any())
    err = torch.where(too_big, 0.0, (got - x.double()).abs())
    assert (err <= roundtrip_bound(x, fmt, mode)).all()
    # and the coarse, block-level statement: error at most amax * 2^-mbits, where the scale
    # is not clamped at 2^-127
    amax = x.abs().reshape(-1, 32).amax(-1).repeat_interleave(32).reshape(x.shape).double()
    assert (err <= amax * 2.0 ** -SPEC[fmt][1])[amax > 2.0**-100].all()


# ---------------------------------------------------------------- bad inputs

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad, match", [
    (float("nan"), "NaN/Inf"), (float("inf"), "NaN/Inf"), (float("-inf"), "NaN/Inf")])
def test_quantize_rejects_non_finite(bad, match, backend):
    x = torch.randn(2, 64)
    x[1, 5] = bad
    with pytest.raises(ValueError, match=match):
        quantize_mx(x, "e2m1", backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("x, fmt, mode, match", [
    (torch.randn(2, 33), "e2m1", "floor", "multiple of 32"),
    (torch.randn(2, 48), "e2m1", "floor", "multiple of 32"),
    (torch.tensor(1.0), "e2m1", "floor", "multiple of 32"),
    (torch.ones(2, 32, dtype=torch.int32), "e2m1", "floor", "dtype"),
    (torch.ones(2, 32, dtype=torch.float64), "e2m1", "floor", "dtype"),
    (torch.ones(2, 32), "e5m2", "floor", "unknown MX element format"),
    (torch.ones(2, 32), "e2m1", "round", "scale_mode"),
])
def test_quantize_rejects_bad_inputs(x, fmt, mode, match, backend):
    with pytest.raises(ValueError, match=match):
        quantize_mx(x, fmt, mode, backend=backend)


def test_dequantize_rejects_bad_inputs():
    t = quantize_mx(torch.randn(2, 64), "e2m1")
    with pytest.raises(ValueError, match="dtype"):
        dequantize_mx(t, torch.int32)
    with pytest.raises(ValueError, match="MXTensor"):
        dequantize_mx(torch.zeros(2, 32, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        MXTensor(t.data[:, :-1], t.scales, "e2m1", (2, 64))
    with pytest.raises(ValueError, match="backend"):
        quantize_mx(torch.randn(2, 64), "e2m1", backend="cuda")
