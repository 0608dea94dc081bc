"""4-bit weights for small CPU batches: asymmetric int4 in groups of 32 along K.

A decode step at batch 1 on a CPU streams every weight once, so its time is the weight bytes over
the memory bandwidth; 4-bit weights read a quarter of bf16's. torch's CPU int4 kernel
(`_weight_int4pack_mm_for_cpu`) computes y = x @ w.T with

    w[n, k] = (q[n, k] - 8) * scale[k // 32, n] + zero[k // 32, n],   q in 0..15

which is exactly GGUF's Q4_1 (w = d * q + m; scale = d, zero = m + 8 d) and Q4_0 (zero = 0), so a
4-bit GGUF checkpoint keeps its own grid: its dequantized weights are re-quantized here from their
group minimum and range, recovering every code (scale and zero are rounded to bf16, the kernel's
only parameter dtype). From a few rows on that kernel is compute bound and slower than oneDNN's
bf16 GEMM, so layers keep both and pick per call (`INT4_MAX_ROWS`, measured on the project's
2-core CPU: bench/results/int4_rows.md). Where the CPU has AMX, kernels/cpu_int4.py multiplies
the same weights (its own layout, the same grid) for up to 16 rows at about one row's cost, so a
speculative verify costs little more than a decode step (bench/results/cpu_int4.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mxserve.kernels import cpu_int4

GROUP_SIZE = 32
# Rows (tokens) up to which layers take int4: it beats oneDNN's bf16 GEMM up to 4 rows, ties it
# at 8 and loses at 16 (bench/results/int4_rows.md). 8 rather than 4 keeps a speculative verify
# of up to 7 drafts on the int4 path, whose rows are exact (what decode steps compute, bit for
# bit; oneDNN's results depend on the row count).
INT4_MAX_ROWS = 8


def int4_supported(weight: torch.Tensor) -> bool:
    """Whether `weight` [N, K] can take the int4 path: a CPU bf16 tensor, N a multiple of 16
    (the kernel's tile), K of the group size, and a torch with the kernel."""
    n, k = weight.shape
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and n % 16 == 0
            and k % GROUP_SIZE == 0 and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"))


@dataclass(frozen=True)
class Int4Weight:
    """An [N, K] weight (build with `quantize_int4`) in one of two kernels' layouts:
    kernels/cpu_int4.py's where the CPU has AMX, else torch's."""

    packed: torch.Tensor | None  # uint8 [N, K // 2], torch's kernel's packing of q
    scales_zeros: torch.Tensor | None  # bf16 [K // 32, N, 2]: (scale, zero) per group
    tiles: cpu_int4.Int4Tiles | None = None

    @property
    def shape(self) -> tuple[int, int]:
        if self.tiles is not None:
            return self.tiles.n, self.tiles.k
        return self.packed.shape[0], self.scales_zeros.shape[0] * GROUP_SIZE

    @property
    def max_rows(self) -> int:
        """Rows up to which a layer takes this weight rather than oneDNN's bf16 GEMM."""
        return cpu_int4.MAX_ROWS if self.tiles is not None else INT4_MAX_ROWS


def _quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int32 [N, K], scales_zeros bf16 [K // 32, N, 2]) with q spanning each group's min..max."""
    n, k = weight.shape
    w = weight.float().view(n, k // GROUP_SIZE, GROUP_SIZE)
    lo, hi = w.amin(-1), w.amax(-1)  # [N, G]
    scale = ((hi - lo) / 15).to(torch.bfloat16).float()
    zero = (lo + 8 * scale).to(torch.bfloat16).float()
    step = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: q = 8
    q = torch.round((w - zero[..., None]) / step[..., None] + 8).clamp_(0, 15).to(torch.int32)
    scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).to(torch.bfloat16)
    return q.view(n, k), scales_zeros.contiguous()


def quantize_int4(weight: torch.Tensor) -> Int4Weight:
    """Quantize a dense [N, K] weight (`int4_supported`) to int4 groups of 32."""
    q, scales_zeros = _quantize(weight)
    if cpu_int4.available():
        return Int4Weight(None, None, cpu_int4.pack_tiles(q, scales_zeros))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    return Int4Weight(packed, scales_zeros)


def int4_linear(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] (bf16) @ dequantized(w).T + bias, in bf16."""
    if w.tiles is not None:
        y = cpu_int4.linear_int4(x if x.stride(-1) == 1 else x.contiguous(), w.tiles)
    else:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, w.packed, GROUP_SIZE, w.scales_zeros)
    return y if bias is None else y.add_(bias)


def dequantize_int4_torch(weight: torch.Tensor) -> torch.Tensor:
    """Reference: the float32 [N, K] weight that `quantize_int4(weight)` multiplies with."""
    n, k = weight.shape
    q, scales_zeros = _quantize(weight)
    scale, zero = scales_zeros.float().transpose(0, 1).unbind(-1)  # [N, G] each
    w = (q.view(n, k // GROUP_SIZE, GROUP_SIZE) - 8) * scale[..., None] + zero[..., None]
    return w.view(n, k)
