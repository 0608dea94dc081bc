"""kernels/gemv.py under the Triton interpreter: the few-row dense linear against an fp32
reference (different summation order: within one rounding of the output dtype), on odd shapes
(K not a power of 2, N not a multiple of the program's rows, M past MAX_ROWS, the largest K),
with bias, fp16, strided and 3-D x; the add + RMSNorm prologue against layer_ops' reference
(the new residual exact, the old one untouched); and the errors."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

from mxserve.kernels import gemv as gemv_mod  # noqa: E402
from mxserve.kernels.gemv import MAX_K, gemv, gemv_after_norm  # noqa: E402
from mxserve.kernels.layer_ops import add_rms_norm_torch_  # noqa: E402


def _reference(x, w, bias):
    y = x.float() @ w.float().T
    return y + bias.float() if bias is not None else y


def _check(got, x, w, bias):
    ref = _reference(x, w, bias)
    assert got.dtype == x.dtype and got.shape == ref.shape
    # one rounding of the output dtype (bf16: 2^-8 relative), plus fp32 sums in another order
    ulp = 2.0**-8 if x.dtype == torch.bfloat16 else 2.0**-11
    err = (got.float() - ref).abs()
    assert (err <= ref.abs() * ulp + 1e-4).all(), err.max()


@pytest.mark.parametrize("m,n,k", [(1, 37, 576), (3, 64, 1536), (5, 9, 2048), (2, 3, MAX_K),
                                   (1, 300, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_matches_the_fp32_reference(m, n, k, dtype):
    gen = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    _check(gemv(x, w, backend="triton"), x, w, None)


def test_gemv_adds_the_bias_and_keeps_leading_dims():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 576, generator=gen).to(torch.bfloat16)
    w = (torch.randn(40, 576, generator=gen) * 0.05).to(torch.bfloat16)
    bias = torch.randn(40, generator=gen).to(torch.bfloat16)
    got = gemv(x, w, bias, backend="triton")
    assert got.shape == (2, 3, 40)
    _check(got.view(6, 40), x.view(6, 576), w, bias)


def test_gemv_reads_strided_rows_of_x():
    gen = torch.Generator().manual_seed(2)
    big = torch.randn(3, 2 * 256, generator=gen).to(torch.bfloat16)
    x = big[:, :256]  # row stride 512
    w = (torch.randn(24, 256, generator=gen) * 0.05).to(torch.bfloat16)
    _check(gemv(x, w, backend="triton"), x.contiguous(), w, None)


def test_gemv_every_program_configuration_gives_the_same_rows():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 200, generator=gen).to(torch.bfloat16)
    w = (torch.randn(33, 200, generator=gen) * 0.05).to(torch.bfloat16)
    outs = [gemv(x, w, backend="triton", config=(bn, 4)) for bn in (1, 2, 8, 32)]
    for out in outs:
        _check(out, x, w, None)


def test_gemv_on_cpu_by_default_is_f_linear():
    x = torch.randn(2, 64).to(torch.bfloat16)
    w = torch.randn(8, 64).to(torch.bfloat16)
    assert torch.equal(gemv(x, w), torch.nn.functional.linear(x, w))


def test_gemv_rejects_what_it_cannot_multiply():
    w = torch.zeros(8, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="16-bit"):
        gemv(torch.zeros(1, 64), w.float(), backend="triton")
    with pytest.raises(ValueError, match="one dtype"):
        gemv(torch.zeros(1, 64, dtype=torch.float16), w, backend="triton")
    with pytest.raises(ValueError, match="K <="):
        gemv(torch.zeros(1, 63, dtype=torch.bfloat16), w, backend="triton")
    with pytest.raises(ValueError, match="contiguous rows"):
        gemv(torch.zeros(1, 8, dtype=torch.bfloat16), w.t(), backend="triton")
    wide = torch.zeros(2, MAX_K + 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="K <="):
        gemv(torch.zeros(1, MAX_K + 32, dtype=torch.bfloat16), wide, backend="triton")
    with pytest.raises(ValueError, match="bias"):
        gemv(torch.zeros(1, 64, dtype=torch.bfloat16), w, torch.zeros(7, dtype=torch.bfloat16),
             backend="triton")
    assert not gemv_mod.supported(torch.zeros(1, 64), w)


@pytest.mark.parametrize("m,n,k", [(1, 37, 576), (2, 20, 2048), (1, 5, 100)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_after_norm_is_add_rms_norm_then_the_linear(m, n, k, dtype):
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen).to(dtype)
    residual = (torch.randn(m, k, generator=gen) * 4).to(dtype)
    norm_w = (1 + torch.randn(k, generator=gen) * 0.1).to(dtype)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    kept = residual.clone()
    y, new_res = gemv_after_norm(x, residual, norm_w, 1e-5, w, bias, backend="triton")
    assert torch.equal(residual, kept)  # not in place: the other programs read it
    want_res = residual.clone()
    normed = add_rms_norm_torch_(x, want_res, norm_w, 1e-5)
    assert torch.equal(new_res, want_res)  # x + residual, rounded once
    _check(y, normed, w, bias)
    # the CPU default (torch references) agrees
    y_cpu, res_cpu = gemv_after_norm(x, residual, norm_w, 1e-5, w, bias)
    assert torch.equal(res_cpu, want_res) and torch.equal(residual, kept)
    _check(y_cpu, normed, w, bias)


def test_gemv_after_norm_rejects_mismatched_inputs():
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    w = torch.zeros(8, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="norm_weight"):
        gemv_after_norm(x, torch.zeros(2, 64, dtype=torch.bfloat16), x[0], 1e-6, w,
                        backend="triton")
    with pytest.raises(ValueError, match="norm_weight"):
        gemv_after_norm(x, x.clone(), torch.zeros(63, dtype=torch.bfloat16), 1e-6, w,
                        backend="triton")
