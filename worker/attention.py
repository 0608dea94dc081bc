"""Attention over the paged KV cache, behind one interface with swappable backends.

Each layer's cache is two tensors `[num_blocks, block_size, num_kv_heads, head_dim]` (K and V; keys
stored after RoPE). A token at position p of a request lives in block `block_table[p // block_size]`
at offset `p % block_size`; its flat "slot" is `block_id * block_size + offset`.

A step's tokens are laid out decodes first (one query token per request), then prefill chunks
(several query tokens that attend to the cached context plus themselves, causally):

    tokens:  [d0 d1 d2 | p0 p0 p0 p0 | p1 p1]      num_decode_tokens = 3
    context: each request sees slots of positions 0 .. start + query_len - 1

Attention mass (KV eviction, worker/kv_eviction.py), when the batch asks for it
(`mass_window` > 0): each request's cached positions get the softmax probability they receive,
summed over query heads and layers, in `metadata.mass` [requests, longest context] fp32. A
decode's one query counts; a prefill chunk's last `mass_window` queries count (an observation
window, as SnapKV's: a long prompt costs no full extra pass).
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mxserve.kernels import cpu_attention


@dataclass(frozen=True)
class AttentionBatch:
    """What every backend needs to build its per-step metadata, in the step's token order."""

    query_lens: list[int]  # new tokens per request (1 for the first num_decodes requests)
    start_positions: list[int]  # tokens already in the cache per request before this step
    block_tables: list[list[int]]  # block ids per request, covering start + query_len tokens
    num_decodes: int  # the first num_decodes requests are single-token decodes
    block_size: int
    device: torch.device
    mass_window: int = 0  # > 0: accumulate attention mass, a prefill chunk's last this many
    # per request: its queries may run as decode rows (a speculative verify: CPUAttention gives
    # each its own context length in the decode kernel, the bits decode steps get); None: none
    query_rows: list[bool] | None = None
    # per request, None or per query row its context other than causal (a draft tree's rows):
    # (base, extra) = positions 0 .. base - 1, then the positions in `extra` in that order (each
    # < start + query_len: this step's or cached KV). A row's KV is still written at its own
    # position start + row. None: every request causal.
    row_contexts: list[list[tuple[int, list[int]]] | None] | None = None


class AttentionBackend(ABC):
    """Computes attention for one layer; metadata is built once per step and shared by all layers.

    The model's attention layer owns the K/V write: it puts the step's new K/V into the caches
    at `kv_slots(meta)`, either through `write_kv` or in its own projection kernel
    (kernels/gemv.py), then calls `forward`, which only reads the caches: for every new token,
    softmax(q k^T / sqrt(d)) v over its request's context (positions 0 .. its own position),
    shape [num_tokens, num_heads * head_dim] in q's dtype. GQA: query head h uses KV head
    h // (num_heads // num_kv_heads).
    """

    @abstractmethod
    def build_metadata(self, batch: AttentionBatch) -> object: ...

    def kv_slots(self, meta: object) -> torch.Tensor:
        """The new tokens' flat cache slots [T] int64 (negative: padding, not written)."""
        return meta.slot_mapping

    @abstractmethod
    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: object) -> None:
        """k, v [T, Hkv, D] into the caches at kv_slots(meta)."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: object) -> torch.Tensor: ...


@dataclass
class DecodeGroup:
    """Decodes of similar context length, padded to the longest: one gather and one SDPA."""

    rows: torch.Tensor  # [n] their indices among the step's decodes
    blocks: torch.Tensor  # [n, max_blocks] block ids of each context (padding: block 0)
    width: int  # the longest context: positions 0 .. width - 1 are gathered
    mask: torch.Tensor | None  # [n, 1, 1, width] True = attend; None: no padding
    # Copies skipped where possible: rows first..end-1 in order are slices of q and out, and
    # one request whose blocks are consecutive ids is a view of the cache (no gather).
    row_range: tuple[int, int] | None = None
    first_block: int | None = None

    def context(self, cache: torch.Tensor) -> torch.Tensor:
        """[n, width, Hkv, D] keys or values of the group from one layer's cache."""
        if self.first_block is None:
            return _gather(cache, self.blocks)[:, :self.width]
        num_blocks = self.blocks.shape[1]
        view = cache[self.first_block:self.first_block + num_blocks]
        return view.view(1, -1, *cache.shape[2:])[:, :self.width]


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot of each new token
    num_decode_tokens: int
    decode_groups: list[DecodeGroup]  # TorchAttention: SDPA per group of similar lengths
    # CPUAttention instead: int32 block tables [rows, max_blocks] and seq_lens [rows] of the
    # kernel's query rows: the decodes, then the tokens of each chunk AttentionBatch.query_rows
    # marks (at most MAX_ROWS_AS_DECODES a chunk)
    decode_index: tuple[torch.Tensor, torch.Tensor] | None
    # (first token, query_len, context blocks [ceil(end / block_size)], end, mask [query_len,
    # end] or None when the chunk starts the request: plain causal) per prefill chunk
    prefill_spans: list[tuple[int, int, torch.Tensor, int, torch.Tensor | None]]
    # Attention mass [num_requests, longest context] fp32, summed over heads and layers, when the
    # batch asked for it (AttentionBatch.mass_window); else None.
    mass: torch.Tensor | None = None
    mass_window: int = 0
    decode_mass: torch.Tensor | None = None  # CPUAttention's per-head buffer, made once a step
    # CPUAttention: the kernel rows' token indices when they are not tokens 0 .. rows - 1
    decode_rows: torch.Tensor | None = None
    # CPUAttention: (base_lens [rows] int32, extra slots [rows, E] int32) where some kernel row
    # reads a draft tree's context (AttentionBatch.row_contexts); None: all rows causal
    decode_tree: tuple[torch.Tensor, torch.Tensor] | None = None


