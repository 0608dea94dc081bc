"""MX linear decode (few rows, kernels/mx_linear.py's overview): the tensor-core kernel (bf16
x, spread groups of 16) and the FMA / tl.dot kernel for the rest, each reducing its split-K
partials in the same launch (the last program of a tile sums them in fixed order), with their
tuned configs and launchers."""

from __future__ import annotations

import torch

from .mx import get_format
from .mx_layout import MAX_GROUP, PLANES, MXLinearWeight, format_args
from .mx_pairs import tc_scales, tc_step, tc_words
from .mx_tiles import build_tile, dot_wt, load_groups
from .triton_compat import cast_out, interpreted_bf16, tl, to_f32, triton

DECODE_MAX_M = 16
TC_DECODE_MAX_M = 64  # the tensor-core decode (bf16 x on a GPU) serves up to this many rows


@triton.jit
def _mx_linear_decode_kernel(
    # pointers: x [M, K]; weight planes [P, N, K // E] int32, scales [N, K // 32]; bias [N]
    # (read only if HAS_BIAS); out [M, N]; split-K partials [split_k, M, N] fp32 and per-tile
    # counters (zero on entry and exit; read only if SPLIT)
    x_ptr, planes_ptr, scales_ptr, bias_ptr, out_ptr, partial_ptr, counter_ptr,
    # sizes; num_words = K // E; words_per_split is a multiple of BLOCK_K // E
    M, N, K, num_words, split_k, words_per_split,
    # strides
    stride_xm, stride_plane, stride_wn, stride_sn, stride_om, stride_ps,
    # element format and layout (see PLANES, _scale_factors)
    EBITS: tl.constexpr, MBITS: tl.constexpr, NAN_CODE: tl.constexpr, E: tl.constexpr,
    P: tl.constexpr, S: tl.constexpr, FOLD: tl.constexpr, TILE: tl.constexpr,
    # tiling. USE_DOT: tensor cores on a dequantized tile in x's dtype (bf16 bits straight from
    # the codes when WBF16), BLOCK_M 16; else BLOCK_M 1 and fp32 FMAs. PREFETCH: load the next
    # tile's words before decoding this one (more bytes in flight)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr,
    PREFETCH: tl.constexpr, WBF16: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
    INTERP_BF16: tl.constexpr,
):
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    G: tl.constexpr = BLOCK_K // E
    j_lo = pid_k * words_per_split
    j_hi = tl.minimum(j_lo + words_per_split, num_words)
    F: tl.constexpr = 7 if USE_DOT and WBF16 else 23
    if USE_DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:  # BLOCK_M == 1: fp32 products, summed over k at the end
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    if PREFETCH:  # the next tile's words are loaded before this one is used
        n0, n1, n2 = load_groups(planes_ptr, offs_n, j_lo, tl.where(j_lo < j_hi, N, 0),
                                  num_words, stride_plane, stride_wn, P, G, TILE)
    for j0 in range(j_lo, j_hi, G):
        if PREFETCH:
            w0, w1, w2 = n0, n1, n2
            n0, n1, n2 = load_groups(planes_ptr, offs_n, j0 + G, tl.where(j0 + G < j_hi, N, 0),
                                      num_words, stride_plane, stride_wn, P, G, TILE)
        else:
            w0, w1, w2 = load_groups(planes_ptr, offs_n, j0, N, num_words, stride_plane,
                                      stride_wn, P, G, TILE)
        w = build_tile(w0, w1, w2, scales_ptr, offs_n, j0, N, num_words, stride_sn, EBITS, MBITS,
                        NAN_CODE, E, S, FOLD, F, BLOCK_N, BLOCK_K)
        offs_k = j0 * E + tl.arange(0, BLOCK_K)
        if USE_DOT:
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                        mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
            acc = dot_wt(x, w, acc, INTERP_BF16)
        else:
            x = tl.load(x_ptr + pid_m * stride_xm + offs_k, mask=offs_k < K, other=0.0)
            acc2 += w * to_f32(x, INTERP_BF16)[None, :]
    if not USE_DOT:
        acc = tl.sum(acc2, axis=1)[None, :]  # [1, BLOCK_N]
    _finish_decode(acc, offs_m, offs_n, pid_k, pid_m * tl.num_programs(0) + pid_n, M, N,
                   split_k, bias_ptr, out_ptr, partial_ptr, counter_ptr, stride_om, stride_ps,
                   SPLIT, HAS_BIAS, INTERP_BF16)


