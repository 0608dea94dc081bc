"""A probe, not the library: few-row MXFP4 linear on FP8 tensor cores, written in Gluon so each
32-k block's wgmma overlaps the scaling of the block before it (bench/mx_f8_gluon_probe.py).

y [M, N] = x [M, K] @ dequantize(w).T with e2m1 weights, M <= 16, sm_90 (Triton >= 3.6).

bench/mx_f8_kernel.py (the Triton probe) showed the idea: e2m1 codes placed into e4m3 bytes are
exact (~5 integer ops a word of 8 codes), x runs as hi + lo e4m3 parts, and each block's fp32
partial is scaled by its E8M0 scale on the CUDA cores. What it lacked: Triton waits for every
wgmma whose result is read (`wgmma.wait_group 0`). Here the waits are explicit (`PIPE=2`): block
b + 1's wgmma is issued, then `wait(1)` (all but the newest done) and block b's partial is
scaled, the newest wgmma still running; the last block of a step is drained (`wait(0)`) before
the loop's back edge, because ptxas serializes every wgmma of the kernel (C7514, "non wgmma
instructions reading accumulator registers ... between start and end of the pipeline stage")
when one is in flight across it (tried: the loop-carried copy reads its registers). `PIPE=0`
waits after every wgmma, as Triton does. Measured (bench/results/mx_f8_gluon_probe.md): the two
are within 1%, so the wgmma wait is not what bounds this kernel; neither is the words' prefetch
depth (`DEPTH=2`, two steps ahead, measured no faster). Splitting x inside the kernel was tried
and dropped: no faster, and wrong, because of the fp8 -> fp32 upcast of hi in that layout
(bench/gluon_fp8_split_diag.py).

Shapes, swap-AB: the wgmma's M is the weight rows (64 a warpgroup, decoded in registers: the
register operand), its N is x's rows, hi parts then lo parts (NX = 2 * MP columns: the lo part
costs a column, not a second wgmma), its K one 32-block (m64 nNX k32, one instruction). The
words' register layout (`word_layout`) is the wgmma A fragment's own: a thread holds, for rows r
and r + 8 of its warp's 16, word t = lane % 4 of each block of a step (one 16-byte load a row:
the 4 blocks' words are adjacent in the tile-major layout, word 4t + b), and the decoded bytes
land in the fragment's registers with no data movement (`convert_layout(assert_trivial=True)`).

x (`prepare_x_rows`, its own launch): [K / 32, NX, 32] e4m3, a 32-block's NX rows (x's MP rows'
hi parts, then their lo parts, rows past M zero), and a power-of-2 scale a row. A program copies
its K range of x into shared memory once (MAX_STEPS 128-k steps at most), then streams weights.
Words [N / 64, K / 128, 64, 16] (bench/mx_f8_kernel.prepare_weight with tile=64).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from mx_f8_kernel import X_HEADROOM, _round_e4m3  # bench/mx_f8_kernel.py
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

TILE = 64  # the words' tile rows


@triton.jit
def _x_rows_kernel(x_ptr, out_ptr, scale_ptr, M, K, stride_xm, MP: tl.constexpr,
                   BLOCK_K: tl.constexpr, HEADROOM: tl.constexpr):
    """Row m of x -> its hi and lo e4m3 parts in rows m and MP + m of every 32-block of out
    [K / 32, 2 MP, 32], and its power-of-2 scale (rows m >= M: zeros)."""
    m = tl.program_id(0)
    valid = m < M
    amax = tl.zeros((BLOCK_K,), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(x_ptr + m * stride_xm + offs, mask=(offs < K) & valid, other=0.0)
        amax = tl.maximum(amax, tl.abs(v.to(tl.float32)))
    top = tl.max(amax, 0)
    e = ((top.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.where(top > 0, e - HEADROOM, 0)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)
    tl.store(scale_ptr + m, tl.where(valid, ((127 + e) << 23).to(tl.float32, bitcast=True), 0.0))
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(x_ptr + m * stride_xm + offs, mask=(offs < K) & valid, other=0.0)
        v = v.to(tl.float32) * inv
        hi = _round_e4m3(v)
        lo = _round_e4m3(v - hi)
        out = out_ptr + (offs // 32) * (2 * MP * 32) + m * 32 + offs % 32
        tl.store(out, hi.to(tl.float8e4nv), mask=offs < K)
        tl.store(out + MP * 32, lo.to(tl.float8e4nv), mask=offs < K)


def prepare_x_rows(x2: torch.Tensor, mp: int):
    m, k = x2.shape
    parts = torch.empty(k // 32, 2 * mp, 32, dtype=torch.float8_e4m3fn, device=x2.device)
    scale = torch.empty(mp, dtype=torch.float32, device=x2.device)
    _x_rows_kernel[(mp,)](x2, parts, scale, m, k, x2.stride(0), MP=mp,
                          BLOCK_K=min(4096, triton.next_power_of_2(k)), HEADROOM=X_HEADROOM)
    return parts, scale


@gluon.constexpr_function
def word_layout(BLOCK_N):
    """[BLOCK_N, 16] words of a step (word 4t + b: block b's word t) as the wgmma A fragment
    wants them: registers b (the 16-byte load), row + 8, row + 64..; lanes t, then rows 0..7;
    warps 16-row groups."""
    regs = [[0, 1], [0, 2], [8, 0]] + [[64 * i, 0] for i in (1, 2, 4, 8) if 64 * i < BLOCK_N]
    return gl.DistributedLinearLayout(regs, [[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
                                      [[16, 0], [32, 0]], [], [BLOCK_N, 16])


@gluon.jit
def _bytes(r):
    """int32 [..] -> int8 [.., 2, 2]: byte c of r at [c % 2, c // 2]."""
    lo = gl.join(r.to(gl.int8), (r >> 8).to(gl.int8))
    hi = gl.join((r >> 16).to(gl.int8), (r >> 24).to(gl.int8))
    return gl.join(lo, hi)


@gluon.jit
def _f8_operand(w, a_layout: gl.constexpr):
    """e4m3 [BLOCK_N, 32] (k order) of one block's words [BLOCK_N, 4] (mx_f8_kernel's word
    format: "A" bytes in place, "B" bytes one shift each way), in the wgmma A fragment."""
    ra = w & -1667457892  # 0x9C9C9C9C
    rb = ((w << 2) & -1936946036) | ((w >> 2) & 0x10101010)  # 0x8C8C8C8C
    t = gl.join(_bytes(ra), _bytes(rb))  # [BN, t, c % 2, c // 2, part]
    t = gl.permute(t, (0, 4, 1, 3, 2))  # [BN, part, t, c // 2, c % 2]: k = 16 part + 4t + c
    a = gl.reshape(t, (w.shape[0], 32)).to(gl.float8e4nv, bitcast=True)
    return gl.convert_layout(a, a_layout, assert_trivial=True)


@gluon.jit
def _factor(sc, B: gl.constexpr, NAN_SCALES: gl.constexpr):
    """fp32 2^(s - 127) * 2^6 of scale byte B of sc (a row's 4 blocks in an int32)."""
    s = (sc >> (8 * B)) & 0xFF
    f = ((s + 6) << 23).to(gl.float32, bitcast=True)
    if NAN_SCALES:
        f = gl.where(s == 255, float("nan"), f)
    return f


@gluon.jit
def _scaled_add(acc, p, sc, B: gl.constexpr, NAN_SCALES: gl.constexpr):
    """acc + block B's partial p times its weight rows' factors."""
    return acc + p * _factor(sc, B, NAN_SCALES)[:, None]


@gluon.jit
def _mx_linear_decode_gluon_kernel(
    xp_ptr, xscale_ptr, words_ptr, scales_ptr, out_ptr, partial_ptr, counter_ptr,
    M, N, num_words, n_steps, steps_per_split, split_k, stride_sn, stride_om, stride_ps,
    BLOCK_N: gl.constexpr, MP: gl.constexpr, MAX_STEPS: gl.constexpr,
    NAN_SCALES: gl.constexpr, SPLIT: gl.constexpr, PIPE: gl.constexpr, DEPTH: gl.constexpr,
    num_warps: gl.constexpr,
):
    NX: gl.constexpr = 2 * MP
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, NX, 32])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)
    wl: gl.constexpr = word_layout(BLOCK_N)
    row_l: gl.constexpr = gl.SliceLayout(1, mma)
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    s_lo = pid_k * steps_per_split
    s_hi = gl.minimum(s_lo + steps_per_split, n_steps)

    # this tile's words (tile-major, TILE rows a tile) and scales (an int32 a row and step)
    rows = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, wl))
    cols = gl.arange(0, 16, layout=gl.SliceLayout(0, wl))
    w_ptrs = words_ptr + ((rows // 64) * num_words * 64 + (rows % 64) * 16)[:, None] \
        + cols[None, :] + s_lo * 16 * 64
    srows = gl.minimum(pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=row_l), N - 1)
    s_ptrs = scales_ptr.to(gl.pointer_type(gl.int32), bitcast=True) + srows * (stride_sn // 4) \
        + s_lo

    w = gl.load(w_ptrs)  # the first step's words and scales in flight during x's copy
    sc = gl.load(s_ptrs)

    # x's blocks of this split into shared memory, once, 16 blocks at a time
    xs_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=32, element_bitwidth=8,
                                                   rank=2)
    x_smem = gl.allocate_shared_memory(gl.float8e4nv, [4 * MAX_STEPS * NX, 32], xs_layout)
    xl: gl.constexpr = gl.BlockedLayout([1, 16], [16, 2], [4, 1], [1, 0])
    xr = gl.arange(0, 16 * NX, layout=gl.SliceLayout(1, xl))  # (block, row)
    xc = gl.arange(0, 32, layout=gl.SliceLayout(0, xl))
    for c in gl.static_range(MAX_STEPS // 4):
        rows_c = c * 16 * NX + xr
        xv = gl.load(xp_ptr + (4 * s_lo * NX + rows_c)[:, None] * 32 + xc[None, :],
                     mask=(rows_c < 4 * (s_hi - s_lo) * NX)[:, None], other=0.0)
        x_smem.slice(c * 16 * NX, 16 * NX).store(xv)
    # a block's [NX, 32]: whole swizzle atoms, so the 3-d view has the same bytes
    x_smem = x_smem._reinterpret(gl.float8e4nv, [4 * MAX_STEPS, NX, 32], xs_layout)
    fence_async_shared()

    zero = gl.zeros((BLOCK_N, NX), gl.float32, layout=mma)
    acc = gl.zeros((BLOCK_N, NX), gl.float32, layout=mma)
    if DEPTH == 2:  # the step after next in flight too
        w_2 = gl.load(w_ptrs + gl.minimum(1, s_hi - s_lo - 1) * (16 * 64))
        sc_2 = gl.load(s_ptrs + gl.minimum(1, s_hi - s_lo - 1))
    for s in range(s_lo, s_hi):
        step = gl.minimum(s + DEPTH, s_hi - 1) - s_lo  # a later step's words, loaded ahead
        w_next = gl.load(w_ptrs + step * (16 * 64))
        sc_next = gl.load(s_ptrs + step)
        e, o = gl.split(gl.reshape(w, (BLOCK_N, 4, 2, 2)))
        w0, w2 = gl.split(e)
        w1, w3 = gl.split(o)
        i = 4 * (s - s_lo)
        if PIPE:  # block b + 1's wgmma issued before block b's partial is read; a drain a step
            t0 = warpgroup_mma(_f8_operand(w0, a_layout), x_smem.index(i).permute((1, 0)), zero,
                               use_acc=False, is_async=True)
            t1 = warpgroup_mma(_f8_operand(w1, a_layout), x_smem.index(i + 1).permute((1, 0)),
                               zero, use_acc=False, is_async=True)
            p = warpgroup_mma_wait(1, deps=(t0,))
            acc = _scaled_add(acc, p, sc, 0, NAN_SCALES)
            t2 = warpgroup_mma(_f8_operand(w2, a_layout), x_smem.index(i + 2).permute((1, 0)),
                               zero, use_acc=False, is_async=True)
            p = warpgroup_mma_wait(1, deps=(t1,))
            acc = _scaled_add(acc, p, sc, 1, NAN_SCALES)
            t3 = warpgroup_mma(_f8_operand(w3, a_layout), x_smem.index(i + 3).permute((1, 0)),
                               zero, use_acc=False, is_async=True)
            p = warpgroup_mma_wait(1, deps=(t2,))
            acc = _scaled_add(acc, p, sc, 2, NAN_SCALES)
            p = warpgroup_mma_wait(0, deps=(t3,))
            acc = _scaled_add(acc, p, sc, 3, NAN_SCALES)
        else:  # a wait after every wgmma (what Triton does)
            for b in gl.static_range(4):
                wb = w0 if b == 0 else w1 if b == 1 else w2 if b == 2 else w3
                t = warpgroup_mma(_f8_operand(wb, a_layout), x_smem.index(i + b).permute((1, 0)),
                                  zero, use_acc=False, is_async=True)
                p = warpgroup_mma_wait(0, deps=(t,))
                acc = _scaled_add(acc, p, sc, b, NAN_SCALES)
        if DEPTH == 2:
            w = w_2
            sc = sc_2
            w_2 = w_next
            sc_2 = sc_next
        else:
            w = w_next
            sc = sc_next

    # y[m] = (hi column m + lo column MP + m) * x's row scale; a thread holds a row
    yl: gl.constexpr = gl.BlockedLayout([1, MP], [32, 1], [4, 1], [1, 0])
    acc = gl.convert_layout(acc, gl.BlockedLayout([1, NX], [32, 1], [4, 1], [1, 0]))
    hi, lo = gl.split(gl.permute(gl.reshape(acc, (BLOCK_N, 2, MP)), (0, 2, 1)))
    y = gl.convert_layout(hi + lo, yl)
    offs_m = gl.arange(0, MP, layout=gl.SliceLayout(0, yl))
    offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, yl))
    y = y * gl.load(xscale_ptr + offs_m)[None, :]
    mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
    tile_ptrs = offs_m[None, :] * N + offs_n[:, None]
    if SPLIT:
        gl.store(partial_ptr + pid_k * stride_ps + tile_ptrs, y, mask=mask)
        gl.thread_barrier()
        done = gl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if done == split_k - 1:
            y = gl.zeros((BLOCK_N, MP), gl.float32, layout=yl)
            for k in range(split_k):
                y += gl.load(partial_ptr + k * stride_ps + tile_ptrs, mask=mask, other=0.0,
                             cache_modifier=".cg")
            gl.atomic_xchg(counter_ptr + pid_n, 0)
            gl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None],
                     y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        gl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None],
                 y.to(out_ptr.dtype.element_ty), mask=mask)


