"""The decoder layer's elementwise steps, each one kernel: RMSNorm (with the residual add folded
in), rotary embedding in place, SiLU-and-mul.

In plain torch each of these is 3 to 9 small kernels (casts, chunks, products, a concat); a decode
step at batch 1 is dominated by such launches, not by bytes (bench/results/graph_profile.md).
Each kernel here computes in fp32 and rounds where the
torch reference rounds, so GPU and CPU steps agree to fp32 summation order:

- add_rms_norm_: residual += x (rounded to the activation dtype, as torch's add), then
  out = weight * (residual / rms(residual)) with the normalized value rounded before the product
  (Hugging Face's order). rms_norm: the same without the add.
- apply_rotary_: rotate-half RoPE of qk [T, H, D] in place, cos/sin looked up per token from fp32
  tables [max_positions, D / 2] (no gathered copy).
- silu_and_mul: x [T, 2I] -> silu(x[:, :I]) * x[:, I:], silu rounded before the product.
One program per token row; the whole row (or every head of it) is one tile.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .triton_compat import (
    cast_out,
    gdc_launch_dependents,
    interpreted_bf16,
    pdl_supported,
    tl,
    to_f32,
    triton,
)
from .triton_compat import use_triton as _use_triton

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def round_to_dtype(v, dtype: tl.constexpr, INTERP_BF16: tl.constexpr):
    """fp32 v rounded to `dtype` and back to fp32."""
    return to_f32(cast_out(v, dtype, INTERP_BF16), INTERP_BF16)


@triton.jit
def _rms_norm_kernel(
    # pointers: x, out [T, N]; residual [T, N] (read and written when HAS_RESIDUAL); weight [N]
    x_ptr, res_ptr, w_ptr, out_ptr,
    # scalars and strides (last dims contiguous)
    eps, N, stride_x, stride_r, stride_o,
    # meta
    HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, TRIGGER: tl.constexpr,
    INTERP_BF16: tl.constexpr,
):
    if TRIGGER:  # the next kernel (the LM head's GEMV) may start loading its weights
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < N
    dtype = out_ptr.dtype.element_ty
    x = to_f32(tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0), INTERP_BF16)
    if HAS_RESIDUAL:
        r = to_f32(tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0), INTERP_BF16)
        x = round_to_dtype(x + r, dtype, INTERP_BF16)
        tl.store(res_ptr + row * stride_r + offs, cast_out(x, dtype, INTERP_BF16), mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    w = to_f32(tl.load(w_ptr + offs, mask=mask, other=0.0), INTERP_BF16)
    y = round_to_dtype(x * rstd, dtype, INTERP_BF16) * w
    tl.store(out_ptr + row * stride_o + offs, cast_out(y, dtype, INTERP_BF16), mask=mask)


@triton.jit
def _rotary_kernel(
    # pointers: qk [T, H, D] (rotated in place); positions [T]; cos, sin [max_positions, D / 2]
    qk_ptr, pos_ptr, cos_ptr, sin_ptr,
    # strides
    stride_t, stride_h, stride_c,
    # shapes and tiling
    NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    INTERP_BF16: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_h, offs_d = tl.arange(0, BLOCK_H), tl.arange(0, BLOCK_D)
    mask = (offs_h < NUM_HEADS)[:, None] & (offs_d < HALF)[None, :]
    lo = qk_ptr + t * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]  # [BLOCK_H, BLOCK_D]
    x1 = to_f32(tl.load(lo, mask=mask, other=0.0), INTERP_BF16)
    x2 = to_f32(tl.load(lo + HALF, mask=mask, other=0.0), INTERP_BF16)
    cos = tl.load(cos_ptr + pos * stride_c + offs_d, mask=offs_d < HALF, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * stride_c + offs_d, mask=offs_d < HALF, other=0.0)[None, :]
    dtype = qk_ptr.dtype.element_ty
    tl.store(lo, cast_out(x1 * cos - x2 * sin, dtype, INTERP_BF16), mask=mask)
    tl.store(lo + HALF, cast_out(x2 * cos + x1 * sin, dtype, INTERP_BF16), mask=mask)


@triton.jit
def _silu_and_mul_kernel(
    # pointers: x [T, 2 * N] (gate | up); out [T, N]
    x_ptr, out_ptr,
    # sizes and strides
    N, stride_x, stride_o,
    # meta
    BLOCK_N: tl.constexpr, INTERP_BF16: tl.constexpr,
):
    row, col = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs = col * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < N
    dtype = out_ptr.dtype.element_ty
    gate = to_f32(tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0), INTERP_BF16)
    up = to_f32(tl.load(x_ptr + row * stride_x + N + offs, mask=mask, other=0.0), INTERP_BF16)
    silu = round_to_dtype(gate * tl.sigmoid(gate), dtype, INTERP_BF16)
    tl.store(out_ptr + row * stride_o + offs, cast_out(silu * up, dtype, INTERP_BF16), mask=mask)


def _check_rows(fn: str, *tensors: torch.Tensor) -> None:
    x = tensors[0]
    if x.dtype not in DTYPES or any(t.dtype != x.dtype for t in tensors) or x.dim() != 2 \
            or any(t.stride(-1) != 1 or t.device != x.device for t in tensors):
        raise ValueError(f"{fn}: need 2-D tensors of one float dtype and device with contiguous "
                         f"rows; got {[(t.dtype, tuple(t.shape), t.stride()) for t in tensors]}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
             backend: str = "auto") -> torch.Tensor:
    """weight * rmsnorm(x) for x [T, N], weight [N] of x's dtype; a new tensor."""
    return _rms_norm(x, None, weight, eps, backend)


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                  backend: str = "auto") -> torch.Tensor:
    """residual += x in place, then weight * rmsnorm(residual) (a new tensor). x, residual
    [T, N]."""
    if residual.shape != x.shape:
        raise ValueError(f"add_rms_norm_: residual {tuple(residual.shape)} != x {tuple(x.shape)}")
    return _rms_norm(x, residual, weight, eps, backend)


