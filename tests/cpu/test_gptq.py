"""GPTQ for MX weights (worker/model/gptq.py) and `mxserve quantize --method gptq`.

GPTQ with uncorrelated inputs (H diagonal) has no error to spread and must be round-to-nearest
bit for bit; with correlated inputs it must move the layer's outputs less than round-to-nearest.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from mxserve import LLM, SamplingParams
from mxserve.cluster import cli
from mxserve.kernels.mx import (
    dequantize_mx_torch,
    quantize_mx_torch,
    quantize_with_exponents,
    round_to_grid,
)
from mxserve.worker.model.gptq import collect_hessians, gptq_mx
from mxserve.worker.model.llama import LlamaForCausalLM
from mxserve.worker.model.loader import open_checkpoint
from mxserve.worker.model.quantize import quantize_checkpoint

FORMATS = ["e2m1", "e2m3", "e3m2"]


def _weights(n=48, k=256, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    w[3, 40] = 9.0  # an outlier: its block's scale differs by mode
    mix = torch.randn(k, k, generator=gen) / k ** 0.5 + torch.eye(k)
    x = torch.randn(4096, k, generator=gen) @ mix  # correlated inputs
    return w, x


def _output_error(x, w, mx) -> float:
    ref = x.double() @ w.double().T
    return ((x.double() @ dequantize_mx_torch(mx).double().T - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("mode", ["floor", "ceil"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_round_to_grid_is_what_quantize_stores(fmt, mode):
    w, _ = _weights()
    q = quantize_mx_torch(w, fmt, mode)
    s = q.scales.long() - 127
    scale = torch.exp2(s.double()).repeat_interleave(32, dim=1)
    assert torch.equal(round_to_grid(w.double() / scale, fmt) * scale,
                       dequantize_mx_torch(q).double())
    again = quantize_with_exponents(w, fmt, s)  # the same scales given back
    assert torch.equal(again.data, q.data) and torch.equal(again.scales, q.scales)


@pytest.mark.parametrize("mode", ["floor", "ceil"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_diagonal_hessian_is_round_to_nearest(fmt, mode):
    w, _ = _weights()
    h = torch.diag(torch.rand(w.shape[1], generator=torch.Generator().manual_seed(1)) + 0.5)
    got, want = gptq_mx(w, h, fmt, mode), quantize_mx_torch(w, fmt, mode)
    assert torch.equal(got.data, want.data) and torch.equal(got.scales, want.scales)


@pytest.mark.parametrize("fmt", FORMATS)
def test_gptq_moves_the_outputs_less_than_round_to_nearest(fmt):
    w, x = _weights()
    h = x.double().T @ x.double() / x.shape[0]
    gptq = _output_error(x, w, gptq_mx(w, h, fmt, "ceil"))
    rtn = _output_error(x, w, quantize_mx_torch(w, fmt, "ceil"))
    assert gptq < 0.85 * rtn, (gptq, rtn)


def test_unused_input_columns_are_zeroed_and_bad_shapes_refused():
    w, x = _weights()
    x[:, 64:96] = 0  # one whole block of inputs never used
    h = x.double().T @ x.double() / x.shape[0]
    got = dequantize_mx_torch(gptq_mx(w, h, "e2m1"))
    assert (got[:, 64:96] == 0).all() and (got[:, :64] != 0).any()
    with pytest.raises(ValueError, match="multiple of 32"):
        gptq_mx(w[:, :40], h[:40, :40], "e2m1")
    with pytest.raises(ValueError, match="hessian"):
        gptq_mx(w, h[:32, :32], "e2m1")
    with pytest.raises(ValueError, match=r"\[\.\.\., K // 32\]"):
        quantize_with_exponents(w, "e2m1", torch.zeros(48, 3, dtype=torch.long))


def test_hessians_are_the_layer_inputs_gram_matrices(tiny_checkpoint):
    """Layer 0's q/k/v input is RMSNorm(embedding), computed here from the checkpoint's tensors."""
    path = tiny_checkpoint("llama")
    ckpt = open_checkpoint(str(path))
    model = LlamaForCausalLM(ckpt.config, dtype=torch.float32)
    model.load_weights(ckpt.weights(progress=False))
    windows = [[5, 17, 42, 9, 100, 3], list(range(3, 40))]
    hs = collect_hessians(model, windows)
    layers = ckpt.config.num_hidden_layers
    names = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    assert set(hs) == {f"model.layers.{i}.{n}.weight" for i in range(layers) for n in names}
    p = "model.layers.0."
    assert hs[p + "self_attn.q_proj.weight"] is hs[p + "self_attn.v_proj.weight"]
    tensors = load_file(f"{path}/model.safetensors")
    emb = tensors["model.embed_tokens.weight"].double()[sum(windows, [])]
    x = emb * torch.rsqrt(emb.pow(2).mean(-1, keepdim=True) + ckpt.config.rms_norm_eps)
    x = x * tensors[p + "input_layernorm.weight"].double()
    torch.testing.assert_close(hs[p + "self_attn.q_proj.weight"], x.T @ x / x.shape[0],
                               rtol=1e-5, atol=1e-6)
    down = hs[p + "mlp.down_proj.weight"]
    assert down.shape == (ckpt.config.intermediate_size,) * 2 and torch.equal(down, down.T)


def test_quantize_method_gptq_writes_a_served_checkpoint(tiny_checkpoint, tmp_path, capsys):
    src = str(tiny_checkpoint("llama"))
    text = tmp_path / "calibration.txt"
    gen = torch.Generator().manual_seed(0)
    text.write_text(" ".join(f"w{i}" for i in torch.randint(3, 256, (600,), generator=gen)))
    gptq = quantize_checkpoint(src, "mxfp4", str(tmp_path / "gptq"), progress=False,
                               method="gptq", calibration=str(text), window=128)
    rtn = quantize_checkpoint(src, "mxfp4", str(tmp_path / "rtn"), progress=False)
    with open(f"{gptq}/config.json") as f:
        assert json.load(f)["quantization_config"]["method"] == "gptq"
    a, b = load_file(f"{gptq}/model.safetensors"), load_file(f"{rtn}/model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight_mx"
    assert a[name].shape == b[name].shape and not torch.equal(a[name], b[name])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = LLM(model=gptq, dtype="float32", num_kv_blocks=32, load_progress=False).generate(
        [[5, 17, 42, 9]], params)
    assert len(out[0].token_ids) == 8
    with pytest.raises(ValueError, match="needs calibration"):
        quantize_checkpoint(src, "mxfp4", str(tmp_path / "x"), method="gptq")
    with pytest.raises(ValueError, match="'awq'"):
        quantize_checkpoint(src, "mxfp4", str(tmp_path / "y"), method="awq")
    assert cli.main(["quantize", "--model", src, "--format", "mxfp4", "--out", str(tmp_path / "z"),
                          "--method", "gptq"]) == 2
    assert "needs calibration" in capsys.readouterr().err