def mx_linear_gluon(x: torch.Tensor, w, block_n: int = 128, programs_per_sm: int = 4,
                    max_steps: int = 16, pipe: int = 2, depth: int = 1, x_parts=None,
                    mp: int | None = None):
    """w: mx_f8_kernel.prepare_weight(q, tile=64); x_parts: prepare_x_rows(x, mp), made here
    when not given (its own launch); depth: steps of words loaded ahead."""
    n, k = w.shape
    assert w.tile == TILE and k % 128 == 0
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    mp = mp or max(4, triton.next_power_of_2(m))
    assert m <= mp <= 16
    parts, xscale = x_parts if x_parts is not None else prepare_x_rows(x2, mp)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(n, block_n)
    n_steps = k // 128
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    split_k = max(1, min(programs_per_sm * sms // tiles, n_steps), triton.cdiv(n_steps, max_steps))
    steps_per_split = triton.cdiv(n_steps, split_k)
    split_k = triton.cdiv(n_steps, steps_per_split)
    counters = w.counters if w.counters.numel() >= tiles else \
        torch.zeros(tiles, dtype=torch.int32, device=x.device)
    partial = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device) \
        if split_k > 1 else out
    _mx_linear_decode_gluon_kernel[(tiles, split_k)](
        parts, xscale, w.words, w.scales, out, partial, counters,
        m, n, k // 8, n_steps, steps_per_split, split_k, w.scales.stride(0), out.stride(0),
        partial.stride(0) if split_k > 1 else 0,
        BLOCK_N=block_n, MP=mp, MAX_STEPS=max_steps, NAN_SCALES=w.nan_scales,
        SPLIT=split_k > 1, PIPE=pipe, DEPTH=depth, num_warps=4)
    return out.view(*x.shape[:-1], n)
