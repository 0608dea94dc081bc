"""WSUM64: a KV transfer chunk's checksum computed where its bytes already are, on the GPU for a
GPU pool (worker/kv_transfer.py; XXH3-64 stays the host's, where it is faster).

Definition, on the payload's bytes (an even number) read as little-endian uint16 halves
u_0 .. u_{n-1}, in segments of SEGMENT halves:
    S_s = sum over j of u_{s * SEGMENT + j} * (2j + 1)      (exact in int64: < 2^57)
    digest = fold of h -> (h * MULTIPLIER + S_s) mod (2^61 - 1) over s, from h = n
A change of one half changes S_s by a nonzero multiple of an odd weight (never 0), a change of
length changes h's start, and halves swapped within a segment move their weights. It detects
corruption and truncation, not tampering (the transfer's secret and TLS guard against that).
The sums are integers, so every backend and every summation order gives the same bits:
_wsum_kernel (Triton, one program a BLOCK of halves, its partial sum stored) and `wsum64_torch`
(any device, the reference) agree exactly.
"""

from __future__ import annotations

import torch

from .triton_compat import tl, triton, use_triton

SEGMENT = 1 << 20  # halves a segment (2 MiB): weights < 2^21, so S_s < 2^16 * 2^21 * 2^20
MODULUS = (1 << 61) - 1
MULTIPLIER = 0x5BD1E995
BLOCK = 4096  # halves a program; divides SEGMENT


@triton.jit
def _wsum_kernel(x_ptr, partial_ptr, n, SEGMENT: tl.constexpr, BLOCK: tl.constexpr):
    # x: int16 [n] (the payload's halves); partial: int64 [cdiv(n, BLOCK)]
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    u = tl.load(x_ptr + offs, mask=offs < n, other=0).to(tl.int64) & 0xFFFF
    weight = 2 * (offs % SEGMENT) + 1
    tl.store(partial_ptr + pid, tl.sum(u * weight, axis=0))


def _halves(payload: torch.Tensor) -> torch.Tensor:
    """The payload (any dtype, contiguous) as a flat int16 view; ValueError on an odd length."""
    if not payload.is_contiguous():
        raise ValueError("wsum64: the payload must be contiguous")
    flat = payload.reshape(-1).view(torch.uint8)
    if flat.numel() % 2:
        raise ValueError(f"wsum64: the payload must have an even number of bytes, got "
                         f"{flat.numel()}")
    return flat.view(torch.int16)


def _fold(segment_sums: list[int], n: int) -> int:
    h = n % MODULUS
    for s in segment_sums:
        h = (h * MULTIPLIER + s) % MODULUS
    return h


def wsum64(payload: torch.Tensor, backend: str = "auto") -> int:
    """The payload's WSUM64 (see the module docstring); Triton on CUDA ("auto"), the torch
    reference on CPU. One read-back of a few int64 sums."""
    x = _halves(payload)
    n = x.numel()
    if not use_triton(backend, x):
        return wsum64_torch(payload)
    partial = torch.empty(triton.cdiv(n, BLOCK), dtype=torch.int64, device=x.device)
    if n:
        _wsum_kernel[(partial.numel(),)](x, partial, n, SEGMENT=SEGMENT, BLOCK=BLOCK)
    segments = triton.cdiv(n, SEGMENT)
    per = SEGMENT // BLOCK
    sums = torch.zeros(segments * per, dtype=torch.int64, device=x.device)
    sums[:partial.numel()] = partial
    return _fold(sums.view(segments, per).sum(1).tolist(), n)


def wsum64_torch(payload: torch.Tensor) -> int:
    """The reference, on the payload's device (int64 temporaries, a segment at a time)."""
    x = _halves(payload)
    n = x.numel()
    sums = []
    for lo in range(0, n, SEGMENT):
        u = x[lo:lo + SEGMENT].to(torch.int64) & 0xFFFF
        weight = torch.arange(u.numel(), dtype=torch.int64, device=x.device) * 2 + 1
        sums.append(int((u * weight).sum()))
    return _fold(sums, n)
