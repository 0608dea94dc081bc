"""The CPU LM-head kernel (kernels/cpu_linear.py): float32 logits from bf16 against a float64
reference, the same logits for a row whatever the batch, and its use by the model's LM head."""

from __future__ import annotations

import pytest
import torch

from mxserve.kernels import cpu_linear
from mxserve.kernels.cpu_linear import linear_f32, linear_f32_torch, pack_pairs

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="needs AVX512-BF16")


def rand(*shape, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


# N: a multiple of 32, of 16 only, and neither (padded); rows on both tilings (<= 4, > 4)
@pytest.mark.parametrize("n, k", [(96, 64), (80, 128), (1001, 32)])
@pytest.mark.parametrize("rows", [1, 4, 5, 8, 19])
def test_matches_float64_reference_and_is_batch_invariant(n, k, rows):
    weight, x = rand(n, k, seed=1), rand(rows, k, seed=2)
    got = linear_f32(x, pack_pairs(weight), n)
    want = linear_f32_torch(x, weight)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    # fp32 sums of exact bf16 products: error from the accumulation order alone
    bound = 1e-6 * (x.float().abs() @ weight.float().abs().T) + 1e-7
    assert ((got - want).abs() <= bound).all()
    for i in range(rows):  # a row alone: the same bits as inside the batch
        assert torch.equal(linear_f32(x[i:i + 1], pack_pairs(weight), n)[0], got[i])


def test_reads_strided_rows():
    weight, x = rand(64, 32, seed=3), rand(6, 48, seed=4)
    view = x[:, 8:40]  # row stride 48
    assert torch.equal(linear_f32(view, pack_pairs(weight), 64),
                       linear_f32(view.contiguous(), pack_pairs(weight), 64))


def test_rejects_bad_inputs():
    packed = pack_pairs(rand(64, 32))
    for x, n in [(rand(2, 31), 64), (rand(2, 32).float(), 64), (rand(2, 32), 65),
                 (rand(2, 32), 16), (rand(2, 64)[:, ::2], 64)]:
        with pytest.raises(ValueError, match="linear_f32"):
            linear_f32(x, packed, n)


@pytest.mark.parametrize("tied", [True, False])
def test_model_lm_head_gives_float32_logits(tiny_checkpoint, tied):
    from safetensors.torch import load_file

    from mxserve import LLM

    path = tiny_checkpoint("llama", tie_word_embeddings=tied)
    llm = LLM(model=str(path), dtype="bfloat16", load_progress=False)
    head = llm.engine.runner.model.lm_head
    assert head.tied == tied and head.pairs is not None and head.packed is None
    tensors = load_file(str(path / "model.safetensors"))
    weight = tensors["model.embed_tokens.weight" if tied else "lm_head.weight"].bfloat16()
    hidden = rand(3, weight.shape[1], seed=5)
    logits = llm.engine.runner.model.compute_logits(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (3, weight.shape[0])
    torch.testing.assert_close(logits, linear_f32_torch(hidden, weight), rtol=1e-5, atol=1e-5)
