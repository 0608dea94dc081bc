"""The Triton attention backend: kernels/paged_attention.py behind the AttentionBackend contract
of worker/attention.py (same step layout: decodes first, then prefill chunks).

Metadata is built once per step from host lists, so forward never syncs with the device: int32
block tables, lengths and query offsets per group, with host-side maxima for the launch grids.

Attention mass (KV eviction, AttentionBatch.mass_window), added into one fp32 buffer over the
layers: decodes take it from the scores the decode kernel stores as it attends (normalised once
its splits are merged, no second pass over K), so a captured decode graph returns it too
(static_decode_metadata's `mass`); prefill chunks from a second, small call over each chunk's
last `mass_window` queries only (their attention recomputed, the mass of those queries alone).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from mxserve.kernels.paged_attention import (
    paged_decode_attention,
    paged_prefill_attention,
    write_kv_cache,
)
from mxserve.worker.attention import AttentionBackend, AttentionBatch
from mxserve.worker.host_to_device import to_device


@dataclass(frozen=True)
class PagedGroup:
    """The step's decodes, or its prefill chunks, in the form the kernels take."""

    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32, right-padded with block 0
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32: request i's queries, within the group
    seq_lens: torch.Tensor  # [num_reqs] int32: cached tokens once this step's are written
    context_lens: torch.Tensor  # [num_reqs] int32: cached tokens before this step
    max_query_len: int  # host-side bounds: launch grids and the split choice, no device sync
    max_seq_len: int
    num_splits: int | None = 1  # prefill's context splits (None: the decode rule; verify graphs)


@dataclass(frozen=True)
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64 flat cache slot of each new token
    num_decode_tokens: int  # the first num_decode_tokens tokens are one-token decodes
    decode: PagedGroup | None  # None when the step has no decodes
    prefill: PagedGroup | None  # None when the step has no prefill chunks
    # KV eviction: mass [num_requests, longest context] fp32 summed over heads and layers, and
    # the prefill chunks' observation windows as a group of their own (None: no mass asked)
    mass: torch.Tensor | None = None
    window: PagedGroup | None = None
    window_rows: torch.Tensor | None = None  # those queries' rows among the prefill tokens


def _group(batch: AttentionBatch, lo: int, hi: int) -> PagedGroup | None:
    if lo == hi:
        return None
    query_lens, starts = batch.query_lens[lo:hi], batch.start_positions[lo:hi]
    tables = batch.block_tables[lo:hi]
    width = max(len(t) for t in tables)
    seq_lens = [s + n for s, n in zip(starts, query_lens)]

    def i32(values: list) -> torch.Tensor:
        return to_device(values, torch.int32, batch.device)

    return PagedGroup(
        block_tables=i32([t + [0] * (width - len(t)) for t in tables]),
        query_start_loc=i32([0, *accumulate(query_lens)]), seq_lens=i32(seq_lens),
        context_lens=i32(starts), max_query_len=max(query_lens), max_seq_len=max(seq_lens))


def static_decode_metadata(slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, max_seq_len: int,
                           mass: torch.Tensor | None = None) -> TritonAttentionMetadata:
    """Metadata of an all-decode step over buffers a CUDA graph reads (cuda_graphs.py): slots
    [B] int64 (-1: padding, nothing written), block tables [B, max_blocks] and seq_lens [B] int32
    (0: padding, nothing attended). max_seq_len bounds every seq_len; it fixes the launch grids.
    mass: fp32 [B, >= max_seq_len] the layers add their attention mass into (the caller zeroes
    it first), or None."""
    num = seq_lens.shape[0]
    starts = torch.arange(num + 1, dtype=torch.int32, device=seq_lens.device)  # unread by decode
    return TritonAttentionMetadata(
        slot_mapping=slot_mapping, num_decode_tokens=num, prefill=None,
        decode=PagedGroup(block_tables=block_tables, query_start_loc=starts, seq_lens=seq_lens,
                          context_lens=seq_lens, max_query_len=1, max_seq_len=max_seq_len),
        mass=mass)


