"""Few-row dense linear (decode GEMV): y [M, N] = x [M, K] @ w.T (+ bias), 16-bit x and w, on
the CUDA cores.

A program owns BLOCK_N rows of w and loads its whole [BLOCK_N, K] tile at once, before it reads
x: every load of a program is in flight together (16-byte vectors), with no K loop and no
pipeline to fill. Then each of the M rows of x is reduced against the tile held in registers
(fp32 products and sums), so w is read once for all rows. On the H200 this beat cuBLAS on the
1B model's decode shapes at M = 1 (q/k/v 5.2 vs 6.8 us, o 4.3 vs 6.2, gate/up 17.4 vs 18.4,
down 9.8 vs 13.7, LM head 118.7 vs 127.3: bench/results/pdl_probe.json), where cuBLAS's
kernels sit at a latency floor (12 MB of weights took 5.4 us even from L2:
bench/results/l2_prefetch_probe.json). Past a few rows the CUDA-core products cost more than
the tensor cores': bench/gemv_gpu.py measures where cuBLAS wins again (`MAX_ROWS`).

The tile is [BLOCK_N, K'] with K' the next power of 2 >= K (masked past K): BLOCK_N = 8192 / K'
rows, at least 1, on 4 warps (8 for K' = 16384). Rows of w past N are read as row N - 1 and
not stored, so no load needs a row mask.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import layer_ops
from .layer_ops import _round_to
from .triton_compat import _cast_out, _to_f32, interpreted_bf16
from .triton_compat import use_triton as _use_triton

# rows of x up to which the model uses the kernel on a GPU: it wins at 1 row on every 1B and 8B
# decode shape (1.04-1.41x) and mostly loses from 2 on (bench/results/gemv_gpu.md)
MAX_ROWS = 1
MAX_K = 16384  # the tile holds a whole row of w
TILE = 8192  # elements of w per program
DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _gemv_kernel(
    # x [M, K], w [N, K], bias [N] (if HAS_BIAS), out [M, N]; with NORM: residual [M, K],
    # norm weight [K], new residual [M, K] (written by program 0)
    x_ptr, w_ptr, bias_ptr, out_ptr, res_ptr, norm_w_ptr, new_res_ptr,
    M, N, K, eps, stride_xm, stride_wn, stride_om, stride_rm, stride_nm,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
    INTERP_BF16: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # rows past N read row N - 1; not stored
    offs_k = tl.arange(0, BLOCK_K)
    k_mask = offs_k < K
    w = tl.load(w_ptr + rows[:, None] * stride_wn + offs_k[None, :], mask=k_mask[None, :],
                other=0.0)
    w = _to_f32(w, INTERP_BF16)
    dtype = out_ptr.dtype.element_ty
    if HAS_BIAS:
        bias = _to_f32(tl.load(bias_ptr + rows), INTERP_BF16)
    if NORM:
        norm_w = _to_f32(tl.load(norm_w_ptr + offs_k, mask=k_mask, other=0.0), INTERP_BF16)
    for m in range(M):
        x = _to_f32(tl.load(x_ptr + m * stride_xm + offs_k, mask=k_mask, other=0.0), INTERP_BF16)
        if NORM:  # layer_ops.add_rms_norm_'s steps and roundings, the sum kept apart
            r = _to_f32(tl.load(res_ptr + m * stride_rm + offs_k, mask=k_mask, other=0.0),
                        INTERP_BF16)
            x = _round_to(x + r, dtype, INTERP_BF16)
            if pid == 0:
                tl.store(new_res_ptr + m * stride_nm + offs_k, _cast_out(x, dtype, INTERP_BF16),
                         mask=k_mask)
            rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / K + eps)
            x = _round_to(_round_to(x * rstd, dtype, INTERP_BF16) * norm_w, dtype, INTERP_BF16)
        acc = tl.sum(w * x[None, :], axis=1)
        if HAS_BIAS:
            acc += bias
        tl.store(out_ptr + m * stride_om + offs_n, _cast_out(acc, out_ptr.dtype.element_ty,
                                                             INTERP_BF16), mask=offs_n < N)


def supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """The kernel takes this product: 16-bit x and w of one dtype, w [N, K <= MAX_K] with
    contiguous rows, x [..., K]."""
    return (x.dtype in DTYPES and w.dtype == x.dtype and w.dim() == 2 and w.stride(-1) == 1
            and 0 < w.shape[1] <= MAX_K and x.shape[-1] == w.shape[1])


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
         backend: str = "auto", config: tuple[int, int] | None = None) -> torch.Tensor:
    """x [..., K] @ w.T + bias -> [..., N] in x's dtype, fp32 accumulation; any number of rows
    (speed is for a few: `MAX_ROWS`). config (BLOCK_N, num_warps) overrides the default
    (bench/). backend "auto": Triton on CUDA, F.linear on CPU. Raises ValueError on bad
    input."""
    return _gemv(x, w, bias, None, backend, config)[0]


def gemv_after_norm(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                    eps: float, w: torch.Tensor, bias: torch.Tensor | None = None, *,
                    backend: str = "auto", config: tuple[int, int] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(residual + x) @ w.T + bias, residual + x) with layer_ops.add_rms_norm_'s
    roundings, in one kernel: every program normalizes the row itself (it loads all of K
    anyway) and program 0 writes the sum, to a new tensor (the others still read `residual`).
    x, residual [M, K]; norm_weight [K]. backend "auto" on CPU: the torch references."""
    if residual.shape != x.shape or residual.dtype != x.dtype or x.dim() != 2 \
            or residual.stride(-1) != 1 or norm_weight.shape != x.shape[-1:] \
            or norm_weight.dtype != x.dtype or not norm_weight.is_contiguous():
        raise ValueError(f"gemv_after_norm: need x and residual [M, K] and norm_weight [K] of one "
                         f"dtype; got {x.dtype} {tuple(x.shape)}, {residual.dtype} "
                         f"{tuple(residual.shape)}, {norm_weight.dtype} "
                         f"{tuple(norm_weight.shape)}")
    return _gemv(x, w, bias, (residual, norm_weight, eps), backend, config)


