"""MX weights in the model: the decoder linears' weights, their tensor-parallel shards, their files.

`quantization` names (worker/config.py, MX_QUANTIZATIONS) pick an OCP MX element format
(kernels/mx.py): "mxfp4" = e2m1, "mxfp6" = e2m3, "mxfp6_e3m2" = e3m2. Every decoder linear
(MX_MODULES) is quantized in blocks of 32 along K, the in-features axis of its [N, K] weight, with
"ceil" scales (SCALE_MODE); embeddings, norms, biases and the LM head stay in full precision
(the head too may be MX: EngineConfig.quantize_lm_head).

On disk (a Hugging Face directory, written by `mxserve quantize`, worker/model/quantize.py):

    config.json        "quantization_config": {"quant_method": "mx", "format": "mxfp4",
                        "elem_format": "e2m1", "block_size": 32, "scale_mode": "ceil",
                        "method": "rtn", "modules": ["q_proj", ..., "down_proj"]}
    model.safetensors  X.weight_mx     uint8 [N, packed_len(K)]  canonical packing (ARCHITECTURE.md)
                       X.weight_scale  uint8 [N, K // 32]        E8M0 scale bytes
                       for each decoder linear X; every other tensor under its usual name.

The loader yields each pair as one MXTensor named `X.weight`, so the model loads one way.
Sharding an MX weight: column-parallel layers take whole rows (packed rows hold whole blocks),
row-parallel layers whole 32-blocks of K, which the per-rank in-features must allow.

This module imports Triton (through kernels/mx.py): the loader and the layers import it only when
a model is MX.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from mxserve.api.errors import ModelLoadError
from mxserve.kernels.mx import BLOCK_SIZE, MXTensor, dequantize_mx, get_format, quantize_mx
from mxserve.kernels.mx_layout import prepare_mx_weight
from mxserve.kernels.mx_linear import mx_linear
from mxserve.kernels.options import DEFAULT_GEMV, GemvOptions
from mxserve.worker.config import MX_QUANTIZATIONS
from mxserve.worker.model.checkpoint import TensorSlice
from mxserve.worker.model.config import ModelConfig

MX_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# How the engine and `mxserve quantize` pick a block's scale (kernels/mx.py SCALE_MODES): "ceil",
# the smallest scale at which the block's largest element does not clip, rather than the OCP
# rule's "floor" (kernels/mx.py's default), which clips it by up to 25% (to 6 from 7.99 in e2m1).
# Same format and kernels, only other scale bytes; lower perplexity in every format, most in
# e2m1 (bench/results/mx_quality.scale_modes.md). Choosing floor or ceil per block by squared
# weight error was worse for e2m1: the clipped largest elements matter more than the error
# average says.
# A checkpoint's recorded scale_mode is informational: its scale bytes are read as they are.
SCALE_MODE = "ceil"


def mx_element_format(quantization: str) -> str:
    """The MX element format ("e2m1", ...) of a `quantization` name; ValueError naming it."""
    if quantization not in MX_QUANTIZATIONS:
        raise ValueError(f"unknown MX quantization format {quantization!r}; expected one of "
                         f"{sorted(MX_QUANTIZATIONS)}")
    return MX_QUANTIZATIONS[quantization]


def is_mx_linear(name: str) -> bool:
    """Whether HF tensor `name` is a decoder linear's weight, the tensors MX quantizes."""
    parts = name.split(".")
    return name.startswith("model.layers.") and parts[-1] == "weight" and parts[-2] in MX_MODULES


def check_mx_k(name: str, k: int) -> None:
    """ModelLoadError naming `name` unless its K (per rank) holds whole blocks of 32."""
    if k % BLOCK_SIZE:
        raise ModelLoadError(f"{name}: in-features K={k} is not a multiple of {BLOCK_SIZE}; "
                             "MX blocks of 32 run along K, so this tensor cannot be MX-quantized")