def static_verify_metadata(slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                           query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                           context_lens: torch.Tensor, tokens_per_row: int,
                           max_seq_len: int) -> TritonAttentionMetadata:
    """Metadata of a step where every request computes up to tokens_per_row tokens (a verify of
    its last token and its drafts) over buffers a CUDA graph reads (cuda_graphs.VerifyGraphs):
    request i's queries are rows tokens_per_row * i onward (query_start_loc, fixed); its tokens
    past the real ones have slot -1 and attend like its last real one; a padding request has
    seq_len 0. The context is split as a decode's, chosen for max_seq_len at capture."""
    return TritonAttentionMetadata(
        slot_mapping=slot_mapping, num_decode_tokens=0, decode=None,
        prefill=PagedGroup(block_tables=block_tables, query_start_loc=query_start_loc,
                           seq_lens=seq_lens, context_lens=context_lens,
                           max_query_len=tokens_per_row, max_seq_len=max_seq_len,
                           num_splits=None))


class TritonAttention(AttentionBackend):
    """Paged Triton kernels (GPU, or the Triton interpreter on CPU): no gathered copies of K/V."""

    def build_metadata(self, batch: AttentionBatch) -> TritonAttentionMetadata:
        bs, slots = batch.block_size, []  # flat slots of each request's new positions
        for qlen, start, table in zip(batch.query_lens, batch.start_positions, batch.block_tables):
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + qlen))
        nd = batch.num_decodes
        mass, window, rows = None, None, None
        if batch.mass_window > 0:
            ends = [s + n for s, n in zip(batch.start_positions, batch.query_lens)]
            mass = torch.zeros(len(ends), max(ends), dtype=torch.float32, device=batch.device)
            qlens = batch.query_lens[nd:]
            lens = [min(n, batch.mass_window) for n in qlens]
            window = _group(AttentionBatch(
                lens, [e - n for e, n in zip(ends[nd:], lens)], batch.block_tables[nd:], 0,
                bs, batch.device), 0, len(lens))
            if window is not None:
                rows = to_device([r for end, n in zip(accumulate(qlens), lens)
                                  for r in range(end - n, end)], torch.long, batch.device)
        return TritonAttentionMetadata(
            slot_mapping=to_device(slots, torch.long, batch.device),
            num_decode_tokens=nd, decode=_group(batch, 0, nd),
            prefill=_group(batch, nd, len(batch.query_lens)), mass=mass, window=window,
            window_rows=rows)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: TritonAttentionMetadata) -> None:
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping, backend="triton")

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: TritonAttentionMetadata) -> torch.Tensor:
        # q [T, Hq, D]; caches [num_blocks, block_size, Hkv, D], this step's K/V written
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # [T, Hq, D]
        nd, dec, pre = meta.num_decode_tokens, meta.decode, meta.prefill
        if dec is not None:
            paged_decode_attention(q[:nd], k_cache, v_cache, dec.block_tables, dec.seq_lens,
                                   out=out[:nd], max_seq_len=dec.max_seq_len,
                                   return_attn_mass=meta.mass is not None,
                                   mass=None if meta.mass is None else meta.mass[:nd],
                                   backend="triton")
        if meta.window is not None:
            self._window_mass(q[nd:], k_cache, v_cache, meta)
        if pre is not None:
            paged_prefill_attention(q[nd:], k_cache, v_cache, pre.block_tables,
                                    pre.query_start_loc, pre.seq_lens, pre.context_lens,
                                    out=out[nd:], max_query_len=pre.max_query_len,
                                    max_seq_len=pre.max_seq_len, num_splits=pre.num_splits,
                                    backend="triton")
        return out.flatten(1)

    @staticmethod
    def _window_mass(q, k_cache, v_cache, meta: TritonAttentionMetadata) -> None:
        """Each prefill chunk's last queries (meta.window) attend again, for their mass."""
        win, nd = meta.window, meta.num_decode_tokens
        paged_prefill_attention(q.index_select(0, meta.window_rows), k_cache, v_cache,
                                win.block_tables, win.query_start_loc, win.seq_lens,
                                win.context_lens, return_attn_mass=True, mass=meta.mass[nd:],
                                max_query_len=win.max_query_len, max_seq_len=win.max_seq_len,
                                backend="triton")