def _gemv(x, w, bias, norm, backend, config):
    if not supported(x, w):
        raise ValueError(f"gemv: need 16-bit x [..., K] and w [N, K <= {MAX_K}] of one dtype "
                         f"with contiguous rows; got x {x.dtype} {tuple(x.shape)}, w {w.dtype} "
                         f"{tuple(w.shape)} strides {w.stride()}")
    n, k = w.shape
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype):
        raise ValueError(f"gemv: bias must be {x.dtype} ({n},), got {bias.dtype} "
                         f"{tuple(bias.shape)}")
    if not _use_triton(backend, x):
        if norm is None:
            return torch.nn.functional.linear(x, w, bias), None
        residual, norm_weight, eps = norm
        new_res = residual.clone()
        y = layer_ops.add_rms_norm_torch_(x, new_res, norm_weight, eps)
        return torch.nn.functional.linear(y, w, bias), new_res
    x2 = x.reshape(-1, k)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    res, norm_w, eps = norm if norm is not None else (x2, x2, 0.0)
    new_res = torch.empty_like(res) if norm is not None else x2
    if x2.shape[0]:
        block_k = triton.next_power_of_2(k)
        block_n, warps = config or (max(1, TILE // block_k), 4 if block_k <= TILE else 8)
        _gemv_kernel[(triton.cdiv(n, block_n),)](
            x2, w, bias if bias is not None else w, out, res, norm_w, new_res,
            x2.shape[0], n, k, eps, x2.stride(0), w.stride(0), out.stride(0), res.stride(0),
            new_res.stride(0), BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None,
            NORM=norm is not None, INTERP_BF16=interpreted_bf16(x.dtype, x),
            **({"num_warps": warps} if x.is_cuda else {}))
    return out.view(*x.shape[:-1], n), (new_res if norm is not None else None)