@triton.jit
def _mx_linear_decode_tc_kernel(
    # pointers: x [M, K] bf16; weight planes [P, N, K // E] int32 in spread groups of 16,
    # scales [N, K // 32] (4-byte aligned rows); bias, out, partials, counters as in
    # _mx_linear_decode_kernel
    x_ptr, planes_ptr, scales_ptr, bias_ptr, out_ptr, partial_ptr, counter_ptr,
    # sizes; num_words = K // E; words_per_split is a multiple of 16
    M, N, K, num_words, split_k, words_per_split,
    # strides
    stride_xm, stride_plane, stride_wn, stride_sn, stride_om, stride_ps,
    # element format (no NaN codes: not e4m3); NAN_SCALES: some scale byte may be 0xFF
    EBITS: tl.constexpr, MBITS: tl.constexpr, E: tl.constexpr, P: tl.constexpr,
    FOLD: tl.constexpr, NAN_SCALES: tl.constexpr, TILE: tl.constexpr,
    # tiling; BLOCK_M (16, 32 or 64) >= M: every row of x in one program
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
    INTERP_BF16: tl.constexpr,
):
    """Decode (M <= 64) on tensor cores: per step one spread group (16 word groups, E * 16 k)
    of BLOCK_N rows; each pair's [BLOCK_N, 16, 2] tile is decoded in the registers that hold
    its words and the tiles are joined into the dot's left operand with no data exchange
    between threads (spread_tile4/8). acc = w @ x.T [BLOCK_N, BLOCK_M] in fp32 (rows of x
    past M are zero): each weight is decoded once for all M rows. Rows past N are read as row
    N - 1 (no masks on the weight loads; the store drops them); a split covers whole spread
    groups. The loads are software-pipelined by Triton (num_stages). INTERP_BF16: the Triton
    interpreter, which has no inline asm and whose bf16 tl.dot is wrong: the same bf16
    weights, multiplied in fp32."""
    S: tl.constexpr = 16
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1)
    offs_m = tl.arange(0, BLOCK_M)
    j_lo = pid_k * words_per_split
    j_hi = tl.minimum(j_lo + words_per_split, num_words)
    sw_ptrs = (scales_ptr + rows * stride_sn).to(tl.pointer_type(tl.int32), bitcast=True)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # every split holds a group (_launch_decode_tc): declared, the loop has no zero-trip path,
    # whose zeroed accumulators made ptxas serialize the wgmma chain (tests/cpu/
    # test_wgmma_pipeline.py)
    tl.assume(j_lo < j_hi)
    for j0 in range(j_lo, j_hi, S):
        w0, w1, w2 = tc_words(planes_ptr, rows, j0, num_words, stride_plane, stride_wn, P, TILE)
        sa, sb = tc_scales(sw_ptrs, j0, E)
        acc = tc_step(acc, w0, w1, w2, sa, sb, x_ptr, offs_m, j0, M, stride_xm, EBITS, MBITS,
                       E, FOLD, NAN_SCALES, BLOCK_N, INTERP_BF16)
    _finish_decode(tl.trans(acc), offs_m, offs_n, pid_k, pid_n, M, N, split_k, bias_ptr, out_ptr,
                   partial_ptr, counter_ptr, stride_om, stride_ps, SPLIT, HAS_BIAS, INTERP_BF16)