def model_element_format(cfg: ModelConfig, tp_size: int, quantization: str) -> str:
    """The element format of a model built with `quantization`, after checking that every decoder
    linear's per-rank K is a whole number of blocks (ModelLoadError naming the first that isn't)."""
    fmt = mx_element_format(quantization)
    check_mx_k("model.layers.0.self_attn.q_proj.weight", cfg.hidden_size)  # and k/v, gate/up
    per_rank = f" (per rank of {tp_size})" if tp_size > 1 else ""
    for part, k in {"self_attn.o_proj": cfg.q_size, "mlp.down_proj": cfg.intermediate_size}.items():
        check_mx_k(f"model.layers.0.{part}.weight{per_rank}", k // tp_size)  # row-parallel
    return fmt


# ---- checkpoint files ----


def quantization_config(quantization: str, method: str = "rtn") -> dict:
    """The config.json entry of an MX checkpoint in `quantization`, rounded by `method` ("rtn",
    "gptq": informational, the loader reads the bytes as they are)."""
    return {"quant_method": "mx", "format": quantization,
            "elem_format": mx_element_format(quantization), "block_size": BLOCK_SIZE,
            "scale_mode": SCALE_MODE, "method": method, "modules": list(MX_MODULES)}


def parse_quantization_config(qc: dict, path: str) -> str:
    """The `quantization` name a config.json's quantization_config declares. ModelLoadError when
    it is not an MX config mxserve wrote (another quant_method, block size or module set)."""
    if not isinstance(qc, dict) or qc.get("quant_method") != "mx":
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        raise ModelLoadError(f"{path}: quantization_config quant_method {method!r} is not "
                             "supported (only mxserve's 'mx')")
    fmt = qc.get("format")
    if fmt not in MX_QUANTIZATIONS or qc.get("elem_format", MX_QUANTIZATIONS[fmt]) \
            != MX_QUANTIZATIONS[fmt]:
        raise ModelLoadError(f"{path}: quantization_config format {fmt!r} / elem_format "
                             f"{qc.get('elem_format')!r} is not one of {MX_QUANTIZATIONS}")
    if qc.get("block_size", BLOCK_SIZE) != BLOCK_SIZE:
        raise ModelLoadError(f"{path}: MX block_size {qc.get('block_size')} is not supported")
    if sorted(qc.get("modules", MX_MODULES)) != sorted(MX_MODULES):
        raise ModelLoadError(f"{path}: MX modules {qc.get('modules')} must be all of {MX_MODULES}")
    return fmt


def mx_logical_owner(owner: dict[str, str], fmt: str) -> dict[str, str]:
    """Stored name -> file, with each `X.weight_mx` + `X.weight_scale` pair (same file, uint8,
    shapes that agree) folded into `X.weight`. ModelLoadError naming a broken pair."""
    logical = {n: f for n, f in owner.items() if not n.endswith((".weight_mx", ".weight_scale"))}
    pairs: dict[str, list[str]] = {}
    for name, file in owner.items():
        if not name.endswith((".weight_mx", ".weight_scale")):
            continue
        base = name.rpartition("_")[0]
        if owner.get(base + "_mx") != file or owner.get(base + "_scale") != file:
            raise ModelLoadError(f"{file}: {name} needs both {base}_mx and {base}_scale in it")
        if not is_mx_linear(base):
            raise ModelLoadError(f"{file}: {name}: only decoder linears {MX_MODULES} may be MX")
        logical[base] = file
        if base not in pairs.setdefault(file, []):
            pairs[file].append(base)
    for file, bases in pairs.items():
        _check_pairs(file, bases, fmt)
    return logical


def _check_pairs(file: str, bases: list[str], fmt: str) -> None:
    f = get_format(fmt)
    with safe_open(file, framework="pt") as h:
        for base in bases:
            data, scales = h.get_slice(base + "_mx"), h.get_slice(base + "_scale")
            n, num_blocks = (list(scales.get_shape()) + [0, 0])[:2]
            want = [n, f.packed_len(num_blocks * BLOCK_SIZE)]
            if (data.get_dtype(), scales.get_dtype()) != ("U8", "U8") or \
                    len(scales.get_shape()) != 2 or data.get_shape() != want:
                raise ModelLoadError(
                    f"{file}: {base}_mx {data.get_dtype()} {data.get_shape()} / _scale "
                    f"{scales.get_dtype()} {scales.get_shape()} are not a {fmt} pair "
                    f"(uint8 [N, packed K] and [N, K // {BLOCK_SIZE}])")


def read_mx(handle, name: str, fmt: str, part: TensorSlice | None = None) -> MXTensor:
    """The MXTensor [N, K] stored as `name`_mx / `name`_scale in an open safetensors file, or
    only its rows / whole 32-blocks of K in `part` (a tensor-parallel rank's)."""
    data, scales = handle.get_slice(name + "_mx"), handle.get_slice(name + "_scale")
    n, num_blocks = scales.get_shape()
    if part is None:
        return MXTensor(data[:], scales[:], fmt, (n, num_blocks * BLOCK_SIZE))
    if part.dim == 0:
        rows = slice(part.start, part.stop)
        return MXTensor(data[rows], scales[rows], fmt, (part.stop - part.start,
                                                         num_blocks * BLOCK_SIZE))
    return slice_mx_k(lambda cols: data[:, cols], lambda cols: scales[:, cols], fmt, n, part)


def slice_mx_k(data, scales, fmt: str, n: int, part: TensorSlice) -> MXTensor:
    """The MXTensor of K range [start, stop) (whole 32-blocks) of an [n, K] one whose packed
    codes and scales `data(cols)` / `scales(cols)` read by column slice."""
    if part.start % BLOCK_SIZE or part.stop % BLOCK_SIZE:
        raise ModelLoadError(f"K range [{part.start}, {part.stop}) does not hold whole MX "
                             f"blocks of {BLOCK_SIZE}")
    f = get_format(fmt)
    return MXTensor(data(slice(f.packed_len(part.start), f.packed_len(part.stop))),
                    scales(slice(part.start // BLOCK_SIZE, part.stop // BLOCK_SIZE)), fmt,
                    (n, part.stop - part.start))


def slice_mx(t: MXTensor, part: TensorSlice | None) -> MXTensor:
    """`part` of an [N, K] MXTensor: rows, or whole 32-blocks of K."""
    if part is None:
        return t
    if part.dim == 0:
        rows = slice(part.start, part.stop)
        return MXTensor(t.data[rows], t.scales[rows], t.fmt, (part.stop - part.start, t.shape[1]))
    return slice_mx_k(lambda c: t.data[:, c], lambda c: t.scales[:, c], t.fmt, t.shape[0], part)


# ---- the layer weight ----


def packed_on(device: torch.device) -> bool:
    """Whether MX weights stay packed on `device` (CUDA: the Triton kernels) rather than being
    dequantized once at load (CPU)."""
    return device.type == "cuda"


class MXWeight(nn.Module):
    """An [N, K] linear weight whose values are those of an MX tensor of element format `fmt`.

    Loading: `load(rows, w)` takes this rank's slice as an MXTensor (an MX checkpoint) or as a
    float tensor (quantized here: on-the-fly quantization; MX blocks run along K, so quantizing a
    slice of whole blocks equals slicing the quantized whole) and writes it into `rows`; fused
    layers load each shard's rows this way. `finish_loading()` runs once, after the last.

    Two forms, by device (`packed_on`):
    - CUDA: the canonical bytes, re-arranged at finish_loading for the kernels (prepare_mx_weight);
      forward = mx_linear (Triton), accumulated in fp32.
    - CPU: the weight is dequantized ONCE, at load, into the compute dtype, and forward is
      F.linear. That is what the reference mx_linear_torch computes on each call (dequantize
      exactly, fp32 product, one rounding to x's dtype), without redoing the dequantization every
      step: in fp32 it is the same weight and product; in bf16 the MX values are exact too (at
      most 3 mantissa bits, exponents within bf16's range), and only the matmul's summation order
      may differ. fp16 can round weights at the edges of its range.
    """

    def __init__(self, out_features: int, in_features: int, fmt: str, dtype: torch.dtype,
                 device: torch.device | str = "cpu",
                 gemv_options: GemvOptions = DEFAULT_GEMV) -> None:
        super().__init__()
        self.gemv_options = gemv_options  # when decode at a few rows takes kernels/gemv.py
        check_mx_k(f"an MX linear [{out_features}, {in_features}]", in_features)
        self.fmt, self.shape, self.dtype = fmt, (out_features, in_features), dtype
        self.device = torch.device(device)
        self.packed = packed_on(self.device)
        self.prepared = None  # MXLinearWeight, once loaded (packed form)
        if self.packed:  # canonical bytes while loading, freed by finish_loading
            packed_k = get_format(fmt).packed_len(in_features)
            self.data = torch.zeros(out_features, packed_k, dtype=torch.uint8, device=device)
            self.scales = torch.zeros(out_features, in_features // BLOCK_SIZE, dtype=torch.uint8,
                                      device=device)
        else:
            self.weight = nn.Parameter(torch.empty(self.shape, dtype=dtype, device=device),
                                       requires_grad=False)

    def load(self, rows: slice, weight: torch.Tensor | MXTensor) -> None:
        """Write a weight (this rank's slice already: an MXTensor, or float values quantized
        here) into `rows`."""
        mx = self._as_mx(weight)
        if self.packed:
            self.data[rows].copy_(mx.data)
            self.scales[rows].copy_(mx.scales)
        else:
            self.weight.data[rows].copy_(dequantize_mx(mx, self.dtype))

    def _as_mx(self, weight: torch.Tensor | MXTensor) -> MXTensor:
        if isinstance(weight, MXTensor):
            if weight.fmt != self.fmt:
                raise ModelLoadError(f"MX weight in {weight.fmt} for a layer built for {self.fmt}")
            return weight
        return quantize_mx(weight.to(self.device), self.fmt, SCALE_MODE)

    def finish_loading(self) -> None:
        if self.packed and self.prepared is None:
            self.prepared = prepare_mx_weight(MXTensor(self.data, self.scales, self.fmt,
                                                       self.shape))
            self.data = self.scales = None  # the prepared planes hold the same bytes

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
        # x [..., K] -> [..., N] in out_dtype (None: x's; float32: the LM head's logits)
        if not self.packed:
            y = F.linear(x, self.weight, bias)
            return y if out_dtype is None else y.to(out_dtype)
        if self.prepared is None:
            raise RuntimeError("MXWeight used before finish_loading()")
        if x.is_cuda:  # decode at one row, small weights: the whole-row GEMV (kernels/gemv.py)
            from mxserve.kernels import gemv

            if gemv.preferred(x, self.prepared, self.gemv_options):
                return gemv.gemv(x, self.prepared, bias, out_dtype=out_dtype,
                                 pdl=self.gemv_options.pdl)
        return mx_linear(x, self.prepared, bias, out_dtype=out_dtype)

    def extra_repr(self) -> str:
        return f"fmt={self.fmt}, shape={self.shape}, packed={self.packed}"
