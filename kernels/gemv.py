"""Few-row linear (decode GEMV): y [M, N] = x [M, K] @ w.T (+ bias), 16-bit x, w dense of x's
dtype or MX (kernels/mx_layout.py's layout, decoded exactly in registers), on the CUDA cores.

A program owns BLOCK_N rows of w and loads its whole [BLOCK_N, K] tile at once, before it reads
x: every load of a program is in flight together (16-byte vectors), with no K loop and no
pipeline to fill. Then the M rows of x are reduced against the tile held in registers (fp32
products and sums), so w is read once for all rows: up to 4 rows a pass (BLOCK_M, while they
hold at most a tile's elements), one reduction for all of them, each row's result the bits it
gets alone. On the H200 this beats cuBLAS on every 1B decode shape at M = 1
(bench/results/pdl_probe.json), where cuBLAS's kernels sit at a latency floor even with the
weights in L2 (bench/results/l2_prefetch_probe.json); from M = 2 cuBLAS mostly wins again, at
M = 4 on the large shapes (bench/results/gemv_gpu.md, gemv_gpu.multi_row.md; a tensor-core
kernel with many rows a program, tried: gemv_gpu.rows.md). With PDL (sm_90+) a GEMV starts
while the kernel before it runs and loads its weights until gdc_wait
(bench/results/gemv_gpu.engine_pdl.md). When the model takes it is a GemvOptions
(kernels/options.py) the engine passes down.

`decode_projection` runs a decoder block's first projection with what surrounds it, one kernel:
the add + RMSNorm before (each program normalizes the row: it holds all of K), and after it
RoPE with the new K/V written to the paged caches (q/k/v), or SiLU-and-mul (gate/up). Programs
then own row pairs: the two halves of a rotation, or gate j with up j. It removes about 110
launches from a 1B batch-1 decode step (bench/results/gemv_gpu.engine_fused.md).

The tile is [BLOCK_N, K'] with K' the next power of 2 >= K (masked past K): ~8k elements a
program (16k for MX weights), on 4 warps (8 past that). MX rows in spread groups of 16 decode
pair by pair: bf16x2 bit placement and one mul.rn.bf16x2 for the scale (mx_pairs.tc_pairs),
each half widened to fp32 by one integer op, and x split into the pairs' k order, so each
element costs ~4.6 instructions (sm_90 SASS from Triton 3.9) where the element-by-element
fp32 decode cost ~8. Rows of w past N are read as row N - 1 and not stored, so no load needs
a row mask.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import layer_ops
from .layer_ops import round_to_dtype
from .mx_layout import MXLinearWeight, format_args
from .mx_linear import mx_linear_torch
from .mx_pairs import row_words, tc_pairs
from .mx_tiles import weight_tile
from .options import DEFAULT_GEMV, GemvOptions
from .triton_compat import (
    cast_out,
    gdc_launch_dependents,
    gdc_wait,
    interpreted_bf16,
    pdl_supported,
    tl,
    to_f32,
    triton,
)
from .triton_compat import use_triton as _use_triton

MAX_K = 16384  # the tile holds a whole row of w
TILE = 8192  # elements of w per program
DTYPES = (torch.bfloat16, torch.float16)
MAX_BLOCK_M = 4  # rows of x a program reduces at once against its tile
MX_TILE = 2 * TILE  # elements of an MX weight per program: best on 18 of the 22 shapes there


@triton.jit
def _gemv_kernel(
    # x [M, K], w [N, K], bias [N] (if HAS_BIAS), out [M, N] ([M, N / 2] for SiLU-and-mul; of
    # x's dtype, or fp32 holding values rounded to it);
    # NORM: norm weight [K]; with ADD residual [M, K] and new residual [M, K] (program 0);
    # ROPE: positions [M], fp32 cos / sin [max_positions, HEAD_DIM / 2]; KV: slots [M] (< 0:
    # padding, not written), caches [num_blocks, PAGE_SIZE, Hkv, HEAD_DIM]
    # MX: w is the int32 word planes [P, N, K // E] and scales [N, K // 32] (mx_layout.py)
    x_ptr, w_ptr, bias_ptr, out_ptr, res_ptr, norm_w_ptr, new_res_ptr, pos_ptr, cos_ptr,
    sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, scales_ptr,
    M, N, K, eps, stride_xm, stride_wn, stride_om, stride_rm, stride_nm, stride_c, stride_cb,
    stride_cs, stride_ch, stride_plane, stride_sn,
    # EPILOGUE 0: plain, BLOCK_N rows a program; 1: SiLU-and-mul, 2: RoPE (q/k heads in the
    # first ROT_ROWS rows, Q_ROWS of them queries; v after), each BLOCK_N row pairs a program
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    NORM: tl.constexpr,
    ADD: tl.constexpr, EPILOGUE: tl.constexpr, KV: tl.constexpr, HEAD_DIM: tl.constexpr,
    ROT_ROWS: tl.constexpr, Q_ROWS: tl.constexpr, PAGE_SIZE: tl.constexpr,
    # MX weights: their element format and layout (mx_layout.format_args)
    MX: tl.constexpr, EBITS: tl.constexpr, MBITS: tl.constexpr, NAN_CODE: tl.constexpr,
    E: tl.constexpr, P: tl.constexpr, S: tl.constexpr, FOLD: tl.constexpr, TILE: tl.constexpr,
    NAN_SCALES: tl.constexpr, LAUNCH_PDL: tl.constexpr, INTERP_BF16: tl.constexpr,
):
    if LAUNCH_PDL:
        gdc_launch_dependents()  # the next kernel may start loading its own weights
    pid = tl.program_id(0)
    dtype = x_ptr.dtype.element_ty  # every rounding is to it
    HALF: tl.constexpr = HEAD_DIM // 2
    if EPILOGUE == 0:
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.minimum(offs_n, N - 1)  # rows past N read row N - 1; not stored
    else:  # row pairs (a, b): gate j and up j; a rotated pair (d, d + HALF); two v columns
        pairs = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = pairs < N // 2
        if EPILOGUE == 1:
            a = pairs
            b = pairs + N // 2
        else:
            rot = pairs < ROT_ROWS // 2
            a = tl.where(rot, (pairs // HALF) * HEAD_DIM + pairs % HALF,
                         ROT_ROWS + 2 * (pairs - ROT_ROWS // 2))
            b = tl.where(rot, a + HALF, a + 1)
        rows = tl.minimum(tl.join(a, b), N - 1)  # [BLOCK_N, 2]
    rows = rows.to(tl.int64)
    ROWS: tl.constexpr = BLOCK_N if EPILOGUE == 0 else 2 * BLOCK_N
    offs_k = tl.arange(0, BLOCK_K)
    k_mask = offs_k < K
    MX_PAIRS: tl.constexpr = MX and S == 16 and NAN_CODE < 0
    if MX_PAIRS:  # words in spread groups of 16: pairs decoded as bf16x2, widened to fp32
        # (rows [BLOCK_N] or row pairs [BLOCK_N, 2]: words, and pairs p_u, [*rows.shape, K' / E]
        # and [.., K' / E, 2]: elements 2u, 2u + 1 of each word, in k order of _x_pairs)
        w0, w1, w2, sa, sb = row_words(w_ptr, scales_ptr, rows, N, K // E, stride_plane,
                                        stride_wn, stride_sn, E, P, BLOCK_K, TILE)
        p0, p1, p2, p3, p4, p5, p6, p7 = tc_pairs(w0, w1, w2, sa, sb, EBITS, MBITS, E, FOLD,
                                                   NAN_SCALES, INTERP_BF16, True)
    elif MX:  # short rows (spread groups under 16) or e4m3: element by element in fp32
        w = weight_tile(w_ptr, scales_ptr, tl.reshape(rows, [ROWS]), 0, N, K // E,
                         stride_plane, stride_wn, stride_sn, EBITS, MBITS, NAN_CODE, E, P, S,
                         FOLD, 23, ROWS, BLOCK_K, TILE)
        if EPILOGUE != 0:
            w = tl.reshape(w, [BLOCK_N, 2, BLOCK_K])
    else:
        w = tl.load(w_ptr + tl.expand_dims(rows, -1) * stride_wn + offs_k, mask=k_mask,
                    other=0.0)
        w = to_f32(w, INTERP_BF16)
    if HAS_BIAS:
        bias = to_f32(tl.load(bias_ptr + rows), INTERP_BF16)
    if NORM:
        norm_w = to_f32(tl.load(norm_w_ptr + offs_k, mask=k_mask, other=0.0), INTERP_BF16)
    if LAUNCH_PDL:
        gdc_wait()  # everything above is constant; x and the rest come from earlier kernels
    for m0 in range(0, M, BLOCK_M):  # BLOCK_M rows at once (MX: one), each reduced alone
        offs_m = m0 + tl.arange(0, BLOCK_M)
        m_ok = offs_m < M
        mk = m_ok[:, None] & k_mask[None, :]
        x = to_f32(tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mk,
                           other=0.0), INTERP_BF16)  # [BLOCK_M, BLOCK_K]
        if NORM:  # layer_ops.add_rms_norm_'s steps and roundings, the sum kept apart
            if ADD:
                r = to_f32(tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_k[None, :],
                                   mask=mk, other=0.0), INTERP_BF16)
                x = round_to_dtype(x + r, dtype, INTERP_BF16)
                if pid == 0:
                    tl.store(new_res_ptr + offs_m[:, None] * stride_nm + offs_k[None, :],
                             cast_out(x, dtype, INTERP_BF16), mask=mk)
            rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / K + eps)
            x = round_to_dtype(round_to_dtype(x * rstd[:, None], dtype, INTERP_BF16)
                               * norm_w[None, :], dtype, INTERP_BF16)
        if MX_PAIRS:  # one product chain per element slot, then one reduction (one row)
            x0, x1, x2, x3, x4, x5, x6, x7 = _x_pairs(tl.reshape(x, [BLOCK_K]), E, BLOCK_K)
            prod = p0 * x0 + p1 * x1 + p2 * x2 + p3 * x3
            if E == 16:
                prod += p4 * x4 + p5 * x5 + p6 * x6 + p7 * x7
            acc = tl.expand_dims(tl.sum(tl.sum(prod, axis=len(prod.shape) - 1),
                                        axis=len(prod.shape) - 2), 0)
        elif EPILOGUE == 0:  # [BLOCK_M, BLOCK_N]
            acc = tl.sum(tl.expand_dims(w, 0) * x[:, None, :], axis=2)
        else:  # [BLOCK_M, BLOCK_N, 2]
            acc = tl.sum(tl.expand_dims(w, 0) * x[:, None, None, :], axis=3)
        if HAS_BIAS:
            acc += tl.expand_dims(bias, 0)
        out_rows = out_ptr + offs_m[:, None] * stride_om  # [BLOCK_M, 1]
        if EPILOGUE == 0:  # (fp32 out: the value rounded to x's dtype, as a cast after would)
            y = cast_out(acc, dtype, INTERP_BF16)
            tl.store(out_rows + offs_n[None, :], y.to(out_ptr.dtype.element_ty),
                     mask=m_ok[:, None] & (offs_n < N)[None, :])
        elif EPILOGUE == 1:  # layer_ops.silu_and_mul's roundings
            gate, up = tl.split(round_to_dtype(acc, dtype, INTERP_BF16))
            silu = round_to_dtype(gate * tl.sigmoid(gate), dtype, INTERP_BF16)
            tl.store(out_rows + pairs[None, :], cast_out(silu * up, dtype, INTERP_BF16),
                     mask=m_ok[:, None] & valid[None, :])
        else:  # layer_ops.apply_rotary_'s steps on the rounded products; v as they are
            lo, hi = tl.split(round_to_dtype(acc, dtype, INTERP_BF16))  # [BLOCK_M, BLOCK_N]
            pos = tl.load(pos_ptr + offs_m, mask=m_ok, other=0).to(tl.int64)
            rot_m = rot[None, :] & m_ok[:, None]
            at_c = pos[:, None] * stride_c + (pairs % HALF)[None, :]
            cos = tl.load(cos_ptr + at_c, mask=rot_m, other=1.0)
            sin = tl.load(sin_ptr + at_c, mask=rot_m, other=0.0)
            lo, hi = (tl.where(rot_m, lo * cos - hi * sin, lo),
                      tl.where(rot_m, hi * cos + lo * sin, hi))
            lo, hi = cast_out(lo, dtype, INTERP_BF16), cast_out(hi, dtype, INTERP_BF16)
            keep = m_ok[:, None] & valid[None, :]
            tl.store(out_rows + a[None, :], lo, mask=keep)
            tl.store(out_rows + b[None, :], hi, mask=keep)
            if KV:  # the new tokens' k and v into the caches (paged_attention.write_kv_cache)
                slot = tl.load(slot_ptr + offs_m, mask=m_ok, other=-1).to(tl.int64)
                k_col = rot & (a >= Q_ROWS)
                col = tl.where(k_col, a - Q_ROWS, a - ROT_ROWS)  # in the k or v heads
                at = ((slot // PAGE_SIZE) * stride_cb + (slot % PAGE_SIZE) * stride_cs)[:, None] \
                    + ((col // HEAD_DIM) * stride_ch + col % HEAD_DIM)[None, :]
                is_k = k_col[None, :]
                step = tl.where(is_k, HALF, 1)  # b's column after a's
                keep = keep & (slot >= 0)[:, None]
                tl.store(k_cache_ptr + at, lo, mask=keep & is_k)
                tl.store(k_cache_ptr + at + step, hi, mask=keep & is_k)
                is_v = (a >= ROT_ROWS)[None, :]
                tl.store(v_cache_ptr + at, lo, mask=keep & is_v)
                tl.store(v_cache_ptr + at + step, hi, mask=keep & is_v)


@triton.jit
def _x_pairs(x, E: tl.constexpr, BLOCK_K: tl.constexpr):
    """x [BLOCK_K] in natural k order -> per pair u (8 results; E = 8 fills the last four with
    copies) [BLOCK_K // E, 2]: x at k = 16 E t + 32 u + 2 jj + h for word j = 16 t + jj, the
    elements p_u of mx_pairs.tc_pairs multiply (mx_layout's spread groups of 16)."""
    T: tl.constexpr = BLOCK_K // (16 * E)
    G: tl.constexpr = BLOCK_K // E
    if E == 8:  # u = 2 u1 + u0; [t, jj] merged into the word j = 16 t + jj
        x = tl.reshape(tl.permute(tl.reshape(x, [T, 2, 2, 16, 2]), (0, 3, 4, 2, 1)),
                       [G, 2, 2, 2])  # [j, h, u0, u1]
        a, b = tl.split(x)
        x0, x1 = tl.split(a)
        x2, x3 = tl.split(b)
        x4, x5, x6, x7 = x0, x1, x2, x3
    else:  # u = 4 u2 + 2 u1 + u0
        x = tl.reshape(tl.permute(tl.reshape(x, [T, 2, 2, 2, 16, 2]), (0, 4, 5, 3, 2, 1)),
                       [G, 2, 2, 2, 2])  # [j, h, u0, u1, u2]
        a, b = tl.split(x)  # u2
        aa, ab = tl.split(a)  # u1
        ba, bb = tl.split(b)
        x0, x1 = tl.split(aa)
        x2, x3 = tl.split(ab)
        x4, x5 = tl.split(ba)
        x6, x7 = tl.split(bb)
    return x0, x1, x2, x3, x4, x5, x6, x7


def supported(x: torch.Tensor, w: torch.Tensor | MXLinearWeight) -> bool:
    """The kernel takes this product: 16-bit x [..., K] and w [N, K <= MAX_K], either of x's
    dtype with contiguous rows or an MX weight in mx_layout's layout (prepare_mx_weight)."""
    if isinstance(w, MXLinearWeight):
        return x.dtype in DTYPES and 0 < w.shape[1] <= MAX_K and x.shape[-1] == w.shape[1]
    return (x.dtype in DTYPES and w.dtype == x.dtype and w.dim() == 2 and w.stride(-1) == 1
            and 0 < w.shape[1] <= MAX_K and x.shape[-1] == w.shape[1])


def preferred(x: torch.Tensor, w: torch.Tensor | MXLinearWeight,
              options: GemvOptions = DEFAULT_GEMV) -> bool:
    """The model takes this kernel for x @ w.T: on CUDA, at most options.max_rows rows,
    supported, and an MX weight of at most options.mx_max_elements."""
    return (x.is_cuda and x.dim() == 2 and x.shape[0] <= options.max_rows and supported(x, w)
            and (not isinstance(w, MXLinearWeight)
                 or w.shape[0] * w.shape[1] <= options.mx_max_elements))


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
         out_dtype: torch.dtype | None = None, backend: str = "auto",
         config: tuple[int, ...] | None = None, pdl: bool = True) -> torch.Tensor:
    """x [..., K] @ w.T + bias -> [..., N] in x's dtype, fp32 accumulation; any number of rows
    (speed is for a few: GemvOptions.max_rows). out_dtype float32: the same values, stored as
    fp32 (the LM head's logits: no cast kernel after). config (BLOCK_N, num_warps[, BLOCK_M])
    overrides the default (bench/). pdl: launch with PDL where the device has it
    (GemvOptions.pdl). backend "auto": Triton on CUDA, F.linear on CPU. Raises ValueError on
    bad input."""
    _check(x, w, bias)
    if out_dtype not in (None, x.dtype, torch.float32):
        raise ValueError(f"gemv: out_dtype must be x's dtype or float32, got {out_dtype}")
    n, k = w.shape
    if not _use_triton(backend, x):
        return _linear_torch(x, w, bias).to(out_dtype or x.dtype)
    x2 = x.reshape(-1, k)
    out, _ = _launch(x2 if x2.stride(-1) == 1 else x2.contiguous(), w, bias, n, None, 0, None,
                     None, config, pdl, out_dtype=out_dtype)
    return out.view(*x.shape[:-1], n)


@dataclass(frozen=True)
class Norm:
    """The prologue: x -> rmsnorm(residual + x) (layer_ops.add_rms_norm_'s roundings); the sum
    comes back as a new tensor. residual None: x is the stream itself (rmsnorm(x); x back)."""

    residual: torch.Tensor | None  # [M, K]
    weight: torch.Tensor  # [K]
    eps: float


@dataclass(frozen=True)
class Rope:
    """The epilogue of a fused q/k/v projection: its first (num_heads + num_kv_heads) * head_dim
    columns (q heads, then k heads) rotated as layer_ops.apply_rotary_ does, at positions."""

    positions: torch.Tensor  # [M] int
    cos: torch.Tensor  # fp32 [max_positions, head_dim // 2]
    sin: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class KVWrite:
    """With Rope: the rotated k and the v of each row also go to the paged caches at slots (as
    paged_attention.write_kv_cache; negative slots are skipped)."""

    k_cache: torch.Tensor  # [num_blocks, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    slots: torch.Tensor  # [M] int


def decode_projection(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
                      norm: Norm | None = None, silu_and_mul: bool = False,
                      rope: Rope | None = None, kv: KVWrite | None = None,
                      backend: str = "auto", config: tuple[int, ...] | None = None,
                      pdl: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One kernel for a decoder projection with the elementwise steps around it:
    (epilogue(prologue(x) @ w.T + bias), the new residual or None). x [M, K].

    - norm: the add + RMSNorm before (every program normalizes the row itself: it loads all of
      K anyway; program 0 writes the sum to a new tensor, as the others still read residual);
    - silu_and_mul: a fused gate/up projection's activation, out [M, N / 2] (program pairs:
      gate row j with up row j);
    - rope (+ kv): RoPE on the q/k columns (programs own the pairs d, d + head_dim / 2), and
      the new k and v written to the caches.
    Each step rounds where layer_ops' kernel for it rounds. backend, config and pdl: as gemv's;
    "auto" on CPU: the torch references of those steps. Raises ValueError on bad input."""
    _check(x, w, bias)
    n, k = w.shape
    if x.dim() != 2:
        raise ValueError(f"decode_projection: x must be [M, K], got {tuple(x.shape)}")
    _check_steps(x, n, norm, silu_and_mul, rope, kv)
    if not _use_triton(backend, x):
        return decode_projection_torch(x, w, bias, norm, silu_and_mul, rope, kv)
    x2 = x if x.stride(-1) == 1 else x.contiguous()
    out, new_res = _launch(x2, w, bias, n // 2 if silu_and_mul else n, norm,
                           1 if silu_and_mul else 2 if rope is not None else 0, rope, kv, config,
                           pdl)
    if new_res is None and norm is not None:
        new_res = x  # no residual to add: x is the stream
    return out, new_res


def _check(x, w, bias) -> None:
    if not supported(x, w):
        about = f"MX {w.fmt} {w.shape}" if isinstance(w, MXLinearWeight) else \
            f"{w.dtype} {tuple(w.shape)} strides {w.stride()}"
        raise ValueError(f"gemv: need 16-bit x [..., K] and w [N, K <= {MAX_K}] (x's dtype with "
                         f"contiguous rows, or MX); got x {x.dtype} {tuple(x.shape)}, w {about}")
    n = w.shape[0]
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype):
        raise ValueError(f"gemv: bias must be {x.dtype} ({n},), got {bias.dtype} "
                         f"{tuple(bias.shape)}")


def _check_steps(x, n, norm, silu_and_mul, rope, kv) -> None:
    m, k = x.shape
    res = norm.residual if norm is not None else None
    if norm is not None and (norm.weight.shape != (k,) or norm.weight.dtype != x.dtype
                             or not norm.weight.is_contiguous() or res is not None and (
                                 res.shape != x.shape or res.dtype != x.dtype
                                 or res.stride(-1) != 1)):
        raise ValueError(f"decode_projection: norm needs residual [M, K] (or None) and weight "
                         f"[K] of x's dtype; got residual "
                         f"{None if res is None else (res.dtype, tuple(res.shape))}, weight "
                         f"{norm.weight.dtype} {tuple(norm.weight.shape)}")
    if silu_and_mul and (rope is not None or n % 2):
        raise ValueError(f"decode_projection: silu_and_mul needs an even N and no rope, N = {n}")
    if rope is not None:
        d, heads = rope.head_dim, rope.num_heads + 2 * rope.num_kv_heads
        if d % 2 or heads * d != n or rope.positions.shape != (m,) \
                or rope.cos.dtype != torch.float32 or rope.cos.shape != rope.sin.shape \
                or rope.cos.shape[-1] * 2 != d or not rope.cos.is_contiguous() \
                or not rope.sin.is_contiguous():
            raise ValueError(f"decode_projection: rope needs N = (heads + 2 kv heads) * head_dim "
                             f"(even), positions [M] and fp32 cos/sin [max_positions, head_dim "
                             f"/ 2]; got N {n}, {rope.num_heads}/{rope.num_kv_heads} heads of "
                             f"{d}, positions {tuple(rope.positions.shape)}, cos "
                             f"{rope.cos.dtype} {tuple(rope.cos.shape)}")
    if kv is not None:
        shape = kv.k_cache.shape
        if rope is None or kv.k_cache.dim() != 4 or kv.v_cache.shape != shape \
                or kv.v_cache.stride() != kv.k_cache.stride() or kv.k_cache.stride(-1) != 1 \
                or shape[2:] != (rope.num_kv_heads, rope.head_dim) or kv.slots.shape != (m,) \
                or kv.k_cache.dtype != x.dtype or kv.v_cache.dtype != x.dtype:
            raise ValueError(f"decode_projection: kv needs rope, caches [blocks, page, "
                             f"kv heads, head_dim] of x's dtype and slots [M]; got caches "
                             f"{kv.k_cache.dtype} {tuple(shape)}, slots {tuple(kv.slots.shape)}")


def decode_projection_torch(x: torch.Tensor, w: torch.Tensor | MXLinearWeight,
                            bias: torch.Tensor | None, norm: Norm | None, silu_and_mul: bool,
                            rope: Rope | None, kv: KVWrite | None
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The reference: layer_ops' and paged_attention's torch references of each step around
    F.linear (mx_linear_torch for MX weights). decode_projection's CPU path."""
    new_res = None
    if norm is not None and norm.residual is None:
        new_res, x = x, layer_ops.rms_norm_torch(x, norm.weight, norm.eps)
    elif norm is not None:
        new_res = norm.residual.clone()
        x = layer_ops.add_rms_norm_torch_(x, new_res, norm.weight, norm.eps)
    y = _linear_torch(x, w, bias)
    if silu_and_mul:
        y = layer_ops.silu_and_mul_torch(y)
    if rope is not None:
        m, d = y.shape[0], rope.head_dim
        q_cols, rot = rope.num_heads * d, (rope.num_heads + rope.num_kv_heads) * d
        layer_ops.apply_rotary_torch_(y[:, :rot].view(m, -1, d), rope.positions, rope.cos,
                                      rope.sin)
        if kv is not None:
            from .paged_attention import write_kv_cache_torch

            write_kv_cache_torch(y[:, q_cols:rot].view(m, -1, d), y[:, rot:].view(m, -1, d),
                                 kv.k_cache, kv.v_cache, kv.slots)
    return y, new_res


def _linear_torch(x, w, bias):
    if isinstance(w, MXLinearWeight):
        return mx_linear_torch(x, w, bias)
    return torch.nn.functional.linear(x, w, bias)


def _launch(x2, w, bias, n_out, norm, epilogue, rope, kv, config, pdl, out_dtype=None):
    """(out, the new residual when norm adds one, else None)."""
    m, (n, k) = x2.shape[0], w.shape
    out = torch.empty(m, n_out, dtype=out_dtype or x2.dtype, device=x2.device)
    adds = norm is not None and norm.residual is not None
    new_res = torch.empty_like(norm.residual) if adds else None
    if not m:
        return out, new_res
    block_k = triton.next_power_of_2(k)
    per = 2 if epilogue else 1  # rows a unit: a row, or a pair
    tile = MX_TILE if isinstance(w, MXLinearWeight) else TILE
    block_n, warps = (config or (max(1, tile // (per * block_k)),
                                 4 if per * block_k <= tile else 8))[:2]
    # rows of x a pass: a few at once while they are at most a tile's elements (a thread then
    # holds as many of x as of w), MX weights one at a time (their decode's pairs hold a single
    # row of x); config's third entry overrides (bench/)
    block_m = config[2] if config is not None and len(config) > 2 else \
        1 if isinstance(w, MXLinearWeight) else \
        max(1, min(triton.next_power_of_2(m), MAX_BLOCK_M, TILE // block_k))
    norm_w, eps = (norm.weight, norm.eps) if norm is not None else (x2, 0.0)
    res, res_out = (norm.residual, new_res) if adds else (x2, x2)  # (unread without ADD)
    if rope is not None:
        pos, cos, sin, d = rope.positions, rope.cos, rope.sin, rope.head_dim
        rot_rows, q_rows = (rope.num_heads + rope.num_kv_heads) * d, rope.num_heads * d
    else:
        pos, cos, sin, d, rot_rows, q_rows = x2, x2, x2, 2, 0, 0
    kc, vc, slots = (kv.k_cache, kv.v_cache, kv.slots) if kv is not None else (x2, x2, x2)
    pdl = pdl and pdl_supported(x2)
    if isinstance(w, MXLinearWeight):
        mx, fmt = True, dict(format_args(w), NAN_SCALES=w.nan_scales)
        w_arg, scales, stride_wn, stride_plane = w.planes, w.scales, w.planes.stride(1), \
            w.planes.stride(0)
    else:
        mx, fmt = False, dict(EBITS=1, MBITS=1, NAN_CODE=-1, E=8, P=1, S=1, FOLD=True, TILE=0,
                              NAN_SCALES=False)
        w_arg, scales, stride_wn, stride_plane = w, w, w.stride(0), 0
    cache_strides = kv.k_cache.stride()[:3] if kv is not None else (0, 0, 0)
    _gemv_kernel[(triton.cdiv(n // per, block_n),)](
        x2, w_arg, bias if bias is not None else x2, out, res, norm_w, res_out, pos, cos, sin,
        slots, kc, vc, scales, m, n, k, eps, x2.stride(0), stride_wn, out.stride(0),
        res.stride(0), res_out.stride(0), cos.stride(0) if rope is not None else 0,
        *cache_strides, stride_plane, scales.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None,
        NORM=norm is not None,
        ADD=adds, EPILOGUE=epilogue, KV=kv is not None, HEAD_DIM=d, ROT_ROWS=rot_rows,
        Q_ROWS=q_rows, PAGE_SIZE=kv.k_cache.shape[1] if kv is not None else 1, MX=mx, **fmt,
        LAUNCH_PDL=pdl, INTERP_BF16=interpreted_bf16(x2.dtype, x2),
        **({"num_warps": warps, "launch_pdl": pdl} if x2.is_cuda else {}))
    return out, new_res
