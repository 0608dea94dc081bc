"""`mxserve quantize`: write an MX-quantized copy of a checkpoint that the engine serves as is.

    mxserve quantize --model PATH --format mxfp4|mxfp6|mxfp6_e3m2 --out DIR
        [--method gptq --calibration TEXT_FILE]   # GPTQ (gptq.py) instead of round-to-nearest
    (the command line is cluster/cli.py's; this module is the work)
    LLM(model=DIR)   # Triton MX kernels on GPU; on CPU the weights are dequantized once, at load

The output is a Hugging Face directory in the layout mx_layers.py describes: each decoder linear
as packed MX bytes + E8M0 scales, everything else unquantized. From a safetensors source those
other tensors keep their stored dtype; from a GGUF source (which the loader dequantizes to fp32)
the matrices (embeddings, an untied lm_head) are stored as bfloat16 and the vectors (norms,
biases) as float32. config.json is the source's, or for a GGUF one written from its ModelConfig,
plus "quantization_config". The tokenizer files and generation_config.json are copied; for a GGUF
the rebuilt tokenizer is serialized (tokenizer.json + tokenizer_config.json).
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from mxserve.kernels.mx import quantize_mx
from mxserve.worker.model.checkpoint import (
    Checkpoint,
    expected_tensor_names,
    set_default_permissions,
)
from mxserve.worker.model.config import ModelConfig
from mxserve.worker.model.gptq import collect_hessians, gptq_mx
from mxserve.worker.model.llama import LlamaForCausalLM
from mxserve.worker.model.loader import open_checkpoint
from mxserve.worker.model.mx_layers import (
    SCALE_MODE,
    check_mx_k,
    is_mx_linear,
    model_element_format,
    mx_element_format,
    quantization_config,
)

WEIGHTS_FILE = "model.safetensors"
QUANT_METHODS = ("rtn", "gptq")
# Copied from a Hugging Face source beside the weights (config.json is rewritten).
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                "chat_template.jinja", "chat_template.json", "generation_config.json")
_MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                "Qwen2ForCausalLM": "qwen2"}


def quantize_checkpoint(model: str | None, fmt: str, out_dir: str, *, device: str = "auto",
                        progress: bool = True, method: str = "rtn",
                        calibration: str | None = None, calibration_tokens: int = 16384,
                        window: int = 512) -> str:
    """Quantize `model` (as open_checkpoint takes it; None = SmolLM2) to `fmt` ("mxfp4", "mxfp6",
    "mxfp6_e3m2") into `out_dir` (created; must be empty if it exists). Returns out_dir.

    method: "rtn" (each weight rounded to the nearest MX value) or "gptq" (gptq.py: rounding
    errors compensated against the layer inputs seen on `calibration`, a UTF-8 text file, its
    first `calibration_tokens` tokens in windows of `window`, run through the model in float32).
    device: where the quantization runs ("auto": CUDA when available, with the Triton kernel;
    bit-identical to the CPU reference). Raises ValueError for an unknown format or method, gptq
    without calibration text, an already MX source or a non-empty out_dir, ModelLoadError for a
    bad source or a linear whose K is not a multiple of 32 (naming it)."""
    elem = mx_element_format(fmt)
    if method not in QUANT_METHODS:
        raise ValueError(f"unknown quantization method {method!r}; expected one of "
                         f"{QUANT_METHODS}")
    if method == "gptq" and calibration is None:
        raise ValueError("method 'gptq' needs calibration text (--calibration FILE)")
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise ValueError(f"{out_dir}: output directory is not empty")
    ckpt = open_checkpoint(model)
    if ckpt.quantization:
        raise ValueError(f"{ckpt.path} is MX-quantized already ({ckpt.quantization}); "
                         "quantize its full-precision source instead")
    model_element_format(ckpt.config, 1, fmt)  # every K a whole number of blocks, before work
    dev = _torch_device(device)
    hessians = _calibrate(ckpt, calibration, calibration_tokens, window, dev) \
        if method == "gptq" else None
    tensors = _convert(ckpt, fmt, elem, dev, progress, hessians)
    os.makedirs(out_dir, exist_ok=True)
    weights = os.path.join(out_dir, WEIGHTS_FILE)
    save_file(tensors, weights, metadata={"format": "pt", "quantization": fmt})
    set_default_permissions(weights)
    _write_json(out_dir, "config.json",
                {**_hf_config(ckpt), "quantization_config": quantization_config(fmt, method)})
    _write_tokenizer(ckpt, out_dir)
    return out_dir


def _torch_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _calibrate(ckpt: Checkpoint, path: str, num_tokens: int, window: int,
               device: torch.device) -> dict[str, torch.Tensor]:
    """GPTQ's input Gram matrices (gptq.collect_hessians) from the float32 model on `path`."""
    with open(path, encoding="utf-8") as f:
        ids = ckpt.tokenizer.encode(f.read(), add_special_tokens=False)[:num_tokens]
    windows = [ids[i:i + window] for i in range(0, len(ids), window)]
    windows = [w for w in windows if len(w) > 1]
    if not windows:
        raise ValueError(f"{path}: no calibration tokens")
    model = LlamaForCausalLM(ckpt.config, dtype=torch.float32, device=device)
    model.load_weights(ckpt.weights(progress=False))
    return collect_hessians(model.eval(), windows)


