"""Probe (H200): a few-row linear with the step before it folded in, against cuBLAS, on the 1B
model's decode linears. The kernel lives here, not in kernels/: it lost (results below), so the
model keeps RMSNorm / SiLU-and-mul kernels + cuBLAS.

The kernel computes out = prologue(x) @ W.T for M <= 16 rows: prologue none, add + RMSNorm
(layer_ops.add_rms_norm_'s rounding) or SiLU-and-mul. A program owns BLOCK_N rows of W and walks
K in BLOCK_K steps, recomputing the prologue for its chunk of x (RMSNorm's 1/rms from a first pass
over the row), on the tensor cores with x padded to 16 rows.

Measured (bench/results/decode_gemv_probe.json, M = 1, us a call): with no prologue the best
config ties cuBLAS (q/k/v 6.52 vs 6.61, o 6.00 vs 6.34, gate/up 18.3 vs 18.7, down 14.9 vs
14.3): these shapes sit at the latency floor of a single pass. Folding the prologue in is slower
than today's separate kernel + cuBLAS (q/k/v 10.5 vs 9.7; gate/up 26.6 vs 22.4; down with
SiLU 88 vs 15: every program recomputes it for 16 padded rows).

Per shape (q/k/v 3072x2048, o 2048x2048, gate/up 16384x2048, down 2048x8192), in CUDA graphs of
16 calls cycling over 8 weight copies (more than L2 together), per call:
- cublas: F.linear alone; step: what the model runs today before it (the fused add + RMSNorm
  kernel for q/k/v and gate/up, SiLU-and-mul for down) and F.linear;
- triton configs (BLOCK_N, BLOCK_K, warps, stages) with no prologue, then the best three with
  the prologue the model would fold in, at M = 1 and 8.
Every output is checked against the torch reference.

    python bench/decode_gemv_probe.py --out DIR     (DIR/decode_gemv_probe.json)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(REPO))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from gpu_timing import graph_us, header  # noqa: E402

from mxserve.kernels import layer_ops  # noqa: E402
from mxserve.kernels.layer_ops import _round_to  # noqa: E402
from mxserve.kernels.triton_compat import _cast_out, _round_bf16, _to_f32  # noqa: E402

PROLOGUES = ("none", "rms_norm", "silu_and_mul")
MAX_M = 16
# (BLOCK_N, BLOCK_K, num_warps, num_stages): the default when none is given
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
                eps: float = 1e-6, config: tuple | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(prologue(x) @ weight.T [M, N], residual' or None); see the module docstring.

    x [M, K] (silu_and_mul: [M, 2K]) and weight [N, K] of one 16-bit dtype, M <= MAX_M;
    rms_norm takes norm_weight [K] and eps, and residual [M, K] (optional)."""
    _check(x, weight, prologue, residual, norm_weight)
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
        INTERP_BF16=False, num_warps=warps, num_stages=stages)
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
    new_res = None
    if prologue == "rms_norm":
        if residual is not None:
            new_res = residual + x
            x = new_res
        x = layer_ops.rms_norm_torch(x, norm_weight, eps)
    elif prologue == "silu_and_mul":
        x = layer_ops.silu_and_mul_torch(x)
    return torch.nn.functional.linear(x, weight), new_res


SHAPES = {"qkv": (3072, 2048, "rms_norm"), "o": (2048, 2048, "none"),
          "gate_up": (16384, 2048, "rms_norm"), "down": (2048, 8192, "silu_and_mul")}
CONFIGS = [(bn, bk, 4, st) for bn, bk, st in itertools.product((16, 32, 64), (128, 256), (2, 3, 4))]
CONFIGS += [(64, 128, 8, 3), (64, 256, 8, 3), (128, 128, 8, 3), (32, 512, 4, 2)]


def inputs(n: int, k: int, prologue: str, m: int):
    gen = torch.Generator(device="cuda").manual_seed(n + k + m)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
          for _ in range(8)]
    width = 2 * k if prologue == "silu_and_mul" else k
    x = torch.randn(m, width, device="cuda", dtype=torch.bfloat16, generator=gen)
    opts = {}
    if prologue == "rms_norm":
        opts = dict(residual=torch.randn(m, k, device="cuda", dtype=torch.bfloat16,
                                         generator=gen),
                    norm_weight=torch.ones(k, device="cuda", dtype=torch.bfloat16), eps=1e-5)
    return ws, x, opts


def today(x, w, prologue, opts):
    """The model's current path: the layer kernel, then cuBLAS."""
    if prologue == "rms_norm":
        x = layer_ops.add_rms_norm_(x, opts["residual"].clone(), opts["norm_weight"],
                                    opts["eps"])
    elif prologue == "silu_and_mul":
        x = layer_ops.silu_and_mul(x)
    return F.linear(x, w)


def check(out, ref) -> float:
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < 1e-2, err
    return err


def probe_shape(name: str, n: int, k: int, prologue: str) -> dict:
    res = {"n": n, "k": k, "prologue": prologue, "configs": []}
    ws, x1, _ = inputs(n, k, "none", 1)
    res["cublas_m1_us"] = graph_us([lambda w=w: F.linear(x1, w) for w in ws * 2])
    for cfg in CONFIGS:
        out, _ = decode_gemv(x1, ws[0], config=cfg)
        err = check(out, F.linear(x1, ws[0]))
        us = graph_us([lambda w=w, c=cfg: decode_gemv(x1, w, config=c) for w in ws * 2])
        res["configs"].append({"config": cfg, "m1_us": us, "rel_err": round(err, 5)})
    best = sorted(res["configs"], key=lambda r: r["m1_us"])[:3]
    res["fused"] = []
    for m in (1, 8):
        ws, x, opts = inputs(n, k, prologue, m)
        res[f"today_m{m}_us"] = graph_us([lambda w=w, x=x, o=opts: today(x, w, prologue, o)
                                          for w in ws * 2])
        res[f"cublas_m{m}_only_us"] = graph_us([lambda w=w, x=x: F.linear(x[:, :k], w)
                                                for w in ws * 2])
        for r in best:
            cfg = tuple(r["config"])
            out, new_res = decode_gemv(x, ws[0], prologue=prologue, config=cfg, **opts)
            ref, ref_res = decode_gemv_torch(x, ws[0], prologue=prologue, **opts)
            err = check(out, ref)
            if ref_res is not None:
                assert torch.equal(new_res, ref_res)
            us = graph_us([lambda w=w, c=cfg, x=x, o=opts: decode_gemv(
                x, w, prologue=prologue, config=c, **o) for w in ws * 2])
            res["fused"].append({"m": m, "config": cfg, "us": us, "rel_err": round(err, 5)})
    print(name, json.dumps({key: v for key, v in res.items() if key != "configs"}), flush=True)
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    args = p.parse_args()
    res = {**header("decode_gemv_probe"), "shapes": {}}
    for name, (n, k, prologue) in SHAPES.items():
        res["shapes"][name] = probe_shape(name, n, k, prologue)
        with open(os.path.join(args.out, "decode_gemv_probe.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
