"""Weight-only MX linear: y = x @ dequantize(w).T + bias, activations fp32/bf16/fp16.

Two Triton paths share one weight-tile loader (`_load_weight_tile`):
- decode (M <= 16): memory bound. Split-K over a grid (N tiles, K splits, M tiles); each program
  streams packed weight bytes (an FP4 row of a 256-wide K tile is 128 contiguous bytes, loaded
  16 bytes a thread), dequantizes in registers by bit ops and accumulates in fp32. With one split
  the program adds the bias and writes y; else fp32 partials [SPLIT_K, M, N] are summed in a fixed
  order (deterministic, no atomics) by a second small kernel that adds the bias and casts.
- prefill (M > 16): compute bound. Output tiles with grouped ordering; weight tiles dequantized to
  x's dtype feed tl.dot (tensor cores) with fp32 accumulation; bias and cast fused. A tl.dot_scaled
  variant (FP4/FP8 weights, 16-bit x) is used where the hardware has native MX MMA (sm_100+).

`prepare_mx_weight` builds the kernels' layout once, at load: FP4/FP8 keep the canonical bytes;
FP6 splits each 3-byte packing group into three byte planes so every load is contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .mx import MXTensor, _decode, _scale_value, dequantize_mx_torch, get_format
from .triton_compat import _cast_out, _round_bf16, _to_f32, interpreted_bf16
from .triton_compat import use_triton as _use_triton

ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DECODE_MAX_M = 16


@dataclass(frozen=True)
class MXLinearWeight:
    """An [N, K] MX weight in the kernels' layout. Build with prepare_mx_weight, once."""

    planes: torch.Tensor  # uint8 [group_bytes, N, K // pack]: byte b of packing group g: [b, n, g]
    scales: torch.Tensor  # uint8 [N, K // 32], canonical
    fmt: str
    shape: tuple[int, int]  # (N, K)


