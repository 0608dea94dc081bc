"""GPTQ for MX weights: `mxserve quantize --method gptq --calibration TEXT`.

Round-to-nearest (RTN, the default) quantizes each weight on its own. GPTQ (Frantar et al., 2022,
"GPTQ: Accurate Post-Training Quantization for Generative Pre-trained Transformers") quantizes a
linear's input columns in order and spreads each column's rounding error over the columns not yet
quantized, weighted by the inverse of H = X^T X, the Gram matrix of the layer's inputs on
calibration text, so that the layer's outputs X W^T move least. For MX the grid has a scale per
32 columns of a row: a block's scale is chosen (SCALE_MODE) when its first column is reached,
from the row's weights as updated by then, and stays for its 32 columns.

    hessians = collect_hessians(model, windows)   # a float model, calibration token windows
    mx = gptq_mx(weight, hessians[module], "e2m1")

The inputs come from one pass of the full-precision model (not layer by layer through the already
quantized layers): simpler, and one forward of the calibration text in all. q/k/v share their
input and so their H, as do gate/up.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mxserve.kernels.mx import (
    BLOCK_SIZE,
    MXTensor,
    quantize_with_exponents,
    round_to_grid,
    scale_exponent,
)
from mxserve.worker.attention import AttentionBatch, TorchAttention


@torch.inference_mode()
def forward_window(model: nn.Module, ids: list[int], block_size: int = 16) -> torch.Tensor:
    """Final hidden states [len(ids), hidden] of one prefill pass of `model` (LlamaForCausalLM,
    on its device) over ids, outside the engine: its own KV blocks, the torch attention."""
    cfg, n = model.config, len(ids)
    device = model.norm.weight.device
    num_blocks = math.ceil(n / block_size)
    shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    dtype = model.norm.weight.dtype
    caches = [(torch.zeros(shape, dtype=dtype, device=device),
               torch.zeros(shape, dtype=dtype, device=device))
              for _ in range(cfg.num_hidden_layers)]
    attn = TorchAttention()
    meta = attn.build_metadata(AttentionBatch([n], [0], [list(range(num_blocks))], 0, block_size,
                                              device))
    tokens = torch.tensor(ids, device=device)
    return model(tokens, torch.arange(n, device=device), caches, attn, meta)


# The model's input-sharing projections -> the Hugging Face linears each one fuses.
FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "self_attn.o_proj": ("self_attn.o_proj",),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
         "mlp.down_proj": ("mlp.down_proj",)}


@torch.inference_mode()
def collect_hessians(model: nn.Module, windows: list[list[int]]) -> dict[str, torch.Tensor]:
    """H = mean of x x^T (float64 [K, K]) over every token's input x of each decoder linear, on
    the calibration windows; keyed by the Hugging Face weight name (model.layers.i.mlp.up_proj
    .weight), q/k/v and gate/up sharing one tensor."""
    sums: dict[tuple[int, str], torch.Tensor] = {}
    counts: dict[tuple[int, str], int] = {}

    def hook(key):
        def record(module, args):
            x = args[0].reshape(-1, args[0].shape[-1]).double()
            if key not in sums:
                sums[key] = x.new_zeros(x.shape[1], x.shape[1])
                counts[key] = 0
            sums[key] += x.T @ x
            counts[key] += x.shape[0]
        return record

    hooks = [layer.get_submodule(fused).register_forward_pre_hook(hook((i, fused)))
             for i, layer in enumerate(model.layers) for fused in FUSED]
    try:
        for ids in windows:
            forward_window(model, ids)
    finally:
        for h in hooks:
            h.remove()
    means = {key: total / counts[key] for key, total in sums.items()}
    return {f"model.layers.{i}.{part}.weight": h for (i, fused), h in means.items()
            for part in FUSED[fused]}


def gptq_mx(weight: torch.Tensor, hessian: torch.Tensor, fmt: str, scale_mode: str = "ceil", *,
            damp: float = 0.01, block: int = 128) -> MXTensor:
    """weight [N, K] quantized to MX `fmt` by GPTQ against hessian [K, K] (collect_hessians).

    damp: added to H's diagonal, as a fraction of its mean (H is often near singular). block:
    columns updated together before their error reaches the rest (a multiple of 32; the lazy
    batch update of the paper, same result). Input columns no token used (H[j, j] = 0) are
    zeroed, as they do not change the outputs. Computed in float64 on weight's device."""
    n, k = weight.shape
    if k % BLOCK_SIZE or block % BLOCK_SIZE or hessian.shape != (k, k):
        raise ValueError(f"gptq_mx: weight [N, K] with K a multiple of {BLOCK_SIZE}, hessian "
                         f"[K, K] and block a multiple of {BLOCK_SIZE}; got {tuple(weight.shape)}, "
                         f"{tuple(hessian.shape)}, block {block}")
    w = weight.double().clone()
    h = hessian.to(w.device, torch.float64).clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += damp * torch.diag(h).mean() * torch.eye(k, dtype=h.dtype, device=h.device)
    # the upper Cholesky factor of H^-1: row j's entries right of j weigh column j's error
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    exps = torch.empty(n, k // BLOCK_SIZE, dtype=torch.long, device=w.device)
    scale = None
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        wb, err = w[:, b0:b1], torch.empty(n, b1 - b0, dtype=w.dtype, device=w.device)
        for j in range(b1 - b0):
            col = b0 + j
            if col % BLOCK_SIZE == 0:  # a new MX block: its scale from the weights as they are
                s = scale_exponent(wb[:, j:j + BLOCK_SIZE].abs().amax(1), fmt, scale_mode)
                exps[:, col // BLOCK_SIZE] = s
                scale = torch.exp2(s.double())
            q = round_to_grid(wb[:, j] / scale, fmt) * scale
            err[:, j] = (wb[:, j] - q) / hinv[col, col]
            wb[:, j:] -= err[:, j, None] * hinv[col, col:b1][None, :]
            wb[:, j] = q  # exactly on the grid now (the update above left q + 0)
        w[:, b1:] -= err @ hinv[b0:b1, b1:]
    return quantize_with_exponents(w, fmt, exps)