# CPUAttention runs a chunk of at most this many queries as decode rows when asked
# (AttentionBatch.query_rows: a verify's k + 1, k <= 16, the largest num_speculative_tokens).
MAX_ROWS_AS_DECODES = 17

# Grouping decodes: padding a short context to a long one costs its padded tokens; a separate
# group costs one more gather + SDPA call, about as much as this many padded (request, token)
# pairs on the project's 2-core CPU (bench/results/engine_cpu.md).
GROUP_COST_TOKENS = 1024


def group_by_length(lengths: list[int], group_cost: int | None = None) -> list[list[int]]:
    """Indices of `lengths` split into groups of consecutive sorted lengths minimizing
    sum(group size x its longest length) + group_cost (default GROUP_COST_TOKENS) per group (an
    O(n^2) dynamic program)."""
    group_cost = GROUP_COST_TOKENS if group_cost is None else group_cost
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    n = len(order)
    best = [0.0] + [float("inf")] * n  # best[j]: cost of the j shortest in groups
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        longest = lengths[order[j - 1]]
        for i in range(j):
            cost = best[i] + (j - i) * longest + group_cost
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], n
    while j:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1]


def context_slots(block_table: list[int], num_tokens: int, block_size: int) -> list[int]:
    """Flat slots of positions 0 .. num_tokens - 1 of one request."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(num_tokens)]


def slot_table(block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """[R, max_blocks] block ids -> [R, max_blocks * block_size]: slots of positions 0, 1, ..."""
    offsets = torch.arange(block_size, device=block_tables.device)
    return (block_tables[:, :, None] * block_size + offsets).flatten(1)


def _padded(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long,
                        device=device)


class TorchAttention(AttentionBackend):
    """Plain-torch backend (CPU and tests): gathers each context's blocks, then SDPA. Decodes go
    in groups of similar length (`group_by_length`), one padded SDPA per group; each prefill
    chunk is one SDPA."""

    grouped_decodes = True  # False: CPUAttention's one kernel call over the paged cache

    def __init__(self, group_cost_tokens: int = GROUP_COST_TOKENS) -> None:
        self.group_cost_tokens = group_cost_tokens  # group_by_length's cost of one more group

    def build_metadata(self, batch: AttentionBatch) -> TorchAttentionMetadata:
        dev, nd, bs = batch.device, batch.num_decodes, batch.block_size
        tables = _padded(batch.block_tables, dev)  # [R, max_blocks]
        ends = [start + q for start, q in zip(batch.start_positions, batch.query_lens)]
        # new tokens' slots: a decode's from its table in Python (one int; hundreds of decodes
        # would be hundreds of tensor slices), a prefill chunk's as a slice of its slot row
        decode_slots = [t[(e - 1) // bs] * bs + (e - 1) % bs
                        for t, e in zip(batch.block_tables[:nd], ends[:nd])]
        new_slots = [torch.tensor(decode_slots, dtype=torch.long, device=dev)]
        if nd < len(ends):
            slots = slot_table(tables[nd:], bs)  # [R - nd, L]
            new_slots += [slots[i, start:end] for i, (start, end)
                          in enumerate(zip(batch.start_positions[nd:], ends[nd:]))]
        groups, index, rows = [], None, None
        # CPUAttention: a verify's k + 1 queries (batch.query_rows) run as decode rows of the
        # kernel, each its own context length: exactly a decode's arithmetic, and cheaper than
        # gathering the context for SDPA. Prompt chunks stay on SDPA, whose rows do not depend
        # on the chunking (a prefix hit computes the rest of a prompt as a miss would).
        contexts = batch.row_contexts or [None] * len(ends)
        as_rows = [] if self.grouped_decodes or batch.mass_window or not batch.query_rows else \
            [i for i in range(nd, len(ends))
             if batch.query_rows[i] and batch.query_lens[i] <= MAX_ROWS_AS_DECODES]
        row_spans = set(as_rows)
        tree = None
        if self.grouped_decodes:  # (decodes with a tree context: one-row chunks, below)
            plain = [i for i in range(nd) if not contexts[i]]
            groups = [self._decode_group(tables, ends, [plain[r] for r in rows], bs, dev)
                      for rows in group_by_length([ends[i] for i in plain],
                                                  self.group_cost_tokens)]
        elif as_rows or (nd and batch.row_contexts):  # the decodes, then each marked chunk's
            # tokens, its table repeated
            starts = [0] + list(itertools.accumulate(batch.query_lens))
            row_ids = list(range(nd)) + [starts[i] + j for i in as_rows
                                         for j in range(batch.query_lens[i])]
            row_of = [(i, 0) for i in range(nd)] + \
                [(i, j) for i in as_rows for j in range(batch.query_lens[i])]
            which = [i for i, _ in row_of]
            lens = [ends[i] - batch.query_lens[i] + j + 1 for i, j in row_of]
            if any(contexts[i] for i in which):
                bases, slots, lens = self._tree_rows(batch.block_tables, contexts, row_of, lens,
                                                     bs)
                tree = (bases, slots)
            index = (tables[which].to(torch.int32), torch.tensor(lens, dtype=torch.int32))
            if row_ids != list(range(len(row_ids))):
                rows = torch.tensor(row_ids, dtype=torch.long, device=dev)
        elif nd:
            index = (tables[:nd].to(torch.int32), torch.tensor(ends[:nd], dtype=torch.int32))
        spans, first = [], nd
        if self.grouped_decodes:
            for i in range(nd):
                if contexts[i]:
                    spans.append((i, 1, tables[i, :-(-ends[i] // bs)], ends[i],
                                  self._context_mask(contexts[i], 1, ends[i], dev)))
        for i in range(nd, len(ends)):
            qlen, end = batch.query_lens[i], ends[i]
            if i in row_spans:  # in the kernel's rows
                first += qlen
                continue
            mask = None
            if contexts[i]:  # a draft tree: each row its own context
                mask = self._context_mask(contexts[i], qlen, end, dev)
            elif qlen != end:  # a later chunk or a prefix hit: causal, offset by the cached part
                q_pos = torch.arange(end - qlen, end, device=dev)
                mask = torch.arange(end, device=dev)[None, :] <= q_pos[:, None]  # [qlen, end]
            spans.append((first, qlen, tables[i, :-(-end // bs)], end, mask))
            first += qlen
        mass = None
        if batch.mass_window > 0:
            mass = torch.zeros(len(ends), max(ends), dtype=torch.float32, device=dev)
        return TorchAttentionMetadata(slot_mapping=torch.cat(new_slots), num_decode_tokens=nd,
                                      decode_groups=groups, decode_index=index,
                                      prefill_spans=spans, mass=mass,
                                      mass_window=batch.mass_window, decode_rows=rows,
                                      decode_tree=tree)

    @staticmethod
    def _context_mask(context: list[tuple[int, list[int]]], qlen: int, end: int,
                      dev: torch.device) -> torch.Tensor:
        """[qlen, end] True where each row attends: positions < base, and its extras."""
        mask = torch.zeros(qlen, end, dtype=torch.bool)
        for j, (base, extra) in enumerate(context):
            mask[j, :base] = True
            mask[j, extra] = True
        return mask.to(dev)

    @staticmethod
    def _tree_rows(block_tables: list[list[int]], contexts: list, row_of: list[tuple[int, int]],
                   lens: list[int], bs: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """The kernel's (base_lens, extra slots) for rows (request, query row) and their
        seq_lens: a row with a tree context reads positions 0 .. base - 1, then its extras."""
        bases, extras, seq_lens = [], [], []
        for (i, j), n in zip(row_of, lens):
            if contexts[i] is None:
                bases.append(n)
                extras.append([])
                seq_lens.append(n)
                continue
            base, extra = contexts[i][j]
            table = block_tables[i]
            bases.append(base)
            extras.append([table[p // bs] * bs + p % bs for p in extra])
            seq_lens.append(base + len(extra))
        width = max(1, max(len(e) for e in extras))
        slots = torch.full((len(extras), width), -1, dtype=torch.int32)
        for r, e in enumerate(extras):
            if e:
                slots[r, :len(e)] = torch.tensor(e, dtype=torch.int32)
        return torch.tensor(bases, dtype=torch.int32), slots, seq_lens

    @staticmethod
    def _decode_group(tables: torch.Tensor, ends: list[int], rows: list[int], block_size: int,
                      dev: torch.device) -> DecodeGroup:
        lens = [ends[r] for r in rows]
        width = max(lens)
        index = torch.tensor(rows, device=dev)
        mask = None
        if min(lens) < width:
            lens_t = torch.tensor(lens, device=dev)
            mask = (torch.arange(width, device=dev)[None, :] < lens_t[:, None])[:, None, None]
        blocks = tables.index_select(0, index)[:, :-(-width // block_size)]
        in_order = rows == list(range(rows[0], rows[0] + len(rows)))
        first_block = None
        if len(rows) == 1:
            ids = blocks[0].tolist()
            first_block = ids[0] if ids == list(range(ids[0], ids[0] + len(ids))) else None
        return DecodeGroup(index, blocks, width, mask,
                           (rows[0], rows[0] + len(rows)) if in_order else None, first_block)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: TorchAttentionMetadata) -> None:
        # caches [num_blocks, block_size, Hkv, D] seen as [num_slots, Hkv, D]; index_copy_ is
        # much faster than [] indexing on CPU
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)

    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: TorchAttentionMetadata) -> torch.Tensor:
        # q [T, Hq, D]; caches [num_blocks, block_size, Hkv, D], this step's K/V written
        out = torch.empty_like(q)
        self._decodes(q, k_cache, v_cache, meta, out)
        nd = meta.num_decode_tokens
        for i, (first, qlen, blocks, end, mask) in enumerate(meta.prefill_spans):
            keys, values = _gather(k_cache, blocks)[:end], _gather(v_cache, blocks)[:end]
            out[first:first + qlen] = _prefill(q[first:first + qlen], keys, values, mask)
            if meta.mass is not None:  # the chunk's last mass_window queries, as the reference
                from mxserve.kernels.paged_attention import paged_prefill_attention_torch

                n = min(qlen, meta.mass_window)
                meta.mass[nd + i, :end] += paged_prefill_attention_torch(
                    q[first + qlen - n:first + qlen], k_cache, v_cache, blocks[None],
                    torch.tensor([0, n]), torch.tensor([end]), torch.tensor([end - n]),
                    return_attn_mass=True, max_seq_len=end)[1][0]
        return out.flatten(1)

    def _decodes(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: TorchAttentionMetadata, out: torch.Tensor) -> None:
        """out[:num_decode_tokens] = the decodes' attention, group by group."""
        for g in meta.decode_groups:
            keys, values = g.context(k_cache), g.context(v_cache)  # [n, width, Hkv, D]
            if meta.mass is not None:
                o, p = _decode_with_mass(q.index_select(0, g.rows), keys, values, g.mask)
                out.index_copy_(0, g.rows, o)
                meta.mass[g.rows, :g.width] += p
            elif g.row_range:
                first, end = g.row_range
                out[first:end] = _decode(q[first:end], keys, values, g.mask)
            else:
                out.index_copy_(0, g.rows, _decode(q.index_select(0, g.rows), keys, values,
                                                   g.mask))


