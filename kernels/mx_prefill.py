"""MX linear prefill (many rows, kernels/mx_linear.py's overview): the fused kernel (grouped
output tiles, dequantized tiles into tl.dot, or tl.dot_scaled where the hardware has native MX
MMA) and the one-pass dequantize of a weight to x's dtype that cuBLAS then multiplies."""

from __future__ import annotations

import torch

from .mx import MXTensor, dequantize_mx_torch, get_format
from .mx_layout import PLANES, MXLinearWeight, as_linear_weight, canonical_data, format_args
from .mx_tiles import dot_w_xt, weight_tile
from .triton_compat import cast_out, interpreted_bf16, tl, triton
from .triton_compat import use_triton as _use_triton


@triton.jit
def _mx_linear_prefill_kernel(
    # pointers: x [M, K]; weight planes [P, N, K // E] int32 (packed bytes [N, K // 2] for
    # DOT_SCALED_FMT), scales [N, K // 32]; bias [N] (read only if HAS_BIAS); out [M, N]
    x_ptr, planes_ptr, scales_ptr, bias_ptr, out_ptr,
    # sizes; num_words = K // E
    M, N, K, num_words,
    # strides
    stride_xm, stride_plane, stride_wn, stride_sn, stride_om,
    # element format; DOT_SCALED_FMT: "" or tl.dot_scaled's name for the weight format
    EBITS: tl.constexpr, MBITS: tl.constexpr, NAN_CODE: tl.constexpr, E: tl.constexpr,
    P: tl.constexpr, S: tl.constexpr, FOLD: tl.constexpr, TILE: tl.constexpr, PACK: tl.constexpr,
    DOT_SCALED_FMT: tl.constexpr,
    X_FMT: tl.constexpr,
    # tiling
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    WBF16: tl.constexpr, HAS_BIAS: tl.constexpr, INTERP_BF16: tl.constexpr,
):
    # grouped ordering: GROUP_M row tiles share each weight column tile while it is in L2
    pid = tl.program_id(0)
    num_pid_m, num_pid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    first_m = pid // (GROUP_M * num_pid_n) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_pid_n)) % group_size
    pid_n = (pid % (GROUP_M * num_pid_n)) // group_size
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # out.T
    for j0 in range(0, num_words, BLOCK_K // E):
        k0 = j0 * E
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
        if DOT_SCALED_FMT == "":
            w = weight_tile(planes_ptr, scales_ptr, offs_n, j0, N, num_words, stride_plane,
                             stride_wn, stride_sn, EBITS, MBITS, NAN_CODE, E, P, S, FOLD,
                             7 if WBF16 else 23, BLOCK_N, BLOCK_K, TILE)
            acc = dot_w_xt(w, x, acc, INTERP_BF16)
        else:  # packed codes [BLOCK_K // PACK, BLOCK_N] and raw scales [BLOCK_N, BLOCK_K // 32]
            g = k0 // PACK + tl.arange(0, BLOCK_K // PACK)
            wq = tl.load(planes_ptr + offs_n[None, :] * stride_wn + g[:, None],
                         mask=(offs_n[None, :] < N) & (g[:, None] < K // PACK), other=0)
            kb = k0 // 32 + tl.arange(0, BLOCK_K // 32)
            s = tl.load(scales_ptr + offs_n[:, None] * stride_sn + kb[None, :],
                        mask=(offs_n[:, None] < N) & (kb[None, :] < K // 32), other=127)
            acc = tl.trans(tl.dot_scaled(x, None, X_FMT, wq, s, DOT_SCALED_FMT,
                                         acc=tl.trans(acc)))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(out, cast_out(acc, out_ptr.dtype.element_ty, INTERP_BF16),
             mask=(offs_m[None, :] < M) & (offs_n[:, None] < N))


@triton.jit
def _mx_linear_dequant_kernel(
    # pointers: weight planes [P, N, K // E] int32, scales [N, K // 32]; out [N, K]
    planes_ptr, scales_ptr, out_ptr,
    # sizes (num_words = K // E) and strides
    N, K, num_words, stride_plane, stride_wn, stride_sn, stride_on,
    # element format and layout
    EBITS: tl.constexpr, MBITS: tl.constexpr, NAN_CODE: tl.constexpr, E: tl.constexpr,
    P: tl.constexpr, S: tl.constexpr, FOLD: tl.constexpr, TILE: tl.constexpr,
    # tiling
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WBF16: tl.constexpr,
    INTERP_BF16: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    w = weight_tile(planes_ptr, scales_ptr, offs_n, tl.program_id(1) * (BLOCK_K // E), N,
                     num_words, stride_plane, stride_wn, stride_sn, EBITS, MBITS, NAN_CODE, E, P,
                     S, FOLD, 7 if WBF16 else 23, BLOCK_N, BLOCK_K, TILE)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    v = w if WBF16 else cast_out(w, out_ptr.dtype.element_ty, INTERP_BF16)
    tl.store(out_ptr + offs_n[:, None] * stride_on + offs_k[None, :], v,
             mask=(offs_n[:, None] < N) & (offs_k[None, :] < K))


# BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages. Not 3 stages: with Triton 3.6 on the H200,
# (128, 128, 64, 8, 3) returns garbage (inf, ~3e38) for e2m1 weights with a bias from M ~ 1024
# rows on, while every other tile tried is exact; 2 stages is as fast over the four formats
# (bench/results/kernels_gpu.prefill_config.json).
_PREFILL = (128, 128, 64, 8, 2)


def launch_prefill(x2, w, out2, bias, use_dot_scaled, config=None):
    (m, k), n = x2.shape, w.shape[0]
    on_gpu = x2.is_cuda
    block_m, block_n, block_k, num_warps, num_stages = config or (
        _PREFILL if on_gpu else (32, 32, 64, 4, 1))
    f = get_format(w.fmt)
    if PLANES[f.bits][0] * w.group > block_k:  # whole spread groups; x's smem tile must fit
        block_k = PLANES[f.bits][0] * w.group
        block_m = min(block_m, 64)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    planes = canonical_data(w) if use_dot_scaled else w.planes  # bytes [N, K // PACK]
    interp_bf16 = interpreted_bf16(x2.dtype, x2)
    _mx_linear_prefill_kernel[grid](
        x2, planes, w.scales, bias if bias is not None else w.scales, out2, m, n, k,
        k // PLANES[f.bits][0], x2.stride(0), w.planes.stride(0), planes.stride(-2),
        w.scales.stride(0), out2.stride(0),
        **format_args(w), PACK=f.pack, DOT_SCALED_FMT=w.fmt if use_dot_scaled else "",
        X_FMT={torch.bfloat16: "bf16", torch.float16: "fp16"}.get(x2.dtype, ""),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8,
        WBF16=x2.dtype == torch.bfloat16 and not interp_bf16, HAS_BIAS=bias is not None,
        INTERP_BF16=interp_bf16,
        **(dict(num_warps=num_warps, num_stages=num_stages) if on_gpu else {}))


# (BLOCK_N, BLOCK_K, num_warps) of the dequantize kernel on the GPU: small tiles, many programs
# (the winner of bench/tune/mx_dequant_tune.py on the H200)
_DEQUANT = (16, 256, 2)


def dequantize_linear_weight(w: MXTensor | MXLinearWeight, dtype: torch.dtype,
                             *, backend: str = "auto") -> torch.Tensor:
    """w as a dense [N, K] `dtype` tensor (exact in fp32, one rounding to dtype)."""
    w = as_linear_weight(w)
    n, k = w.shape
    if not _use_triton(backend, w.planes):
        return dequantize_mx_torch(MXTensor(canonical_data(w), w.scales, w.fmt, (n, k)), dtype)
    out = torch.empty(n, k, dtype=dtype, device=w.planes.device)
    on_gpu = w.planes.is_cuda
    block_n, block_k, num_warps = _DEQUANT if on_gpu else (16, 64, 4)
    block_k = max(block_k, PLANES[get_format(w.fmt).bits][0] * w.group)
    interp_bf16 = interpreted_bf16(dtype, out)
    _mx_linear_dequant_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        w.planes, w.scales, out, n, k, k // PLANES[get_format(w.fmt).bits][0],
        w.planes.stride(0), w.planes.stride(1),
        w.scales.stride(0), out.stride(0), **format_args(w), BLOCK_N=block_n, BLOCK_K=block_k,
        WBF16=dtype == torch.bfloat16 and not interp_bf16, INTERP_BF16=interp_bf16,
        **(dict(num_warps=num_warps) if on_gpu else {}))
    return out
