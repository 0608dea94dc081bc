"""The decoder layer's fused kernels against their torch references: kernels/layer_ops.py under the
Triton interpreter, and kernels/cpu_layer_ops.py (C, float32/bfloat16), which the model's CPU
paths (worker/model/layers.py) use; on float16 those paths are the plain-torch ones, bit for bit.

In-place kernels must change exactly their view; a NaN in any output fails.
Tolerance: fp32 1e-6 relative (summation order); 16-bit: one ulp of the value (a rounding of an
fp32 result that differs in its last bits may go the other way).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

from mxserve.kernels import cpu_layer_ops  # noqa: E402
from mxserve.kernels.layer_ops import (  # noqa: E402
    add_rms_norm_,
    add_rms_norm_torch_,
    apply_rotary_,
    apply_rotary_torch_,
    rms_norm,
    rms_norm_torch,
    silu_and_mul,
    silu_and_mul_torch,
)
from mxserve.worker.model.layers import RMSNorm, RotaryEmbedding  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ULP = {torch.float32: 1e-6, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not out.isnan().any()
    out, ref = out.float(), ref.float()
    assert ((out - ref).abs() <= ULP[dtype] * ref.abs() + 1e-6).all(), (out - ref).abs().max()


def model_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """The model's CPU path: the C ops (within close) where they serve dtype, else bit for bit."""
    if cpu_layer_ops.available(dtype):
        close(out, ref, dtype)
    else:
        assert torch.equal(out, ref)


def rand(*shape, dtype, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, hidden", [(1, 64), (5, 96), (3, 200)])
def test_rms_norm_and_fused_add_match_reference(dtype, num_tokens, hidden):
    x = rand(num_tokens, hidden, dtype=dtype, seed=1)
    weight = (1 + 0.1 * rand(hidden, dtype=torch.float32, seed=2)).to(dtype)
    close(rms_norm(x, weight, 1e-5, backend="triton"), rms_norm_torch(x, weight, 1e-5), dtype)
    residual = rand(num_tokens, hidden, dtype=dtype, seed=3)
    res_kernel, res_ref = residual.clone(), residual.clone()
    out = add_rms_norm_(x, res_kernel, weight, 1e-5, backend="triton")
    ref = add_rms_norm_torch_(x, res_ref, weight, 1e-5)
    assert torch.equal(res_kernel, res_ref) and torch.equal(res_ref, (residual + x))
    close(out, ref, dtype)
    if cpu_layer_ops.available(dtype):
        close(cpu_layer_ops.rms_norm(x, weight, 1e-5), rms_norm_torch(x, weight, 1e-5), dtype)
        res_c = residual.clone()
        close(cpu_layer_ops.add_rms_norm_(x, res_c, weight, 1e-5), ref, dtype)
        assert torch.equal(res_c, res_ref)
    # The model's CPU path computes the references' values.
    norm = RMSNorm(hidden, 1e-5, dtype)
    norm.weight.data.copy_(weight)
    res_cpu = residual.clone()
    model_close(norm(x, res_cpu), ref, dtype)
    assert torch.equal(res_cpu, res_ref)
    model_close(norm(x), rms_norm_torch(x, weight, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_q, num_kv, head_dim", [(4, 2, 16), (6, 2, 64), (3, 3, 32)])
def test_rotary_in_place_matches_reference_and_leaves_v_alone(dtype, num_q, num_kv, head_dim):
    rope = RotaryEmbedding(head_dim, 128, 10000.0, None)
    num_tokens = 7
    qkv = rand(num_tokens, num_q + 2 * num_kv, head_dim, dtype=dtype, seed=4)
    positions = torch.tensor([0, 5, 127, 3, 3, 64, 1])
    kernel, ref = qkv.clone(), qkv.clone()
    apply_rotary_(kernel[:, :num_q + num_kv], positions, rope.cos, rope.sin, backend="triton")
    apply_rotary_torch_(ref[:, :num_q + num_kv], positions, rope.cos, rope.sin)
    close(kernel, ref, dtype)
    assert torch.equal(kernel[:, num_q + num_kv:], qkv[:, num_q + num_kv:])  # v untouched
    assert torch.equal(kernel[0], qkv[0])  # position 0: the identity, exactly
    if cpu_layer_ops.available(dtype):
        c_ops = qkv.clone()
        cpu_layer_ops.apply_rotary_(c_ops[:, :num_q + num_kv], positions, rope.cos, rope.sin)
        close(c_ops, ref, dtype)
        assert torch.equal(c_ops[:, num_q + num_kv:], qkv[:, num_q + num_kv:])
        assert torch.equal(c_ops[0], qkv[0])
    cpu = qkv.clone()
    rope.prepare(positions)
    rope(cpu[:, :num_q + num_kv], positions)
    model_close(cpu, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, inter", [(1, 96), (4, 1500)])
def test_silu_and_mul_matches_reference(dtype, num_tokens, inter):
    x = rand(num_tokens, 2 * inter, dtype=dtype, seed=5) * 3
    close(silu_and_mul(x, backend="triton"), silu_and_mul_torch(x), dtype)
    if cpu_layer_ops.available(dtype):
        close(cpu_layer_ops.silu_and_mul(x), silu_and_mul_torch(x), dtype)
        wide = torch.full((num_tokens + 2, 2 * inter), float("nan"), dtype=dtype)
        wide[1:-1] = x  # strided rows of a bigger buffer, as the model's gate_up may be
        close(cpu_layer_ops.silu_and_mul(wide[1:-1]), silu_and_mul_torch(x), dtype)


def test_cpu_ops_serve_float32_and_bfloat16_here():
    """This machine (and CI's) has a C compiler: the C ops are what the model runs."""
    assert cpu_layer_ops.available(torch.float32) and cpu_layer_ops.available(torch.bfloat16)
    assert not cpu_layer_ops.available(torch.float16)


def test_bad_inputs_are_clear_errors():
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(x, torch.ones(7), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm_(x, torch.zeros(3, 8), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="last dim must be even"):
        silu_and_mul(torch.zeros(2, 7))
    with pytest.raises(ValueError, match="apply_rotary_"):
        apply_rotary_(torch.zeros(2, 2, 8), torch.zeros(2, dtype=torch.long),
                      torch.zeros(4, 3), torch.zeros(4, 3))
    with pytest.raises(ValueError, match="weight must be"):
        cpu_layer_ops.rms_norm(x, torch.ones(7), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        cpu_layer_ops.add_rms_norm_(x, torch.zeros(3, 8), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="last dim must be even"):
        cpu_layer_ops.silu_and_mul(torch.zeros(2, 7))
    with pytest.raises(ValueError, match="need 2-D CPU tensors"):
        cpu_layer_ops.silu_and_mul(torch.zeros(2, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="int64 positions"):
        cpu_layer_ops.apply_rotary_(torch.zeros(2, 2, 8), torch.zeros(2, dtype=torch.int32),
                                    torch.zeros(4, 4), torch.zeros(4, 4))
