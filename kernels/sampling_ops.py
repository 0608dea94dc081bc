"""Greedy sampling's argmax over the vocabulary, as two short kernels (GPU).

torch.argmax reduces a row in one thread block: a 128k-entry row took ~28 us on the H200 at
batch 1 (bench/results/engine_gpu.batch1_mx.json, eager kernel profile), 2-3% of a 1B model's
decode step. Here a row is cut into BLOCK-wide chunks, one program each (its maximum and that
maximum's first index), and then one program a row takes the first chunk holding the row's
maximum: the result is the first maximal index, as torch.argmax's. A NaN counts as +inf here
(torch.argmax returns the first NaN instead); such logits come from a broken model either way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_compat import use_triton as _use_triton

BLOCK = 2048  # vocabulary entries a stage-1 program reads (8 KB of fp32 logits)


@triton.jit
def _chunk_argmax_kernel(
    x_ptr, part_max_ptr, part_idx_ptr,  # x [R, V]; parts [R, C]
    V, stride_x, NUM_CHUNKS, BLOCK: tl.constexpr,
):
    row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + row * stride_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    v = tl.where(v != v, float("inf"), v)  # NaN as +inf
    best = tl.max(v, axis=0)
    first = tl.min(tl.where(v == best, offs, V), axis=0)  # the first index holding it
    tl.store(part_max_ptr + row * NUM_CHUNKS + chunk, best)
    tl.store(part_idx_ptr + row * NUM_CHUNKS + chunk, first)


@triton.jit
def _pick_chunk_kernel(part_max_ptr, part_idx_ptr, out_ptr, NUM_CHUNKS,
                       BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    mask = offs < NUM_CHUNKS
    best = tl.load(part_max_ptr + row * NUM_CHUNKS + offs, mask=mask, other=float("-inf"))
    top = tl.max(best, axis=0)
    chunk = tl.min(tl.where(mask & (best == top), offs, NUM_CHUNKS), axis=0)  # the first
    index = tl.load(part_idx_ptr + row * NUM_CHUNKS + chunk)
    tl.store(out_ptr + row, index.to(tl.int64))


def argmax_rows(logits: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """The first maximal index of each row of logits [R, V] (float, contiguous rows): int64
    [R] on logits' device. backend "auto": Triton on CUDA, torch.argmax on CPU."""
    if logits.dim() != 2 or not logits.is_floating_point() or logits.stride(-1) != 1:
        raise ValueError(f"argmax_rows: need a 2-D float tensor with contiguous rows, got "
                         f"{logits.dtype} {tuple(logits.shape)} strides {logits.stride()}")
    rows, vocab = logits.shape
    if vocab == 0:
        raise ValueError("argmax_rows: rows are empty")
    if not _use_triton(backend, logits):
        return logits.argmax(-1)
    out = torch.empty(rows, dtype=torch.long, device=logits.device)
    if rows == 0:
        return out
    chunks = triton.cdiv(vocab, BLOCK)
    part_max = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device)
    _chunk_argmax_kernel[(rows, chunks)](logits, part_max, part_idx, vocab, logits.stride(0),
                                         chunks, BLOCK=BLOCK)
    _pick_chunk_kernel[(rows,)](part_max, part_idx, out, chunks,
                                BLOCK_C=triton.next_power_of_2(chunks))
    return out
