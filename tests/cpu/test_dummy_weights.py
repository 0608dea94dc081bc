"""load_format="dummy": random weights of an architecture from a config alone, no tokenizer."""

from __future__ import annotations

import json

import pytest
import torch

from mxserve import LLM, InvalidRequestError, SamplingParams
from mxserve.api.errors import ModelLoadError
from mxserve.worker.config import EngineConfig
from mxserve.worker.model.checkpoint import expected_tensor_names
from mxserve.worker.model.dummy import DUMMY_MODELS, WEIGHT_STD, open_dummy, tensor_shape

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 17, 99, 3], list(range(10, 60))]


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory):
    """A directory holding only a config.json (no weights, no tokenizer)."""
    path = tmp_path_factory.mktemp("dummy-config")
    (path / "config.json").write_text(json.dumps(
        {**TINY, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    return str(path)


def _llm(model: str, **options) -> LLM:
    return LLM(model=model, load_format="dummy", device="cpu", dtype="float32",
               load_progress=False, **options)


def test_dummy_model_generates_the_same_tokens_for_the_same_seed(config_dir):
    first = [o.token_ids for o in _llm(config_dir, seed=3).generate(PROMPTS, GREEDY)]
    again = [o.token_ids for o in _llm(config_dir, seed=3).generate(PROMPTS, GREEDY)]
    other = [o.token_ids for o in _llm(config_dir, seed=4).generate(PROMPTS, GREEDY)]
    assert first == again
    assert all(len(ids) == GREEDY.max_tokens for ids in first)
    assert other != first  # the seed picks the weights


def test_dummy_weights_have_the_configs_shapes_and_small_values(config_dir):
    ckpt = open_dummy(config_dir, torch.device("cpu"), torch.bfloat16, seed=0)
    assert ckpt.tokenizer is None and ckpt.config.hidden_size == TINY["hidden_size"]
    tensors = dict(ckpt.weights(progress=False))
    assert list(tensors) == expected_tensor_names(ckpt.config)
    for name, t in tensors.items():
        assert t.dtype == torch.bfloat16 and tuple(t.shape) == tensor_shape(ckpt.config, name)
        if name.endswith("norm.weight"):
            assert torch.all(t == 1)
        else:
            assert torch.isfinite(t).all() and abs(t.float().std().item() - WEIGHT_STD) < 0.005
    embed = tensors["model.embed_tokens.weight"]
    assert not torch.equal(embed, tensors["lm_head.weight"])  # drawn independently


def test_dummy_model_runs_mx_quantized(config_dir):
    outputs = _llm(config_dir, quantization="mxfp4").generate(PROMPTS, GREEDY)
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outputs)


def test_builtin_shapes_match_the_real_architectures():
    sizes = {}
    for name in DUMMY_MODELS:
        cfg = open_dummy(name, torch.device("cpu"), torch.bfloat16).config
        sizes[name] = sum(torch.Size(tensor_shape(cfg, n)).numel()
                          for n in expected_tensor_names(cfg))
    one_b = open_dummy("llama-3.2-1b", torch.device("cpu"), torch.bfloat16).config
    assert (one_b.hidden_size, one_b.num_hidden_layers, one_b.num_attention_heads,
            one_b.num_key_value_heads, one_b.intermediate_size, one_b.vocab_size) == \
        (2048, 16, 32, 8, 8192, 128256)
    assert one_b.tie_word_embeddings and one_b.rope_scaling is not None
    # Parameter counts of Llama-3.2-1B (tied) and Llama-3-8B.
    assert sizes == {"llama-3.2-1b": 1_235_814_400, "llama-3-8b": 8_030_261_248}


def test_text_prompts_and_stop_strings_need_a_tokenizer(config_dir):
    llm = _llm(config_dir)
    with pytest.raises(InvalidRequestError, match="needs a tokenizer"):
        llm.generate("hello there", GREEDY)
    with pytest.raises(InvalidRequestError, match="needs a tokenizer"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY)
    with pytest.raises(InvalidRequestError, match="stop strings need a tokenizer"):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, stop=["x"]))


def test_dummy_keeps_a_directorys_tokenizer(tiny_checkpoint):
    llm = _llm(str(tiny_checkpoint("llama")))
    out = llm.generate("w5 w6 w7", GREEDY)[0]
    assert len(out.token_ids) == GREEDY.max_tokens and out.text


@pytest.mark.parametrize("model, match", [
    ("no-such-model", "built-in shape"),
    (None, "built-in shape"),
])
def test_bad_dummy_model_is_a_clear_error(model, match):
    with pytest.raises(ModelLoadError, match=match):
        _llm(model)


def test_bad_load_format_is_a_clear_error():
    with pytest.raises(ValueError, match="load_format must be one of"):
        EngineConfig(load_format="pt")
