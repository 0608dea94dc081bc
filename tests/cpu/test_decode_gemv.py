"""kernels/decode_gemv.py under the Triton interpreter against its torch reference (layer_ops'
references, then F.linear): each prologue, 1..16 rows, K not a multiple of the tile, rows of W
past the last program's end. The prologue is bit-exact (the new residual is compared exactly);
the product differs from F.linear's only in fp32 summation order: one ulp of the output."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

from mxserve.kernels.decode_gemv import decode_gemv, decode_gemv_torch  # noqa: E402

ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def _close(out, ref, dtype):
    assert not out.isnan().any()
    out, ref = out.float(), ref.float()
    tol = ULP[dtype] * ref.abs() + ULP[dtype] * ref.abs().max() * 0.05
    assert ((out - ref).abs() <= tol).all(), (out - ref).abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("prologue,residual", [("none", False), ("rms_norm", False),
                                               ("rms_norm", True), ("silu_and_mul", False)])
@pytest.mark.parametrize("m,n,k", [(1, 40, 96), (3, 64, 320), (16, 33, 64)])
def test_decode_gemv_matches_the_reference(dtype, prologue, residual, m, n, k):
    gen = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, 2 * k if prologue == "silu_and_mul" else k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * 0.1).to(dtype)
    opts = {}
    if prologue == "rms_norm":
        opts["norm_weight"] = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype)
        opts["eps"] = 1e-5
        if residual:
            opts["residual"] = torch.randn(m, k, generator=gen).to(dtype)
    saved = {key: v.clone() for key, v in opts.items() if isinstance(v, torch.Tensor)}
    out, new_res = decode_gemv(x, w, prologue=prologue, backend="triton",
                               config=(16, 64, 4, 2), **opts)
    ref, ref_res = decode_gemv_torch(x, w, prologue=prologue, **opts)
    _close(out, ref, dtype)
    assert (new_res is None) == (ref_res is None)
    if residual:
        assert torch.equal(new_res, ref_res)
    assert all(torch.equal(opts[key], v) for key, v in saved.items())  # inputs untouched


def test_decode_gemv_rejects_bad_shapes_and_dtypes():
    x, w = torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="prologue"):
        decode_gemv(x, w, prologue="gelu", backend="triton")
    with pytest.raises(ValueError, match="bf16/fp16"):
        decode_gemv(x.float(), w.float(), backend="triton")
    with pytest.raises(ValueError, match=r"\[<= 16, 16\]"):
        decode_gemv(x, w, prologue="silu_and_mul", backend="triton")
    with pytest.raises(ValueError, match=r"\[<= 16, 8\]"):
        decode_gemv(torch.zeros(17, 8, dtype=torch.bfloat16), w, backend="triton")
    with pytest.raises(ValueError, match="norm_weight"):
        decode_gemv(x, w, prologue="rms_norm", backend="triton")
    with pytest.raises(ValueError, match="residual"):
        decode_gemv(x, w, residual=x, backend="triton")
