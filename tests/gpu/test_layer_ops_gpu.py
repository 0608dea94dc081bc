"""The fused layer kernels (kernels/layer_ops.py) compiled on the GPU at Llama shapes, against
their torch references (which tests/cpu/test_layer_ops.py ties to the model's CPU paths)."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from mxserve.kernels.layer_ops import (  # noqa: E402
    add_rms_norm_,
    add_rms_norm_torch_,
    apply_rotary_,
    apply_rotary_torch_,
    silu_and_mul,
    silu_and_mul_torch,
)
from mxserve.worker.model.layers import RotaryEmbedding  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]
ULP = {torch.float32: 1e-6, torch.bfloat16: 2.0**-7}


def close(out, ref, dtype):
    assert not out.isnan().any()
    out, ref = out.float(), ref.float()
    assert ((out - ref).abs() <= ULP[dtype] * ref.abs() + 1e-6).all(), (out - ref).abs().max()


def rand(*shape, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, generator=gen, device="cuda").to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
@pytest.mark.parametrize("hidden, inter, heads", [(2048, 8192, (32, 8, 64)),
                                                   (4096, 14336, (32, 8, 128))])
def test_layer_kernels_match_references(dtype, num_tokens, hidden, inter, heads):
    x, residual = rand(num_tokens, hidden, dtype=dtype, seed=1), rand(num_tokens, hidden,
                                                                      dtype=dtype, seed=2)
    weight = (1 + 0.1 * rand(hidden, dtype=torch.float32, seed=3)).to(dtype)
    res_k, res_r = residual.clone(), residual.clone()
    close(add_rms_norm_(x, res_k, weight, 1e-5), add_rms_norm_torch_(x, res_r, weight, 1e-5),
          dtype)
    assert torch.equal(res_k, res_r)
    gate_up = rand(num_tokens, 2 * inter, dtype=dtype, seed=4) * 3
    close(silu_and_mul(gate_up), silu_and_mul_torch(gate_up), dtype)
    num_q, num_kv, head_dim = heads
    rope = RotaryEmbedding(head_dim, 8192, 500000.0, None, "cuda")
    qkv = rand(num_tokens, num_q + 2 * num_kv, head_dim, dtype=dtype, seed=5)
    positions = torch.randint(0, 8192, (num_tokens,), device="cuda")
    kernel, ref = qkv.clone(), qkv.clone()
    apply_rotary_(kernel[:, :num_q + num_kv], positions, rope.cos, rope.sin)
    apply_rotary_torch_(ref[:, :num_q + num_kv], positions, rope.cos, rope.sin)
    close(kernel, ref, dtype)
    assert torch.equal(kernel[:, num_q + num_kv:], qkv[:, num_q + num_kv:])


@pytest.mark.parametrize("rows", [1, 7, 64, 512])
def test_argmax_rows_matches_torch_at_llama3_vocab(rows):
    from mxserve.kernels.sampling_ops import argmax_rows

    gen = torch.Generator(device="cuda").manual_seed(rows)
    logits = torch.randn(rows, 128256, device="cuda", generator=gen)
    logits[0, 5] = logits[0, 100000] = 1e4  # a tie across chunks: the first
    assert torch.equal(argmax_rows(logits), logits.argmax(-1))
