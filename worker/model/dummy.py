"""Dummy checkpoints: a real architecture's shapes with random weights, from a config alone.

`load_format="dummy"` (EngineConfig) opens `model` here instead of reading weight files: a
directory with a Hugging Face config.json (and its tokenizer, when it has tokenizer.json), or a
name in DUMMY_MODELS. The weight stream yields the names and shapes a real checkpoint of that
config would (loader.expected_tensor_names), each tensor drawn directly on the target device in the
target dtype, so the model loads it the usual way (fused qkv / gate_up, tensor-parallel shards, MX
quantization) and benchmarks run real shapes without downloading anything.

Values: embeddings and linear weights ~ N(0, WEIGHT_STD^2), norm weights 1, biases 0, so
activations stay finite through any depth. One seed, device and dtype give the same weights.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator

import torch

from mxserve.api.errors import ModelLoadError
from mxserve.api.tokenizer import Tokenizer, read_json
from mxserve.worker.model.checkpoint import Checkpoint, SliceFor, expected_tensor_names
from mxserve.worker.model.config import ModelConfig
from mxserve.worker.model.loader import hf_model_config

WEIGHT_STD = 0.02
_LLAMA3 = dict(architectures=["LlamaForCausalLM"], vocab_size=128256, num_attention_heads=32,
               num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0, bos_token_id=128000,
               eos_token_id=128001, hidden_act="silu")
# Built-in shapes, as Hugging Face config.json dicts (transformers.LlamaConfig(**d) takes them).
DUMMY_MODELS: dict[str, dict] = {
    "llama-3.2-1b": dict(_LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         head_dim=64, max_position_embeddings=131072, tie_word_embeddings=True,
                         rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0,
                                           original_max_position_embeddings=8192)),
    "llama-3-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       head_dim=128, max_position_embeddings=8192, tie_word_embeddings=False),
}


class DummySource:
    """Draws each tensor of `config` on `device` in `dtype`, one at a time, in model order."""

    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype,
                 seed: int) -> None:
        self.config, self.device, self.dtype, self.seed = config, device, dtype, seed

    def tensors(self, slice_for: SliceFor | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Each whole tensor is drawn (so every rank's slices are those of one model), one at a
        time, and only the slice kept."""
        gen = torch.Generator(self.device).manual_seed(self.seed)
        for name in expected_tensor_names(self.config):
            t = torch.empty(tensor_shape(self.config, name), dtype=self.dtype, device=self.device)
            if name.endswith("norm.weight"):
                t.fill_(1.0)
            elif name.endswith(".bias"):
                t.zero_()
            else:
                t.normal_(0.0, WEIGHT_STD, generator=gen)
            part = slice_for(name) if slice_for else None
            yield name, t if part is None else part.take(t).clone()


def tensor_shape(cfg: ModelConfig, name: str) -> tuple[int, ...]:
    """The Hugging Face shape of tensor `name` ([out_features, in_features] for linears)."""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (cfg.vocab_size, cfg.hidden_size)
    part, kind = name.split(".")[-2:]
    out_in = {"q_proj": (cfg.q_size, cfg.hidden_size), "k_proj": (cfg.kv_size, cfg.hidden_size),
              "v_proj": (cfg.kv_size, cfg.hidden_size), "o_proj": (cfg.hidden_size, cfg.q_size),
              "gate_proj": (cfg.intermediate_size, cfg.hidden_size),
              "up_proj": (cfg.intermediate_size, cfg.hidden_size),
              "down_proj": (cfg.hidden_size, cfg.intermediate_size)}
    if part in out_in:
        return out_in[part] if kind == "weight" else out_in[part][:1]
    return (cfg.hidden_size,)  # input_layernorm, post_attention_layernorm, model.norm


def open_dummy(model: str | None, device: torch.device, dtype: torch.dtype,
               seed: int = 0) -> Checkpoint:
    """A Checkpoint of random weights for `model`: a DUMMY_MODELS name or a directory with a
    config.json. ModelLoadError when it is neither, or when the config is not supported."""
    if model in DUMMY_MODELS:
        cfg, tokenizer, path = DUMMY_MODELS[model], None, model
    else:
        path = os.path.expanduser(model) if model else ""
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ModelLoadError(
                f"load_format='dummy' needs model= a built-in shape ({', '.join(DUMMY_MODELS)}) "
                f"or a directory with a config.json; got {model!r}")
        cfg = read_json(os.path.join(path, "config.json"), required=True)
        has_tokenizer = os.path.isfile(os.path.join(path, "tokenizer.json"))
        tokenizer = Tokenizer.from_hf_dir(path) if has_tokenizer else None
    digest = hashlib.blake2b(json.dumps(cfg, sort_keys=True).encode(), digest_size=8).hexdigest()
    name = os.path.basename(os.path.normpath(path))
    config = hf_model_config(cfg, {}, f"dummy-{name}-{digest}-seed{seed}")
    return Checkpoint(config, tokenizer, {}, path, DummySource(config, device, dtype, seed))
