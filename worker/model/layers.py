"""Normalisation and rotary position embedding shared by the Llama-family models."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mxserve.kernels import cpu_layer_ops
from mxserve.worker.model.config import RopeScaling


def fused_layer_ops(x: torch.Tensor):
    """The module of one-kernel layer ops for x's device and dtype, or None (then the plain-torch
    paths below, which compute what the kernels' references compute): kernels/layer_ops.py
    (Triton) on CUDA, imported only then as CPU installs need not have Triton; on the CPU
    kernels/cpu_layer_ops.py (C) for float32/bfloat16 where it builds."""
    if x.is_cuda:
        from mxserve.kernels import layer_ops

        return layer_ops
    return cpu_layer_ops if cpu_layer_ops.available(x.dtype) else None


class RMSNorm(nn.Module):
    """x / rms(x) * weight, normalized in float32 and cast back before the weight (Hugging Face's
    order). Given `residual`, adds x to it in place first and normalizes the sum (one kernel on
    CUDA: kernels/layer_ops.py)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        # x [T, hidden] -> [T, hidden]
        ops = fused_layer_ops(x)
        if ops is not None:
            return ops.rms_norm(x, self.weight, self.eps) if residual is None else \
                ops.add_rms_norm_(x, residual, self.weight, self.eps)
        if residual is not None:
            x = residual.add_(x)
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2]; llama3 scaling stretches the low frequencies.

    Llama 3 keeps wavelengths shorter than original_len / high_freq_factor, divides those longer
    than original_len / low_freq_factor by `factor`, and blends linearly in between.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq.float()
    wavelen = 2 * math.pi / inv_freq
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    blend = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - blend) * scaled / scaling.factor + blend * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled).float()


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (Hugging Face's convention) from precomputed fp32 cos/sin tables.

    `forward(qk, positions)` rotates the queries and keys of every token in place; they sit side
    by side in the fused qkv output, so one call (one kernel on CUDA) covers both.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: RopeScaling | None, device: torch.device | str = "cpu") -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", angles.cos().to(device), persistent=False)  # [max_pos, D/2]
        self.register_buffer("sin", angles.sin().to(device), persistent=False)
        # CPU: this forward's tables for all layers (`prepare`): cos [T, 1, D], signed sin
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def prepare(self, positions: torch.Tensor) -> None:
        """Start of a model forward: the plain-torch path gathers this forward's tables once,
        at its first layer, for all layers (they share this module). Call before the layers."""
        self._tables = None

    def forward(self, qk: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # qk [T, Hq + Hkv, D] rotated in place; positions [T] (the ones given to `prepare`)
        ops = fused_layer_ops(qk)
        if ops is not None:
            return ops.apply_rotary_(qk, positions, self.cos, self.sin)
        if self._tables is None:
            cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
            self._tables = (torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1))
        cos, signed_sin = self._tables
        x = qk.float()
        x1, x2 = x.chunk(2, dim=-1)
        # [x2, x1] * [-sin, sin] + [x1, x2] * cos = [x1 cos - x2 sin, x2 cos + x1 sin], rounded
        # as kernels/layer_ops.py's reference rounds it
        return qk.copy_(torch.cat((x2, x1), dim=-1).mul_(signed_sin).add_(x.mul_(cos)))