class CPUAttention(TorchAttention):
    """TorchAttention with the decodes in one call of the C kernel of kernels/cpu_attention.py,
    which reads the paged cache in place (no gathered copies, no per-group SDPA). Prefill chunks
    as TorchAttention. Serves float32/bfloat16 caches; `cpu_attention.available` says whether
    this machine can build the kernel for a model's shape (the runner checks before choosing it).
    """

    grouped_decodes = False

    def _decodes(self, q, k_cache, v_cache, meta, out) -> None:
        if meta.decode_index is None:
            return
        # shapes and dtypes were checked when the runner chose us
        n = meta.decode_index[1].shape[0]
        if meta.mass is not None and meta.decode_mass is None:
            # one buffer for every layer: each overwrites positions < seq_len, the rest stay 0
            # (no short chunks as rows under mass: rows are the decodes)
            meta.decode_mass = torch.zeros(n, q.shape[1], meta.mass.shape[1])
        if meta.decode_rows is None:
            cpu_attention.paged_decode_attention_cpu_unchecked(
                q[:n], k_cache, v_cache, *meta.decode_index, out[:n], q.shape[-1] ** -0.5,
                meta.decode_mass, meta.decode_tree)
        else:
            rows_out = torch.empty(n, *q.shape[1:], dtype=q.dtype)
            cpu_attention.paged_decode_attention_cpu_unchecked(
                q.index_select(0, meta.decode_rows), k_cache, v_cache, *meta.decode_index,
                rows_out, q.shape[-1] ** -0.5, None, meta.decode_tree)
            out.index_copy_(0, meta.decode_rows, rows_out)
        if meta.decode_mass is not None:
            meta.mass[:n] += meta.decode_mass.sum(1)


