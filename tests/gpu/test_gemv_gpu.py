"""kernels/gemv.py on CUDA at the decode shapes of the 1B and 8B models, M = 1..8, against an
fp32 reference (within one bf16 rounding), with a bias; and the model's dense linears take it
for a few rows and cuBLAS past MAX_ROWS (same values either way, within that rounding)."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from mxserve.kernels import gemv as gemv_mod  # noqa: E402
from mxserve.worker.model.layers import RMSNorm  # noqa: E402
from mxserve.worker.model.parallel import ColumnParallelLinear, TPGroup  # noqa: E402

SHAPES = [(3072, 2048), (2048, 8192), (128256, 2048), (6144, 4096), (4096, 14336), (37, 576)]


def _within_one_rounding(got, ref):
    err = (got.float() - ref).abs()
    assert (err <= ref.abs() * 2.0**-8 + 1e-3).all(), err.max()


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 3, 8])
def test_gemv_matches_fp32_at_real_shapes(n, k, m):
    gen = torch.Generator(device="cuda").manual_seed(n + k + m)
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    bias = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16)
    _within_one_rounding(gemv_mod.gemv(x, w), x.float() @ w.float().T)
    _within_one_rounding(gemv_mod.gemv(x, w, bias), x.float() @ w.float().T + bias.float())


def test_model_linear_uses_gemv_for_a_few_rows_and_cublas_past_them(monkeypatch):
    lin = ColumnParallelLinear(2048, [1024, 512], True, TPGroup(), torch.bfloat16, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    lin.weight.data.copy_(torch.randn(1536, 2048, device="cuda", generator=gen) * 0.02)
    lin.bias.data.copy_(torch.randn(1536, device="cuda", generator=gen))
    calls = []
    real = gemv_mod.gemv
    monkeypatch.setattr(gemv_mod, "gemv", lambda *a, **kw: calls.append(a[0].shape[0])
                        or real(*a, **kw))
    for m in (1, gemv_mod.MAX_ROWS, gemv_mod.MAX_ROWS + 1, 64):
        x = torch.randn(m, 2048, device="cuda", generator=gen).to(torch.bfloat16)
        ref = x.float() @ lin.weight.float().T + lin.bias.float()
        _within_one_rounding(lin(x), ref)
    assert calls == [1, gemv_mod.MAX_ROWS]


def test_forward_after_norm_fuses_one_row_and_matches_the_two_steps():
    gen = torch.Generator(device="cuda").manual_seed(1)
    norm = RMSNorm(2048, 1e-5, torch.bfloat16, "cuda")
    norm.weight.data.copy_(1 + torch.randn(2048, device="cuda", generator=gen) * 0.1)
    lin = ColumnParallelLinear(2048, [3072], False, TPGroup(), torch.bfloat16, "cuda")
    lin.weight.data.copy_(torch.randn(3072, 2048, device="cuda", generator=gen) * 0.02)
    for rows in (1, 2):
        h = torch.randn(rows, 2048, device="cuda", generator=gen).to(torch.bfloat16)
        residual = (torch.randn(rows, 2048, device="cuda", generator=gen) * 4).to(torch.bfloat16)
        want_res = residual.clone()
        x = norm(h, want_res)
        y, new_res = lin.forward_after_norm(h, residual, norm)
        assert torch.equal(new_res, want_res)
        assert (new_res is residual) == (rows > gemv_mod.MAX_ROWS)  # fused: a new tensor
        _within_one_rounding(y, x.float() @ lin.weight.float().T)
