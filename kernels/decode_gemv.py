"""bf16/fp16 linears of a few rows (decode batches) with the step before them folded in.

At batch 1 a 1B-model decode step spends more on small kernels than their bytes warrant: the
RMSNorm before q/k/v and before gate/up and the SiLU-and-mul before down are one launch each, and
cuBLAS reads the small matrices at 1.3-2.5 TB/s (bench/results/decode_step_probe.json). Here one
kernel computes out = prologue(x) @ W.T for M <= MAX_M rows, the prologue being one of

- "none": x itself;
- "rms_norm": residual' = x + residual (rounded to the activation dtype, as torch's add), then
  weight * (residual' / rms(residual')) with the normalized value rounded before the product
  (kernels/layer_ops.py's add_rms_norm_, bit for bit); residual' is returned (a new tensor:
  the kernel's programs all read the old one);
- "silu_and_mul": x [M, 2K] (gate | up) -> silu(gate) * up, silu rounded before the product
  (layer_ops.silu_and_mul).

A program owns BLOCK_N rows of W (rows past N clamped to N - 1, not masked) and walks K in
BLOCK_K steps: it recomputes the prologue for its chunk of x (the rms norm's 1/rms from a first
pass over the row) and multiplies on the tensor cores, x padded to 16 rows. Every program
recomputes the same prologue: x is a few KB that stay in L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .layer_ops import _round_to
from .triton_compat import _cast_out, _round_bf16, _to_f32, interpreted_bf16
from .triton_compat import use_triton as _use_triton

PROLOGUES = ("none", "rms_norm", "silu_and_mul")
MAX_M = 16
# (BLOCK_N, BLOCK_K, num_warps, num_stages); bench/decode_gemv_probe.py
CONFIG = (32, 256, 4, 3)


@triton.jit
def _load_rows(ptr, offs_m, offs_k, stride, M, K, INTERP_BF16: tl.constexpr):
    """fp32 [BLOCK_M, BLOCK_K] of rows offs_m, columns offs_k (zeros outside M x K)."""
    mask = (offs_m < M)[:, None] & (offs_k < K)[None, :]
    return _to_f32(tl.load(ptr + offs_m[:, None] * stride + offs_k[None, :], mask=mask,
                           other=0.0), INTERP_BF16)


@triton.jit
def _decode_gemv_kernel(
    # x [M, K] ([M, 2K] for silu_and_mul); residual, new_residual [M, K]; norm_w [K];
    # w [N, K]; out [M, N]
    x_ptr, res_ptr, new_res_ptr, norm_w_ptr, w_ptr, out_ptr,
    M, N, K, eps, stride_x, stride_r, stride_nr, stride_w, stride_o,
    PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INTERP_BF16: tl.constexpr,
):
    pid = tl.program_id(0)
    dtype = out_ptr.dtype.element_ty
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    if PROLOGUE == 1:  # 1 / rms of each row, from a first pass (writing residual' once)
        sq = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            v = _load_rows(x_ptr, offs_m, offs_k, stride_x, M, K, INTERP_BF16)
            if HAS_RESIDUAL:
                v = _round_to(v + _load_rows(res_ptr, offs_m, offs_k, stride_r, M, K,
                                             INTERP_BF16), dtype, INTERP_BF16)
                if pid == 0:
                    mask = (offs_m < M)[:, None] & (offs_k < K)[None, :]
                    tl.store(new_res_ptr + offs_m[:, None] * stride_nr + offs_k[None, :],
                             _cast_out(v, dtype, INTERP_BF16), mask=mask)
            sq += tl.sum(v * v, axis=1)
        rstd = 1.0 / tl.sqrt(sq / K + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rows[:, None] * stride_w + offs_k[None, :],
                    mask=(offs_k < K)[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        if PROLOGUE == 1:
            v = _load_rows(x_ptr, offs_m, offs_k, stride_x, M, K, INTERP_BF16)
            if HAS_RESIDUAL:
                v = _round_to(v + _load_rows(res_ptr, offs_m, offs_k, stride_r, M, K,
                                             INTERP_BF16), dtype, INTERP_BF16)
            nw = _to_f32(tl.load(norm_w_ptr + offs_k, mask=offs_k < K, other=0.0), INTERP_BF16)
            v = _round_to(v * rstd[:, None], dtype, INTERP_BF16) * nw[None, :]
        elif PROLOGUE == 2:
            gate = _load_rows(x_ptr, offs_m, offs_k, stride_x, M, K, INTERP_BF16)
            up = _load_rows(x_ptr + K, offs_m, offs_k, stride_x, M, K, INTERP_BF16)
            v = _round_to(gate * tl.sigmoid(gate), dtype, INTERP_BF16) * up
        else:
            v = _load_rows(x_ptr, offs_m, offs_k, stride_x, M, K, INTERP_BF16)
        if INTERP_BF16:  # the interpreter's bf16 tl.dot is wrong: exact fp32 on bf16 values
            acc = tl.dot(_round_bf16(v), tl.trans(_to_f32(w, INTERP_BF16)), acc,
                         input_precision="ieee")
        else:
            acc = tl.dot(v.to(w.dtype), tl.trans(w), acc)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_o + offs_n[None, :],
             _cast_out(acc, dtype, INTERP_BF16), mask=mask)


def decode_gemv(x: torch.Tensor, weight: torch.Tensor, *, prologue: str = "none",
                residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                eps: float = 1e-6, backend: str = "auto", config: tuple | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(prologue(x) @ weight.T [M, N], residual' or None); see the module docstring.

    x [M, K] (silu_and_mul: [M, 2K]) and weight [N, K] of one 16-bit dtype, M <= MAX_M;
    rms_norm takes norm_weight [K] and eps, and residual [M, K] (optional)."""
    _check(x, weight, prologue, residual, norm_weight)
    if not _use_triton(backend, x):
        return decode_gemv_torch(x, weight, prologue=prologue, residual=residual,
                                 norm_weight=norm_weight, eps=eps)
    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    new_res = torch.empty_like(residual) if residual is not None else None
    if m == 0:
        return out, new_res
    block_n, block_k, warps, stages = config or CONFIG
    block_k = min(block_k, triton.next_power_of_2(k))
    dummy = x  # pointers the prologue does not read
    _decode_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, residual if residual is not None else dummy,
        new_res if new_res is not None else dummy,
        norm_weight if norm_weight is not None else dummy, weight, out,
        m, n, k, eps, x.stride(0), residual.stride(0) if residual is not None else 0,
        new_res.stride(0) if new_res is not None else 0, weight.stride(0), out.stride(0),
        PROLOGUE=PROLOGUES.index(prologue), HAS_RESIDUAL=residual is not None,
        BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k,
        INTERP_BF16=interpreted_bf16(x.dtype, x), num_warps=warps, num_stages=stages)
    return out, new_res