def _rms_norm(x, residual, weight, eps, backend):
    _check_rows("rms_norm", x, *([] if residual is None else [residual]))
    if weight.shape != x.shape[-1:] or weight.dtype != x.dtype or not weight.is_contiguous():
        raise ValueError(f"rms_norm: weight must be a contiguous {x.dtype} [{x.shape[-1]}]")
    if not _use_triton(backend, x):
        return rms_norm_torch(x, weight, eps) if residual is None else \
            add_rms_norm_torch_(x, residual, weight, eps)
    out = torch.empty_like(x)
    if x.shape[0]:
        res = x if residual is None else residual
        _rms_norm_kernel[(x.shape[0],)](
            x, res, weight, out, eps, x.shape[1], x.stride(0), res.stride(0), out.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK_N=triton.next_power_of_2(x.shape[1]),
            TRIGGER=pdl_supported(x), INTERP_BF16=interpreted_bf16(x.dtype, x))
    return out


def apply_rotary_(qk: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """Rotate qk [T, H, D] in place (rotate-half RoPE) at positions [T] (int32/int64, each below
    max_positions) with fp32 tables cos, sin [max_positions, D / 2]; returns qk."""
    if qk.dim() != 3 or qk.dtype not in DTYPES or qk.stride(-1) != 1 or qk.shape[-1] % 2 \
            or positions.shape != qk.shape[:1] or cos.shape != sin.shape \
            or cos.shape[-1] * 2 != qk.shape[-1] or cos.dtype != torch.float32 \
            or not (cos.is_contiguous() and sin.is_contiguous()) \
            or len({qk.device, positions.device, cos.device, sin.device}) != 1:
        raise ValueError(f"apply_rotary_: need qk [T, H, D] with contiguous heads, positions [T], "
                         f"fp32 contiguous cos/sin [max_positions, D/2] on one device; got qk "
                         f"{qk.dtype} {tuple(qk.shape)}, positions {tuple(positions.shape)}, cos "
                         f"{cos.dtype} {tuple(cos.shape)}")
    if not _use_triton(backend, qk):
        return apply_rotary_torch_(qk, positions, cos, sin)
    num_tokens, num_heads, head_dim = qk.shape
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            qk, positions, cos, sin, qk.stride(0), qk.stride(1), cos.stride(0),
            NUM_HEADS=num_heads, HALF=head_dim // 2, BLOCK_H=triton.next_power_of_2(num_heads),
            BLOCK_D=triton.next_power_of_2(head_dim // 2),
            INTERP_BF16=interpreted_bf16(qk.dtype, qk))
    return qk


def silu_and_mul(x: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """x [T, 2N] (gate, then up) -> silu(gate) * up [T, N]."""
    _check_rows("silu_and_mul", x)
    if x.shape[1] % 2:
        raise ValueError(f"silu_and_mul: last dim must be even, got {x.shape[1]}")
    if not _use_triton(backend, x):
        return silu_and_mul_torch(x)
    n = x.shape[1] // 2
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(n))
    if x.shape[0]:
        _silu_and_mul_kernel[(x.shape[0], triton.cdiv(n, block))](
            x, out, n, x.stride(0), out.stride(0), BLOCK_N=block,
            INTERP_BF16=interpreted_bf16(x.dtype, x))
    return out


# ---------------------------------------------------------------- plain-torch references

def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def add_rms_norm_torch_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> torch.Tensor:
    residual.add_(x)
    return rms_norm_torch(residual, weight, eps)


def apply_rotary_torch_(qk: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor) -> torch.Tensor:
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # [T, 1, D/2]
    x1, x2 = qk.float().chunk(2, dim=-1)
    return qk.copy_(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
