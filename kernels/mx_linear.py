"""Weight-only MX linear: y = x @ dequantize(w).T + bias, activations fp32/bf16/fp16.

Weights live in the kernels' layout (`prepare_mx_weight`, once, at load): int32 word planes
[P, N, K // E], each word group holding E elements of a row (spread over k, see PLANES), stored
tile-major in 64-row tiles where the spread groups are 16 words (TILE_ROWS); every weight load
is a contiguous 16-byte vector. One tile builder (`weight_tile`) turns words into
values by bit placement: the code's sign, exponent and mantissa bits are moved straight into a
bf16 (or fp32) bit pattern, and one multiply by 2^(scale - bias) fixes the exponent bias and
applies the E8M0 scale at once (an element with exponent 0 lands on a subnormal of the target,
which that multiply scales exactly). Where a block's 2^(scale - bias) would overflow the target
(scale bytes above 127 + bias, checked at prepare) a second multiply splits it ("fold" off).

- decode (M <= 64 on a GPU), bf16 x, K a multiple of E * 16, not e4m3:
  `_mx_linear_decode_tc_kernel`, tensor cores for every M (x padded to 16, 32 or 64 rows, so
  each weight is decoded once for all rows); 3 pipeline stages. Per step one spread group (see
  PLANES) is decoded pair by pair (bf16x2 bits, one mul.rn.bf16x2 for the scale) in the
  registers that hold it and joined into wgmma's register operand without data exchange.
- decode otherwise (other x dtypes, e4m3, short K; the default on CPU): grid (N tiles, K
  splits); the next tile's words are loaded before the current one is decoded. M = 1 uses
  fp32 FMAs on a [BLOCK_N, BLOCK_K] tile (no tensor cores, no padding), M >= 2 dequantizes the
  tile to x's dtype and feeds tl.dot with BLOCK_M = 16 (rows past M masked). Both decode
  kernels reduce split-K partials in the same launch: the last program of a tile to finish (an
  atomic counter) sums them in fixed order (deterministic), adds the bias, writes y and re-arms
  the counter.
- prefill (M > 16, or > 64 where the tensor-core decode applies): on a GPU with 16-bit x the
  weight is dequantized once per call to x's dtype (one pass, `dequantize_linear_weight`) and
  cuBLAS runs the product: on the H200 that beats the fused kernel at large M and nearly ties
  it at M = 64 (bench/results/kernels_gpu.tune3.json).
  The fused kernel (grouped output tiles, dequantized tiles into tl.dot, computed transposed so
  the weights are wgmma's register operand) serves fp32 x and path="prefill", where a
  tl.dot_scaled variant (FP4/FP8 weights, 16-bit x) is used if the hardware has native MX MMA
  (sm_100+).
"""

from __future__ import annotations

import torch

from .mx import MXTensor, dequantize_mx_torch
from .mx_decode import DECODE_MAX_M, TC_DECODE_MAX_M, launch_decode, tc_decode_ok
from .mx_layout import MXLinearWeight, as_linear_weight, canonical_data
from .mx_prefill import dequantize_linear_weight, launch_prefill
from .triton_compat import use_triton as _use_triton

ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PREFILL_DEQUANT_MIN_M = DECODE_MAX_M + 1


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
              use_dot_scaled: bool | None = None, out: torch.Tensor | None = None,
              out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y [..., N] = x [..., K] @ dequantize(w).T + bias, in x's dtype, accumulated in fp32.

    out_dtype: None (x's) or float32: the decode path stores its fp32 sums as they are (logits);
    the other paths round to x's dtype first.

    Pass a prepared MXLinearWeight (prepare_mx_weight, at load); an MXTensor is prepared per call.
    path: "auto" (decode when M <= 16, dense dequantize + cuBLAS from PREFILL_DEQUANT_MIN_M rows
    of 16-bit x on a GPU), "decode", "prefill" (always the fused kernel) or "dequant".
    use_dot_scaled (prefill): None = only where MX MMA is native (sm_100+); needs e2m1/e4m3
    weights and 16-bit x. fp16 x: the dequantized weights must fit fp16's range. Raises
    ValueError on bad input."""
    w = as_linear_weight(w)
    _check_linear(x, w, bias)
    if path not in ("auto", "decode", "prefill", "dequant"):
        raise ValueError(f"mx_linear: path must be auto, decode, prefill or dequant, got {path!r}")
    if out_dtype not in (None, x.dtype, torch.float32):
        raise ValueError(f"mx_linear: out_dtype must be x's dtype or float32, got {out_dtype}")
    out_dtype = out_dtype or x.dtype
    if not _use_triton(backend, x):
        ref = mx_linear_torch(x, w, bias, out_dtype=out_dtype)
        return ref if out is None else out.copy_(ref)
    n, k = w.shape
    x2 = x.reshape(-1, k)  # [M, K]
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    m = x2.shape[0]
    tc_rows = TC_DECODE_MAX_M if x.is_cuda and tc_decode_ok(x2, w) else DECODE_MAX_M
    decode = path == "decode" or (path == "auto" and m <= tc_rows)
    if not decode and out_dtype != x.dtype:  # rounded to x's dtype by the paths below
        y = mx_linear(x, w, bias, backend=backend, path=path, use_dot_scaled=use_dot_scaled)
        return y.to(out_dtype) if out is None else out.copy_(y)
    if out is None:
        out = torch.empty(*x.shape[:-1], n, dtype=out_dtype, device=x.device)
    if not out.is_contiguous() or out.shape != (*x.shape[:-1], n) or out.dtype != out_dtype:
        raise ValueError(f"mx_linear: out must be contiguous {out_dtype} {(*x.shape[:-1], n)}")
    if m == 0:
        return out
    out2 = out.view(-1, n)  # [M, N]
    if decode:
        launch_decode(x2, w, out2, bias, split_k)
        return out
    if path == "dequant" or (path == "auto" and x.is_cuda and x.dtype != torch.float32
                             and m >= PREFILL_DEQUANT_MIN_M):
        wd = dequantize_linear_weight(w, x.dtype, backend=backend)
        torch.matmul(x2, wd.T, out=out2) if bias is None else \
            torch.addmm(bias, x2, wd.T, out=out2)
        return out
    can_dot_scaled = w.fmt in ("e2m1", "e4m3") and x.dtype != torch.float32
    if use_dot_scaled is None:  # emulated (upcast to bf16) below sm_100: no gain there
        use_dot_scaled = can_dot_scaled and x.is_cuda and \
            torch.cuda.get_device_capability(x.device)[0] >= 10
    elif use_dot_scaled and not can_dot_scaled:
        raise ValueError("mx_linear: tl.dot_scaled needs e2m1/e4m3 weights and 16-bit x")
    launch_prefill(x2, w, out2, bias, use_dot_scaled)
    return out


def mx_linear_torch(x: torch.Tensor, w: MXTensor | MXLinearWeight,
                    bias: torch.Tensor | None = None, *,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Reference: dequantize w exactly, matmul in fp32, add bias, cast to out_dtype (x's)."""
    w = as_linear_weight(w)
    _check_linear(x, w, bias)
    n, k = w.shape
    wf = dequantize_mx_torch(MXTensor(canonical_data(w), w.scales, w.fmt, (n, k)), torch.float32)
    y = x.float() @ wf.T
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype)