def _check(x, weight, prologue, residual, norm_weight) -> None:
    if prologue not in PROLOGUES:
        raise ValueError(f"decode_gemv: prologue must be one of {PROLOGUES}, got {prologue!r}")
    if x.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x.dtype \
            or x.dim() != 2 or weight.dim() != 2 or x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError(f"decode_gemv: need 2-D bf16/fp16 x and weight of one dtype with "
                         f"contiguous rows; got x {x.dtype} {tuple(x.shape)}, weight "
                         f"{weight.dtype} {tuple(weight.shape)}")
    k = weight.shape[1] * (2 if prologue == "silu_and_mul" else 1)
    if x.shape[1] != k or x.shape[0] > MAX_M:
        raise ValueError(f"decode_gemv: x must be [<= {MAX_M}, {k}] for weight "
                         f"{tuple(weight.shape)} and prologue {prologue!r}; got {tuple(x.shape)}")
    if prologue == "rms_norm" and (norm_weight is None or norm_weight.shape != weight.shape[1:]
                                   or norm_weight.dtype != x.dtype):
        raise ValueError(f"decode_gemv: rms_norm needs norm_weight [{weight.shape[1]}] of "
                         f"{x.dtype}")
    if residual is not None and (prologue != "rms_norm" or residual.shape != x.shape
                                 or residual.dtype != x.dtype or residual.stride(-1) != 1):
        raise ValueError("decode_gemv: residual goes with prologue 'rms_norm', shaped and "
                         "typed as x")


def decode_gemv_torch(x: torch.Tensor, weight: torch.Tensor, *, prologue: str = "none",
                      residual: torch.Tensor | None = None,
                      norm_weight: torch.Tensor | None = None, eps: float = 1e-6
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The reference: layer_ops' torch references, then F.linear."""
    from .layer_ops import rms_norm_torch, silu_and_mul_torch

    new_res = None
    if prologue == "rms_norm":
        if residual is not None:
            new_res = residual + x
            x = new_res
        x = rms_norm_torch(x, norm_weight, eps)
    elif prologue == "silu_and_mul":
        x = silu_and_mul_torch(x)
    return torch.nn.functional.linear(x, weight), new_res