def prepare_mx_weight(w: MXTensor) -> MXLinearWeight:
    """Re-arrange a canonical [N, K] MXTensor for the linear kernels (a view for FP4/FP8)."""
    if not isinstance(w, MXTensor) or len(w.shape) != 2:
        raise ValueError("prepare_mx_weight expects a 2-D MXTensor [N, K]")
    f = get_format(w.fmt)
    n, k = w.shape
    groups = w.data.contiguous().view(n, k // f.pack, f.group_bytes)  # [N, K // pack, group_bytes]
    planes = groups.permute(2, 0, 1).contiguous() if f.group_bytes > 1 else groups.permute(2, 0, 1)
    return MXLinearWeight(planes, w.scales.contiguous(), w.fmt, (n, k))


def _as_linear_weight(w: MXTensor | MXLinearWeight) -> MXLinearWeight:
    return w if isinstance(w, MXLinearWeight) else prepare_mx_weight(w)


@triton.jit
def _load_weight_tile(
    planes_ptr, scales_ptr, offs_n, k0, N, K, stride_plane, stride_wn, stride_sn,
    EBITS: tl.constexpr, MBITS: tl.constexpr, NAN_CODE: tl.constexpr, PACK: tl.constexpr,
    GROUP_BYTES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """fp32 [BLOCK_N, BLOCK_K] dequantized weights w[offs_n, k0:k0+BLOCK_K]; 0 outside N, K."""
    GROUPS: tl.constexpr = BLOCK_K // PACK
    BITS: tl.constexpr = 1 + EBITS + MBITS
    g = k0 // PACK + tl.arange(0, GROUPS)
    mask = (offs_n[:, None] < N) & (g[None, :] < K // PACK)
    ptrs = planes_ptr + offs_n[:, None] * stride_wn + g[None, :]  # [BLOCK_N, GROUPS]
    word = tl.load(ptrs, mask=mask, other=0).to(tl.int32)
    for b in tl.static_range(1, GROUP_BYTES):
        word |= tl.load(ptrs + b * stride_plane, mask=mask, other=0).to(tl.int32) << (8 * b)
    if PACK == 1:
        w = _decode(word, EBITS, MBITS, NAN_CODE)
    elif PACK == 2:  # element 2i in the low nibble
        w = tl.join(_decode(word & 0xF, EBITS, MBITS, NAN_CODE),
                    _decode(word >> 4, EBITS, MBITS, NAN_CODE))
    else:  # element 4i + t at bits 6t; join(join(c0, c2), join(c1, c3)) orders [i, t]
        c0 = _decode(word & 0x3F, EBITS, MBITS, NAN_CODE)
        c1 = _decode((word >> BITS) & 0x3F, EBITS, MBITS, NAN_CODE)
        c2 = _decode((word >> 2 * BITS) & 0x3F, EBITS, MBITS, NAN_CODE)
        c3 = _decode((word >> 3 * BITS) & 0x3F, EBITS, MBITS, NAN_CODE)
        w = tl.join(tl.join(c0, c2), tl.join(c1, c3))
    kb = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    smask = (offs_n[:, None] < N) & (kb[None, :] < K // 32)
    s = tl.load(scales_ptr + offs_n[:, None] * stride_sn + kb[None, :], mask=smask, other=127)
    w = tl.reshape(w, (BLOCK_N, BLOCK_K // 32, 32)) * _scale_value(s.to(tl.int32))[:, :, None]
    return tl.reshape(w, (BLOCK_N, BLOCK_K))


@triton.jit
def _dot_wt(x, w, acc, INTERP_BF16: tl.constexpr):
    """acc + x @ w.T with w rounded to x's dtype. INTERP_BF16 (the interpreter's bf16 tl.dot is
    wrong, its casts truncate): the same rounded operands multiplied in fp32, exact for bf16."""
    if INTERP_BF16:
        wt = tl.trans(_round_bf16(w))
        return tl.dot(_to_f32(x, INTERP_BF16), wt, acc, input_precision="ieee")
    return tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision="ieee")


@triton.jit
def _mx_linear_decode_kernel(
    # pointers: x [M, K]; weight planes [group_bytes, N, K // pack], scales [N, K // 32];
    # bias [N] (read only if HAS_BIAS); out [M, N] (one split) or partial [SPLIT_K, M, N] fp32
    x_ptr, planes_ptr, scales_ptr, bias_ptr, out_ptr,
    # sizes; k_per_split is a multiple of BLOCK_K
    M, N, K, k_per_split,
    # strides: out's split stride is 0 with one split
    stride_xm, stride_plane, stride_wn, stride_sn, stride_os, stride_om,
    # element format
    EBITS: tl.constexpr, MBITS: tl.constexpr, NAN_CODE: tl.constexpr, PACK: tl.constexpr,
    GROUP_BYTES: tl.constexpr,
    # tiling; USE_DOT: tensor cores for BLOCK_M == 16, else broadcast FMAs. EPILOGUE (one
    # split): add the bias and write out in its dtype; else fp32 partials for _reduce_kernel
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr,
    EPILOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, INTERP_BF16: tl.constexpr,
):
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        w = _load_weight_tile(planes_ptr, scales_ptr, offs_n, k0, N, K, stride_plane, stride_wn,
                              stride_sn, EBITS, MBITS, NAN_CODE, PACK, GROUP_BYTES, BLOCK_N,
                              BLOCK_K)  # [BLOCK_N, BLOCK_K]
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
        if USE_DOT:
            acc = _dot_wt(x, w, acc, INTERP_BF16)
        else:
            acc += tl.sum(_to_f32(x, INTERP_BF16)[:, None, :] * w[None, :, :], axis=2)
    out = out_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if EPILOGUE:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out, _cast_out(acc, out_ptr.dtype.element_ty, INTERP_BF16), mask=mask)
    else:
        tl.store(out, acc, mask=mask)


@triton.jit
def _mx_linear_reduce_kernel(
    # pointers: partial [SPLIT_K, M * N] fp32; bias [N] (read only if HAS_BIAS); out [M * N]
    partial_ptr, bias_ptr, out_ptr,
    # sizes
    MN, N, stride_ps,
    # tiling
    SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
    INTERP_BF16: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # fixed order: deterministic
        acc += tl.load(partial_ptr + s * stride_ps + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, _cast_out(acc, out_ptr.dtype.element_ty, INTERP_BF16), mask=mask)


@triton.jit
def _mx_linear_prefill_kernel(
    # pointers: x [M, K]; weight planes [group_bytes, N, K // pack], scales [N, K // 32];
    # bias [N] (read only if HAS_BIAS); out [M, N] in x's dtype
    x_ptr, planes_ptr, scales_ptr, bias_ptr, out_ptr,
    # sizes
    M, N, K,
    # strides
    stride_xm, stride_plane, stride_wn, stride_sn, stride_om,
    # element format; DOT_SCALED_FMT: "" or tl.dot_scaled's name for the weight format
    EBITS: tl.constexpr, MBITS: tl.constexpr, NAN_CODE: tl.constexpr, PACK: tl.constexpr,
    GROUP_BYTES: tl.constexpr, DOT_SCALED_FMT: tl.constexpr, X_FMT: tl.constexpr,
    # tiling
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr, INTERP_BF16: tl.constexpr,
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
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
        if DOT_SCALED_FMT == "":
            w = _load_weight_tile(planes_ptr, scales_ptr, offs_n, k0, N, K, stride_plane,
                                  stride_wn, stride_sn, EBITS, MBITS, NAN_CODE, PACK, GROUP_BYTES,
                                  BLOCK_N, BLOCK_K)  # [BLOCK_N, BLOCK_K]
            acc = _dot_wt(x, w, acc, INTERP_BF16)
        else:  # packed codes [BLOCK_K // PACK, BLOCK_N] and raw scales [BLOCK_N, BLOCK_K // 32]
            g = k0 // PACK + tl.arange(0, BLOCK_K // PACK)
            wq = tl.load(planes_ptr + offs_n[None, :] * stride_wn + g[:, None],
                         mask=(offs_n[None, :] < N) & (g[:, None] < K // PACK), other=0)
            kb = k0 // 32 + tl.arange(0, BLOCK_K // 32)
            s = tl.load(scales_ptr + offs_n[:, None] * stride_sn + kb[None, :],
                        mask=(offs_n[:, None] < N) & (kb[None, :] < K // 32), other=127)
            acc = tl.dot_scaled(x, None, X_FMT, wq, s, DOT_SCALED_FMT, acc=acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, _cast_out(acc, out_ptr.dtype.element_ty, INTERP_BF16),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def _format_args(fmt: str) -> dict:
    f = get_format(fmt)
    return dict(EBITS=f.ebits, MBITS=f.mbits, NAN_CODE=0x7F if fmt == "e4m3" else -1,
                PACK=f.pack, GROUP_BYTES=f.group_bytes)


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" \
        else 1


# decode tiles by BLOCK_M: (BLOCK_N, BLOCK_K), about 8K weights in registers a program.
# Starting points, to be tuned on the H200 (bench/).
_DECODE_TILES = {1: (64, 128), 2: (64, 64), 4: (32, 64), 8: (16, 64), 16: (64, 128)}


def _launch_decode(x2, w, out2, bias, split_k):
    (m, k), n = x2.shape, w.shape[0]
    block_m = min(triton.next_power_of_2(m), DECODE_MAX_M)
    block_n, block_k = _DECODE_TILES[block_m]
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    if split_k is None:  # about four programs an SM: enough loads in flight to hide latency
        split_k = max(1, min(triton.cdiv(4 * _num_sms(x2.device), tiles), triton.cdiv(k, block_k)))
    block_k = min(block_k, max(32, triton.next_power_of_2(triton.cdiv(k, split_k))))
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    interp_bf16 = interpreted_bf16(x2.dtype, x2)
    dst = out2 if split_k == 1 else torch.empty(split_k, m, n, dtype=torch.float32,
                                                device=x2.device)
    grid = (triton.cdiv(n, block_n), split_k, triton.cdiv(m, block_m))
    _mx_linear_decode_kernel[grid](
        x2, w.planes, w.scales, bias if bias is not None else w.scales, dst, m, n, k, k_per_split,
        x2.stride(0), w.planes.stride(0), w.planes.stride(1), w.scales.stride(0),
        0 if split_k == 1 else dst.stride(0), dst.stride(-2), **_format_args(w.fmt),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, USE_DOT=block_m == 16,
        EPILOGUE=split_k == 1, HAS_BIAS=bias is not None, INTERP_BF16=interp_bf16)
    if split_k > 1:
        block = 1024
        _mx_linear_reduce_kernel[(triton.cdiv(m * n, block),)](
            dst, bias if bias is not None else dst, out2, m * n, n, dst.stride(0),
            SPLIT_K=split_k, BLOCK=block, HAS_BIAS=bias is not None, INTERP_BF16=interp_bf16)


def _launch_prefill(x2, w, out2, bias, use_dot_scaled):
    (m, k), n = x2.shape, w.shape[0]
    on_gpu = x2.is_cuda
    block_m, block_n, block_k = (128, 128, 64) if on_gpu else (32, 32, 64)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _mx_linear_prefill_kernel[grid](
        x2, w.planes, w.scales, bias if bias is not None else w.scales, out2, m, n, k,
        x2.stride(0), w.planes.stride(0), w.planes.stride(1), w.scales.stride(0), out2.stride(0),
        **_format_args(w.fmt), DOT_SCALED_FMT=w.fmt if use_dot_scaled else "",
        X_FMT={torch.bfloat16: "bf16", torch.float16: "fp16"}.get(x2.dtype, ""),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, HAS_BIAS=bias is not None,
        INTERP_BF16=interpreted_bf16(x2.dtype, x2),
        **(dict(num_warps=8, num_stages=3) if on_gpu else {}))


def _check_linear(x: torch.Tensor, w: MXLinearWeight, bias: torch.Tensor | None) -> None:
    if x.dtype not in ACT_DTYPES:
        raise ValueError(f"mx_linear: x dtype must be float32, bfloat16 or float16, got {x.dtype}")
    n, k = w.shape
    if x.dim() == 0 or x.shape[-1] != k:
        raise ValueError(f"mx_linear: x {tuple(x.shape)} does not match weight [N={n}, K={k}]")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"mx_linear: bias must have shape ({n},), got {tuple(bias.shape)}")


def mx_linear(x: torch.Tensor, w: MXTensor | MXLinearWeight, bias: torch.Tensor | None = None,
              *, backend: str = "auto", path: str = "auto", split_k: int | None = None,
              use_dot_scaled: bool | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """y [..., N] = x [..., K] @ dequantize(w).T + bias, in x's dtype, accumulated in fp32.

    Pass a prepared MXLinearWeight (prepare_mx_weight, at load); an MXTensor is prepared per call.
    path: "auto" (decode when M <= 16), "decode" or "prefill". use_dot_scaled (prefill): None =
    only where MX MMA is native (sm_100+); needs e2m1/e4m3 weights and 16-bit x. fp16 x: the
    dequantized weights must fit fp16's range. Raises ValueError on bad input."""
    w = _as_linear_weight(w)
    _check_linear(x, w, bias)
    if path not in ("auto", "decode", "prefill"):
        raise ValueError(f"mx_linear: path must be auto, decode or prefill, got {path!r}")
    if not _use_triton(backend, x):
        ref = mx_linear_torch(x, w, bias)
        return ref if out is None else out.copy_(ref)
    n, k = w.shape
    x2 = x.reshape(-1, k)  # [M, K]
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    if out is None:
        out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    if not out.is_contiguous() or out.shape != (*x.shape[:-1], n) or out.dtype != x.dtype:
        raise ValueError(f"mx_linear: out must be contiguous {x.dtype} {(*x.shape[:-1], n)}")
    if x2.shape[0] == 0:
        return out
    out2 = out.view(-1, n)  # [M, N]
    if path == "decode" or (path == "auto" and x2.shape[0] <= DECODE_MAX_M):
        _launch_decode(x2, w, out2, bias, split_k)
        return out
    can_dot_scaled = w.fmt in ("e2m1", "e4m3") and x.dtype != torch.float32
    if use_dot_scaled is None:  # emulated (upcast to bf16) below sm_100: no gain there
        use_dot_scaled = can_dot_scaled and x.is_cuda and \
            torch.cuda.get_device_capability(x.device)[0] >= 10
    elif use_dot_scaled and not can_dot_scaled:
        raise ValueError("mx_linear: tl.dot_scaled needs e2m1/e4m3 weights and 16-bit x")
    _launch_prefill(x2, w, out2, bias, use_dot_scaled)
    return out


def mx_linear_torch(x: torch.Tensor, w: MXTensor | MXLinearWeight,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: dequantize w exactly, matmul in fp32, add bias, cast to x's dtype."""
    w = _as_linear_weight(w)
    _check_linear(x, w, bias)
    f = get_format(w.fmt)
    n, k = w.shape
    data = w.planes.permute(1, 2, 0).reshape(n, f.packed_len(k))  # canonical [N, packed K]
    wf = dequantize_mx_torch(MXTensor(data, w.scales, w.fmt, (n, k)), torch.float32)
    y = x.float() @ wf.T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)

