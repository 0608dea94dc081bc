"""4-bit CPU weights (worker/model/int4.py): the grid, the kernel, where the engine uses them."""

from __future__ import annotations

import pytest
import torch

from mxserve import LLM, SamplingParams
from mxserve.worker.model.int4 import (
    dequantize_int4_torch,
    int4_linear,
    int4_supported,
    quantize_int4,
)
from mxserve.worker.model.parallel import ColumnParallelLinear, RowParallelLinear

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
    reason="the packed CPU path needs oneDNN bf16")


def q4_1_weight(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A GGUF Q4_1-style weight w = d * q + m (groups of 32) whose values, d and m + 8d are all
    exact in bf16, with q = 0 and 15 in every group (as llama.cpp's quantizer makes them).
    Returns (w bf16 [N, K], q [N, K])."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g)
    q[..., 3], q[..., 17] = 0, 15
    d = torch.randint(1, 9, (n, k // 32, 1), generator=g) / 256
    m = -torch.randint(0, 9, (n, k // 32, 1), generator=g) / 64
    return (q * d + m).view(n, k).bfloat16(), q.view(n, k)


def test_a_q4_1_grid_is_kept_exactly():
    w, _ = q4_1_weight(64, 128)
    assert torch.equal(dequantize_int4_torch(w), w.float())


def test_kernel_matches_the_dequantized_reference():
    w = (torch.randn(96, 160) * 0.1).bfloat16()
    x = torch.randn(3, 160).bfloat16()
    ref = x.float() @ dequantize_int4_torch(w).T
    y = int4_linear(x, quantize_int4(w))
    assert y.dtype == torch.bfloat16 and y.shape == (3, 96)
    assert ((y.float() - ref).norm() / ref.norm()) < 4e-3  # bf16 output rounding
    # the 4-bit grid is coarse but bounded: half a step of each group's range / 15
    err = (dequantize_int4_torch(w) - w.float()).abs().view(96, 5, 32)
    span = w.float().view(96, 5, 32).aminmax(dim=-1)
    assert (err.amax(-1) <= (span.max - span.min) / 30 * 1.05 + 1e-3).all()


def test_bias_is_added():
    w, bias = (torch.randn(32, 64) * 0.1).bfloat16(), torch.randn(32).bfloat16()
    x = torch.randn(2, 64).bfloat16()
    wi = quantize_int4(w)
    assert torch.allclose(int4_linear(x, wi, bias).float(),
                          int4_linear(x, wi).float() + bias.float(), atol=2e-2)


def test_shapes_the_kernel_cannot_take_are_refused():
    assert int4_supported(torch.zeros(64, 64, dtype=torch.bfloat16))
    assert not int4_supported(torch.zeros(40, 64, dtype=torch.bfloat16))  # N % 16
    assert not int4_supported(torch.zeros(64, 48, dtype=torch.bfloat16))  # K % 32
    assert not int4_supported(torch.zeros(64, 64, dtype=torch.float32))


def _linears(llm):
    return [m for m in llm.engine.runner.model.modules()
            if isinstance(m, ColumnParallelLinear | RowParallelLinear)]


def test_engine_uses_int4_for_small_batches_and_bf16_for_large(tiny_checkpoint):
    llm = LLM(model=tiny_checkpoint(), dtype="bfloat16", cpu_int4=True, load_progress=False)
    layer = _linears(llm)[0]
    assert layer.int4 is not None and layer.packed is not None
    w_int4 = dequantize_int4_torch(_dense_qkv(tiny_checkpoint()))
    most = layer.int4.max_rows  # 16 on AMX (kernels/cpu_int4.py), else torch's kernel's 8
    for rows in (1, most, most + 1, 32):
        x = torch.randn(rows, layer.int4.shape[1]).bfloat16()
        y = layer(x).float()
        int4_ref = x.float() @ w_int4.T
        int4_err = ((y - int4_ref).norm() / int4_ref.norm()).item()
        assert (int4_err < 4e-3) == (rows <= most), (rows, int4_err)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8,
                                                   ignore_eos=True))[0]
    assert len(out.token_ids) == 8


def _dense_qkv(path) -> torch.Tensor:
    """The bf16 weight the first decoder linear (layer 0's fused qkv) was packed from."""
    from safetensors.torch import load_file

    t = load_file(str(path / "model.safetensors"))
    p = "model.layers.0.self_attn."
    return torch.cat([t[p + f"{x}_proj.weight"] for x in "qkv"]).bfloat16()


def test_default_is_int4_only_for_a_4_bit_gguf(tiny_checkpoint):
    dense = LLM(model=tiny_checkpoint(), dtype="bfloat16", load_progress=False)
    assert all(m.int4 is None for m in _linears(dense))
    smollm2 = LLM(dtype="bfloat16", load_progress=False)  # its linears are Q4_1
    assert all(m.int4 is not None for m in _linears(smollm2))
    off = LLM(dtype="bfloat16", cpu_int4=False, load_progress=False)
    assert all(m.int4 is None for m in _linears(off))