@triton.jit
def _finish_decode(acc, offs_m, offs_n, pid_k, tile, M, N, split_k, bias_ptr, out_ptr,
                   partial_ptr, counter_ptr, stride_om, stride_ps, SPLIT: tl.constexpr,
                   HAS_BIAS: tl.constexpr, INTERP_BF16: tl.constexpr):
    """Write acc [BLOCK_M, BLOCK_N] (+ bias) to out, or, with SPLIT, this split's partial; the
    last split of a tile to finish (an atomic counter) sums the partials in fixed order
    (deterministic), adds the bias, writes out and re-arms the counter."""
    BLOCK_M: tl.constexpr = acc.shape[0]
    BLOCK_N: tl.constexpr = acc.shape[1]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SPLIT:
        tile_ptrs = offs_m[:, None] * N + offs_n[None, :]
        tl.store(partial_ptr + pid_k * stride_ps + tile_ptrs, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the release below
        done = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if done == split_k - 1:  # the last split of this tile: sum in fixed order
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(split_k):
                acc += tl.load(partial_ptr + s * stride_ps + tile_ptrs, mask=mask, other=0.0,
                               cache_modifier=".cg")
            tl.atomic_xchg(counter_ptr + tile, 0)  # re-arm for the next call
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(
                    tl.float32)[None, :]
            out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
            tl.store(out, cast_out(acc, out_ptr.dtype.element_ty, INTERP_BF16), mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out, cast_out(acc, out_ptr.dtype.element_ty, INTERP_BF16), mask=mask)


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" \
        else 1


# decode configs: (BLOCK_N, BLOCK_K, num_warps, num_stages) for the FMA path (M = 1) and the
# tl.dot path (M >= 2); GPU only, the interpreter uses small tiles. Tuned on the H200 (bench/).
_DECODE_FMA = (8, 512, 4, 1)
_DECODE_DOT = (32, 256, 4, 1)
_DECODE_TARGET_PROGRAMS_PER_SM = 4
_DECODE_PREFETCH = True


def _tc_config(e: int, m: int, n: int, sms: int) -> tuple[tuple[int, int, int], int]:
    """The tensor-core decode's (BLOCK_N, num_warps, num_stages) and programs per SM (split-K),
    from an H200 sweep over the 1B/8B decode shapes with the weights cycled past L2, as a model
    reads them (bench/results/mx_decode_probe.past_l2.json; a sweep over one weight read again
    and again, half of it from L2, would pick otherwise):
    - FP4 at one row: 128-row tiles, 4 programs an SM;
      at more rows 64-row tiles (128 lose there), 4 programs an SM unless the tiles alone
      outnumber 2 an SM, then 8 (the 28672-row weights are slower at 4);
    - FP6 (~160 registers: ~3 programs fit an SM): 2 programs an SM, one wave, unless the tiles
      alone outnumber that, then 8, finer splits evening out the waves."""
    many_tiles = triton.cdiv(n, 64) > 2 * sms
    if e == 8:
        return ((128, 4, 3), 4) if m == 1 else ((64, 4, 3), 8 if many_tiles else 4)
    return (64, 4, 3), (8 if many_tiles else 2)


def tc_decode_ok(x2: torch.Tensor, w: MXLinearWeight) -> bool:
    """The tensor-core decode kernel applies: bf16 x, spread groups of 16 (K > 0), no NaN
    codes."""
    return x2.dtype == torch.bfloat16 and w.group == MAX_GROUP and w.fmt != "e4m3" \
        and w.shape[1] > 0


def _launch_decode_tc(x2, w, out2, bias, split_k, config=None, programs_per_sm=None):
    (m, k), n = x2.shape, w.shape[0]
    on_gpu = x2.is_cuda
    e, _ = PLANES[get_format(w.fmt).bits]
    tuned, tuned_pps = _tc_config(e, m, n, _num_sms(x2.device))
    block_n, num_warps, num_stages, *maxnreg = (config or tuned) if on_gpu else (16, 4, 1)
    launch = dict(num_warps=num_warps, num_stages=num_stages) if on_gpu else {}
    if maxnreg:  # (bench/: a register cap for ptxas)
        launch["maxnreg"] = maxnreg[0]
    tiles = triton.cdiv(n, block_n)
    groups = k // (e * MAX_GROUP)
    if split_k is None:
        want = (programs_per_sm or tuned_pps) * _num_sms(x2.device)
        split_k = max(1, min(want // tiles, groups))
    split_k = triton.cdiv(groups, triton.cdiv(groups, max(1, min(split_k, groups))))
    words_per_split = triton.cdiv(groups, split_k) * MAX_GROUP
    interp_bf16 = interpreted_bf16(x2.dtype, x2)
    counters = w.counters
    if split_k > 1 and counters.numel() < tiles:
        counters = torch.zeros(tiles, dtype=torch.int32, device=x2.device)
    partial = torch.empty(split_k, m, n, dtype=torch.float32, device=x2.device) \
        if split_k > 1 else out2
    f = get_format(w.fmt)
    _mx_linear_decode_tc_kernel[(tiles, split_k)](
        x2, w.planes, w.scales, bias if bias is not None else w.scales, out2, partial, counters,
        m, n, k, k // e, split_k, words_per_split, x2.stride(0), w.planes.stride(0),
        w.planes.stride(1), w.scales.stride(0), out2.stride(0),
        partial.stride(0) if split_k > 1 else 0,
        EBITS=f.ebits, MBITS=f.mbits, E=e, P=PLANES[f.bits][1], FOLD=w.fold,
        NAN_SCALES=w.nan_scales, TILE=w.tile, BLOCK_M=max(16, triton.next_power_of_2(m)),
        BLOCK_N=block_n,
        SPLIT=split_k > 1,
        HAS_BIAS=bias is not None, INTERP_BF16=interp_bf16, **launch)


def launch_decode(x2, w, out2, bias, split_k, config=None, use_dot=None, programs_per_sm=None,
                   prefetch=None, tc=None):
    """config (BLOCK_N, BLOCK_K, num_warps, num_stages), use_dot, programs_per_sm, tc (the
    tensor-core kernel; default: where it applies, on a GPU): overrides of the tuned choices
    (bench/)."""
    if tc is None:  # past TC_DECODE_MAX_M rows the kernel below takes any M
        tc = x2.is_cuda and tc_decode_ok(x2, w) and x2.shape[0] <= TC_DECODE_MAX_M
    if tc:
        if not tc_decode_ok(x2, w) or x2.shape[0] > TC_DECODE_MAX_M:
            raise ValueError("mx_linear: the tensor-core decode needs bf16 x, K a multiple of "
                             f"E * 16, no e4m3 and at most {TC_DECODE_MAX_M} rows")
        return _launch_decode_tc(x2, w, out2, bias, split_k, config, programs_per_sm)
    (m, k), n = x2.shape, w.shape[0]
    on_gpu = x2.is_cuda
    use_dot = m > 1 if use_dot is None else use_dot or m > 1
    block_m = 16 if use_dot else 1
    if config is None:
        config = (_DECODE_DOT if use_dot else _DECODE_FMA) if on_gpu else (16, 128, 4, 1)
    block_n, block_k, num_warps, num_stages = config
    e, _ = PLANES[get_format(w.fmt).bits]
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    if split_k is None:  # enough programs in flight to hide the memory latency
        want = (programs_per_sm or _DECODE_TARGET_PROGRAMS_PER_SM) * _num_sms(x2.device)
        split_k = max(1, min(want // tiles, triton.cdiv(k, block_k)))
    block_k = max(e * w.group, min(block_k, max(2 * e, triton.next_power_of_2(
        triton.cdiv(k, split_k)))))
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    words_per_split = k_per_split // e
    interp_bf16 = interpreted_bf16(x2.dtype, x2)
    counters = w.counters
    if split_k > 1 and counters.numel() < tiles:
        counters = torch.zeros(tiles, dtype=torch.int32, device=x2.device)
    partial = torch.empty(split_k, m, n, dtype=torch.float32, device=x2.device) \
        if split_k > 1 else out2
    grid = (triton.cdiv(n, block_n), split_k, triton.cdiv(m, block_m))
    _mx_linear_decode_kernel[grid](
        x2, w.planes, w.scales, bias if bias is not None else w.scales, out2, partial, counters,
        m, n, k, k // e, split_k, words_per_split, x2.stride(0), w.planes.stride(0),
        w.planes.stride(1), w.scales.stride(0), out2.stride(0),
        partial.stride(0) if split_k > 1 else 0,
        **format_args(w), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, USE_DOT=use_dot,
        PREFETCH=_DECODE_PREFETCH if prefetch is None else prefetch,
        WBF16=x2.dtype == torch.bfloat16 and not interp_bf16, SPLIT=split_k > 1,
        HAS_BIAS=bias is not None, INTERP_BF16=interp_bf16,
        **(dict(num_warps=num_warps, num_stages=num_stages) if on_gpu else {}))
