"""mx_linear (kernels/mx_linear.py): both Triton paths, under the Triton interpreter, against the
reference mx_linear_torch (exact dequantize, fp32 matmul), and that reference against an
independent one built from dequantize_mx (itself checked bit-exact in test_mx_formats.py).

Tolerance (the documented contract): |y - ref| <= RTOL[dtype] * (|x| @ |w|.T + |bias|), i.e. fp32
summation-order error for fp32 outputs and one rounding of the output for 16-bit ones.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import math  # noqa: E402
import zlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from mxserve.kernels.mx import dequantize_mx, quantize_mx  # noqa: E402
from mxserve.kernels.mx_decode import TC_DECODE_MAX_M, launch_decode  # noqa: E402
from mxserve.kernels.mx_layout import (  # noqa: E402
    TILE_ROWS,
    MXLinearWeight,
    canonical_data,
    prepare_mx_weight,
)
from mxserve.kernels.mx_linear import mx_linear, mx_linear_torch  # noqa: E402
from mxserve.kernels.mx_prefill import dequantize_linear_weight  # noqa: E402

FMTS = ["e2m1", "e2m3", "e3m2", "e4m3"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
RTOL = {torch.float32: 1e-5, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def seeded(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def make_case(fmt, dtype, m, n, k, with_bias, gen, lead=()):
    w = quantize_mx(torch.randn(n, k, generator=gen) * 0.05, fmt)
    x = torch.randn(*lead, m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    return x, w, bias


def assert_close_to_ref(y, x, w, bias):
    ref = mx_linear_torch(x, w, bias)
    assert y.shape == ref.shape and y.dtype == x.dtype and not y.isnan().any()
    wf = dequantize_mx(w).double()
    mag = x.double().abs() @ wf.abs().T + (0 if bias is None else bias.double().abs())
    err = (y.double() - ref.double()).abs()
    assert (err <= RTOL[x.dtype] * mag + 1e-30).all(), f"max err {err.max().item():.3g}"


def run(x, w, bias, **kwargs):
    out = torch.full((*x.shape[:-1], w.shape[0]), math.nan, dtype=x.dtype)  # poison
    y = mx_linear(x, prepare_mx_weight(w), bias, backend="triton", out=out, **kwargs)
    assert y.data_ptr() == out.data_ptr()
    return y


# ---------------------------------------------------------------- the reference itself

@pytest.mark.parametrize("fmt", FMTS)
def test_reference_is_dequantize_then_matmul(fmt):
    x, w, bias = make_case(fmt, torch.float32, 3, 24, 64, True, seeded(fmt))
    want = x.double() @ dequantize_mx(w).double().T + bias.double()
    torch.testing.assert_close(mx_linear_torch(x, w, bias).double(), want, rtol=1e-6, atol=1e-6)
    # the prepared (re-arranged) weight describes the same matrix
    torch.testing.assert_close(mx_linear_torch(x, prepare_mx_weight(w), bias),
                               mx_linear_torch(x, w, bias), rtol=0, atol=0)


# ---------------------------------------------------------------- decode path (M <= 16)

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("m, k, split_k, with_bias", [(1, 96, None, True), (1, 256, 3, False),
                                                      (3, 96, 2, False),
                                                      (8, 256, 2, True), (16, 96, 3, True)])
def test_decode_matches_reference(fmt, dtype, m, k, split_k, with_bias):
    x, w, bias = make_case(fmt, dtype, m, 40, k, with_bias, seeded(fmt, dtype, m))
    assert_close_to_ref(run(x, w, bias, path="decode", split_k=split_k), x, w, bias)


def test_decode_split_k_larger_than_k_blocks():
    x, w, bias = make_case("e2m1", torch.float32, 2, 8, 64, False, seeded("big split"))
    assert_close_to_ref(run(x, w, bias, path="decode", split_k=64), x, w, bias)


# ---------------------------------------------------------------- prefill path (M > 16)

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FMTS)
def test_prefill_matches_reference(fmt, dtype):
    # N and K not multiples of the tiles; K a multiple of 32
    x, w, bias = make_case(fmt, dtype, 37, 40, 96, True, seeded(fmt, dtype, "prefill"))
    assert_close_to_ref(run(x, w, bias, path="prefill", use_dot_scaled=False), x, w, bias)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", ["e2m1", "e4m3"])
def test_prefill_dot_scaled_matches_reference(fmt, dtype):
    x, w, bias = make_case(fmt, dtype, 20, 40, 96, True, seeded(fmt, dtype, "dot_scaled"))
    assert_close_to_ref(run(x, w, bias, path="prefill", use_dot_scaled=True), x, w, bias)


@pytest.mark.parametrize("path", ["auto", "decode", "prefill", "dequant"])
def test_leading_dims_and_auto_path(path):
    x, w, bias = make_case("e2m3", torch.bfloat16, 5, 24, 64, True, seeded(path), lead=(2,))
    y = run(x, w, bias, path=path)
    assert y.shape == (2, 5, 24)
    assert_close_to_ref(y, x, w, bias)


def test_empty_batch():
    x, w, _ = make_case("e2m1", torch.float32, 0, 8, 32, False, seeded("empty"))
    assert mx_linear(x, w, backend="triton").shape == (0, 8)


def test_prepare_rearranges_words_and_back():
    for fmt, shape in [("e2m1", (1, 8, 8)), ("e3m2", (3, 8, 4)), ("e2m3", (3, 8, 4)),
                       ("e4m3", (2, 8, 8))]:
        w = quantize_mx(torch.randn(8, 64), fmt)
        w.data.copy_(torch.randint(0, 256, w.data.shape, generator=seeded(fmt, "layout"),
                                   dtype=torch.uint8))
        p = prepare_mx_weight(w)
        assert isinstance(p, MXLinearWeight) and p.fold
        assert p.planes.shape == shape and p.planes.dtype == torch.int32
        assert torch.equal(canonical_data(p), w.data)  # the layout is a permutation of bits
    # FP4, K = 32 (spread groups of S = 4 words): pair u of word jj holds k = 8u + 2jj + h; in
    # half h of the word its magnitude (3 bits) sits at bit 6, 0, 3, 11 and its sign at bit 15,
    # 9, 10, 14 for u = 0..3. Codes here: 0.5 -> 1, 1 -> 2, ..., 6 -> 7, -0.5 -> 8 + 1.
    w = quantize_mx(torch.tensor([[0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5] * 4]), "e2m1")
    p = prepare_mx_weight(w)

    def half(mag: int, sign: int) -> int:
        return sum(mag << b for b in (6, 0, 3, 11)) | sum(sign << b for b in (15, 9, 10, 14))
    assert half(1, 0) == 0x0849 and half(7, 0) == 0x39FF and half(1, 1) == 0xCE49
    assert p.group == 4 and p.planes[0, 0, 0].item() == 0x1092_0849  # codes 1 (h 0), 2 (h 1)
    assert p.planes[0, 0, 1].item() == (half(4, 0) << 16 | half(3, 0))
    assert p.planes[0, 0, 3].item() == 0xCE49_39FF - 2**32  # codes 7 and 8 + 1
    assert prepare_mx_weight(quantize_mx(torch.randn(2, 256), "e2m3")).group == 16


def test_spread_groups_of_16_are_stored_tile_major():
    """Weights in spread groups of 16 keep their planes tile-major: [N / 64, K / E / 16, 64, 16]
    words (rows padded to a whole tile with zeros), so each decode step's [rows, 16] words are
    one contiguous run; the canonical bytes come back exactly."""
    n, k = 70, 512
    w = quantize_mx(torch.randn(n, k, generator=seeded("tiled")), "e2m3")
    p = prepare_mx_weight(w)
    assert p.group == 16 and p.tile == TILE_ROWS == 64
    assert p.planes.shape == (3, 128, 32)
    planes = prepare_mx_weight(w, tiled=False).planes  # the same weight, row-major
    assert planes.shape == (3, n, 32)
    flat = p.planes.reshape(3, -1)
    for r, j in [(0, 0), (5, 17), (63, 31), (64, 0), (69, 16), (69, 31)]:
        at = ((r // 64) * 32 + (j // 16) * 16) * 64 + (r % 64) * 16 + j % 16
        assert torch.equal(flat[:, at], planes[:, r, j])
    assert (p.planes.view(3, 2, 2, 64, 16)[:, 1, :, n - 64:] == 0).all()  # the padding rows
    assert torch.equal(canonical_data(p), w.data)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("path", ["decode", "prefill"])
def test_large_and_nan_scales(fmt, path):
    """Scale bytes above 127 + bias (no folded 2^(scale - bias) factor), byte 0 (2^-127) and
    0xFF (NaN): every output row that meets a NaN scale is NaN, the others match."""
    gen = seeded(fmt, path, "scales")
    x, w, bias = make_case(fmt, torch.float32, 3 if path == "decode" else 20, 24, 128, True, gen)
    w.scales.copy_(torch.randint(100, 140, w.scales.shape, generator=gen, dtype=torch.uint8))
    w.scales[0, 0] = 0
    w.scales[1, :] = 150
    p = prepare_mx_weight(w)
    assert not p.fold
    assert_close_to_ref(run(x, w, bias, path=path, use_dot_scaled=False), x, w, bias)
    w.scales[5, 1] = 255
    y = run(x, w, bias, path=path, use_dot_scaled=False)
    assert y[:, 5].isnan().all() and not y[:, :5].isnan().any() and not y[:, 6:].isnan().any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FMTS)
def test_dequantize_linear_weight_matches_dequantize_mx(fmt, dtype):
    w = quantize_mx(torch.randn(40, 96, generator=seeded(fmt, "deq")), fmt)
    w.data.copy_(torch.randint(0, 256, w.data.shape, generator=seeded(fmt), dtype=torch.uint8))
    got = dequantize_linear_weight(prepare_mx_weight(w), dtype, backend="triton")
    torch.testing.assert_close(got, dequantize_mx(w, dtype, backend="torch"), rtol=0, atol=0,
                               equal_nan=True)


def test_split_k_counters_rearm():
    """The in-launch split-K reduction leaves its counters at zero, so calls can repeat."""
    x, w, bias = make_case("e2m1", torch.float32, 1, 40, 256, True, seeded("rearm"))
    p = prepare_mx_weight(w)
    for m in (1, 5):
        for _ in range(2):
            xm = x.expand(m, -1).contiguous()
            out = torch.full((m, 40), math.nan)
            y = mx_linear(xm, p, bias, backend="triton", path="decode", split_k=4, out=out)
            assert_close_to_ref(y, xm, w, bias)
            assert int(p.counters.abs().sum()) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dequant_path(dtype):
    x, w, bias = make_case("e2m3", dtype, 33, 40, 96, True, seeded("dequant", dtype))
    assert_close_to_ref(run(x, w, bias, path="dequant"), x, w, bias)


# ---------------------------------------------------------------- bad inputs

@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_rejects_bad_inputs(backend):
    w = quantize_mx(torch.randn(8, 64), "e2m1")
    with pytest.raises(ValueError, match="dtype"):
        mx_linear(torch.ones(2, 64, dtype=torch.int32), w, backend=backend)
    with pytest.raises(ValueError, match="does not match"):
        mx_linear(torch.randn(2, 96), w, backend=backend)
    with pytest.raises(ValueError, match="bias"):
        mx_linear(torch.randn(2, 64), w, torch.randn(9), backend=backend)
    with pytest.raises(ValueError, match="path"):
        mx_linear(torch.randn(2, 64), w, backend=backend, path="gemv")
    with pytest.raises(ValueError, match="2-D"):
        prepare_mx_weight(quantize_mx(torch.randn(2, 8, 64), "e2m1"))


def test_dot_scaled_needs_fp4_or_fp8_and_16_bit_x():
    w = quantize_mx(torch.randn(8, 64), "e2m3")
    with pytest.raises(ValueError, match="dot_scaled"):
        mx_linear(torch.randn(20, 64).bfloat16(), w, backend="triton", path="prefill",
                  use_dot_scaled=True)
    w = quantize_mx(torch.randn(8, 64), "e2m1")
    with pytest.raises(ValueError, match="dot_scaled"):
        mx_linear(torch.randn(20, 64), w, backend="triton", path="prefill", use_dot_scaled=True)


@pytest.mark.parametrize("fmt", ["e2m1", "e2m3", "e3m2"])
@pytest.mark.parametrize("m, k, split_k, fold", [(1, 256, None, True), (3, 768, 2, True),
                                                (16, 512, 1, False), (40, 256, 2, True)])
def test_decode_tensor_core_kernel(fmt, m, k, split_k, fold):
    """The tensor-core decode kernel (bf16 x, spread groups of 16) under the interpreter: the
    pure-Triton stand-in for its inline asm, up to 64 rows of x in one program (M = 40),
    split-K (FP6 at K = 768: a shorter last split),
    N not a multiple of the tile (clamped rows), scale bytes above 127 + bias (no fold), byte
    0, and a NaN scale (the NaN-checking build, chosen at prepare)."""
    gen = seeded(fmt, m, k, "tc")
    x, w, bias = make_case(fmt, torch.bfloat16, m, 24, k, True, gen)
    if not fold:
        w.scales.copy_(torch.randint(100, 140, w.scales.shape, generator=gen, dtype=torch.uint8))
        w.scales[0, 0] = 0
        w.scales[1, :] = 150
    p = prepare_mx_weight(w)
    assert p.group == 16 and p.fold == fold and not p.nan_scales
    out = torch.full((m, 24), math.nan, dtype=torch.bfloat16)
    launch_decode(x, p, out, bias, split_k, tc=True)
    assert_close_to_ref(out, x, w, bias)
    w.scales[5, 1] = 255
    p = prepare_mx_weight(w)
    assert p.nan_scales
    out.fill_(math.nan)
    launch_decode(x, p, out, bias, split_k, tc=True)
    assert out[:, 5].isnan().all() and not out[:, :5].isnan().any() and \
        not out[:, 6:].isnan().any()


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("m, split_k", [(1, 1), (1, 2), (5, 1), (5, 3)])
def test_decode_prefetch_variant(fmt, m, split_k):
    """The decode kernel's PREFETCH variant (next tile's words loaded ahead) computes the same."""
    x, w, bias = make_case(fmt, torch.float32, m, 40, 512, True, seeded(fmt, m, "prefetch"))
    out = torch.full((m, 40), math.nan)
    launch_decode(x, prepare_mx_weight(w), out, bias, split_k, prefetch=True)
    assert_close_to_ref(out, x, w, bias)


def test_tensor_core_decode_refuses_what_it_cannot_run():
    """tc=True on e4m3 weights or more than TC_DECODE_MAX_M rows: a clear ValueError."""
    w = prepare_mx_weight(quantize_mx(torch.randn(16, 256), "e2m1"))
    x = torch.randn(TC_DECODE_MAX_M + 1, 256).bfloat16()
    out = torch.empty(x.shape[0], 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="at most 64 rows"):
        launch_decode(x, w, out, None, None, tc=True)
    w8 = prepare_mx_weight(quantize_mx(torch.randn(16, 256), "e4m3"))
    with pytest.raises(ValueError, match="no e4m3"):
        launch_decode(x[:4], w8, out[:4], None, None, tc=True)


# ---------------------------------------------------------------- float32 outputs (logits)

@pytest.mark.parametrize("path", ["decode", "prefill"])
def test_float32_out_from_bf16_x(path):
    """out_dtype float32 (the MX LM head's logits): the decode path keeps its fp32 sums, so they
    match the fp32 reference to summation order, far closer than bf16 rounding; other paths
    round to bf16 first and say so in their dtype only."""
    x, w, bias = make_case("e2m1", torch.bfloat16, 3, 48, 128, True, seeded("f32", path))
    y = mx_linear(x, prepare_mx_weight(w), bias, backend="triton", path=path,
                  out_dtype=torch.float32)
    ref = mx_linear_torch(x, w, bias, out_dtype=torch.float32)
    assert y.dtype == ref.dtype == torch.float32
    mag = x.double().abs() @ dequantize_mx(w).double().abs().T + bias.double().abs()
    err = (y.double() - ref.double()).abs()
    if path == "decode":
        assert (err <= 1e-5 * mag).all(), f"max err {err.max().item():.3g}"
        assert not torch.equal(y, y.bfloat16().float())  # not rounded to bf16
    else:
        assert torch.equal(y, y.bfloat16().float())
        assert (err <= RTOL[torch.bfloat16] * mag).all()
    with pytest.raises(ValueError, match="out_dtype"):
        mx_linear(x, prepare_mx_weight(w), out_dtype=torch.float16)