def _decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
            mask: torch.Tensor | None) -> torch.Tensor:
    # q [B, Hq, D] -> [B, Hkv, G, D]: the G query heads sharing a KV head attend together;
    # keys/values [B, L, Hkv, D]; mask [B, 1, 1, L]
    num_reqs, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[2]
    qg = q.view(num_reqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(qg, keys.transpose(1, 2), values.transpose(1, 2),
                                         attn_mask=mask)  # [B, Hkv, G, D]
    return out.reshape(num_reqs, num_heads, head_dim)


def _decode_with_mass(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """_decode's output and the softmax probabilities summed over query heads [B, L] fp32, from
    one explicit softmax (SDPA does not return its weights)."""
    num_reqs, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[2]
    qg = q.view(num_reqs, num_kv_heads, num_heads // num_kv_heads, head_dim).float()
    s = qg @ keys.transpose(1, 2).float().transpose(-1, -2) * head_dim ** -0.5  # [B, Hkv, G, L]
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1)
    out = (p @ values.transpose(1, 2).float()).to(q.dtype)  # [B, Hkv, G, D]
    return out.reshape(num_reqs, num_heads, head_dim), p.sum((1, 2))


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, block_size, Hkv, D] at block ids [...] -> [..., n * block_size, Hkv,
    D]: whole blocks are copied (index_select of 16-token rows, far fewer and longer than
    token rows), so each context comes out in position order."""
    *lead, n = blocks.shape
    out = cache.index_select(0, blocks.flatten())  # [prod(lead) * n, block_size, Hkv, D]
    return out.view(*lead, n * cache.shape[1], *cache.shape[2:])


def _prefill(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
             mask: torch.Tensor | None) -> torch.Tensor:
    # q [n, Hq, D]; keys/values [L, Hkv, D]; mask [n, L] (causal, offset by the cached prefix),
    # None when n == L (plain causal)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0), attn_mask=mask, is_causal=mask is None,
        enable_gqa=True)  # [1, Hq, n, D]
    return out[0].transpose(0, 1)