def _convert(ckpt: Checkpoint, fmt: str, elem: str, device: torch.device, progress: bool,
             hessians: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The tensors to save: decoder linears as `X.weight_mx` / `X.weight_scale` (GPTQ against
    `hessians` when given), the rest as is (GGUF matrices: bfloat16)."""
    from_gguf = not os.path.isdir(ckpt.path)
    out: dict[str, torch.Tensor] = {}
    with tqdm(total=len(expected_tensor_names(ckpt.config)), file=sys.stderr, unit="tensor",
              desc=f"quantizing to {fmt}", disable=not progress) as bar:
        for name, t in ckpt.weights(progress=False):
            if is_mx_linear(name):
                check_mx_k(name, t.shape[-1])
                mx = gptq_mx(t.to(device), hessians[name], elem, SCALE_MODE) if hessians \
                    else quantize_mx(t.to(device), elem, SCALE_MODE)
                out[name + "_mx"], out[name + "_scale"] = mx.data.cpu(), mx.scales.cpu()
            else:
                out[name] = t.to(torch.bfloat16) if from_gguf and t.dim() == 2 else t.contiguous()
            bar.update(1)
    return out


def _hf_config(ckpt: Checkpoint) -> dict:
    """The source's config.json, or for a GGUF source the one its ModelConfig implies."""
    if os.path.isdir(ckpt.path):
        with open(os.path.join(ckpt.path, "config.json"), encoding="utf-8") as f:
            return json.load(f)
    return hf_config_dict(ckpt.config, torch_dtype="bfloat16")


def hf_config_dict(cfg: ModelConfig, torch_dtype: str) -> dict:
    """A Hugging Face config.json for `cfg`, which the loader reads back to an equal ModelConfig
    (model_id aside: it is derived from the directory)."""
    eos = list(cfg.eos_token_ids)
    out = dict(
        architectures=[cfg.architecture], model_type=_MODEL_TYPES[cfg.architecture],
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta, attention_bias=cfg.attention_bias,
        tie_word_embeddings=cfg.tie_word_embeddings, bos_token_id=cfg.bos_token_id,
        eos_token_id=eos[0] if len(eos) == 1 else eos, hidden_act=cfg.hidden_act,
        torch_dtype=torch_dtype)
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        out["rope_scaling"] = dict(
            rope_type="llama3", factor=s.factor, low_freq_factor=s.low_freq_factor,
            high_freq_factor=s.high_freq_factor,
            original_max_position_embeddings=s.original_max_position_embeddings)
    if cfg.sliding_window is not None:
        out["sliding_window"] = cfg.sliding_window
    return out


def _write_tokenizer(ckpt: Checkpoint, out_dir: str) -> None:
    if os.path.isdir(ckpt.path):
        for name in COPIED_FILES:
            if os.path.isfile(os.path.join(ckpt.path, name)):
                shutil.copyfile(os.path.join(ckpt.path, name), os.path.join(out_dir, name))
        return
    tok = ckpt.tokenizer
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(tok._backend.to_str())  # the BPE rebuilt from the GGUF metadata
    _write_json(out_dir, "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tok.bos_token,
        "eos_token": tok.eos_tokens[0] if tok.eos_tokens else None,
        "add_bos_token": tok.add_bos_token, "chat_template": tok.chat_template})
    if ckpt.generation_defaults:
        _write_json(out_dir, "generation_config.json", dict(ckpt.generation_defaults))


def _write_json(out_dir: str, name: str, value: dict) -> None:
    with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2, ensure_ascii=False)
        f.write("\n")
