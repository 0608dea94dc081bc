"""Pure-decode steps as CUDA graph replays (GPU, Triton attention).

Launching a decode step's kernels one by one from Python costs more than their GPU work at small
batches; a CUDA graph replays them all with one launch. Once the weights are loaded, `capture()`
records, for each size in `capture_sizes(max_num_seqs)`, one graph of the whole step (embedding ->
layers -> norm -> LM head) over static input buffers of that many rows, largest first, all in one
memory pool. A step whose every request computes one token copies its inputs into the buffers and
replays the graph of the smallest captured size >= its batch:

    rows:      [r0 r1 r2 | pad pad pad]      batch 3 replayed in the size-6 graph
    slot:       s0 s1 s2    -1  -1  -1       padding writes no KV ...
    seq_len:    n0 n1 n2     0   0   0       ... attends to nothing; its logits are dropped

Speculative verify steps, where each request computes its last token and up to k drafts, replay
graphs of their own (VerifyGraphs, below). Steps with prefill chunks run eagerly (runner.py).
Inputs go through two pinned host buffers used in turn, so a copy never waits for the device and
a buffer is refilled only once its last copy ran (async scheduling queues step N + 1 while step
N runs). A token the previous step sampled and the host has not seen yet is copied on the device
from that step's samples.

A graph fixes every launch grid, so the decode attention's context split is chosen for
`max_model_len` rather than for the step's longest context; the kernel's last split takes
whatever remains, so any length is computed exactly.

KV eviction: a token's RoPE position is its slot's position plus the request's
`position_offset` (tokens evicted before it). With H2O the graphs also return attention mass:
each replay zeroes a static buffer [size, max_model_len] and every layer's decode attention adds
into it (`mass`). A step's KV moves run eagerly before its replay (runner.py).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

import numpy as np
import torch

from mxserve.worker.attention_triton import static_decode_metadata, static_verify_metadata
from mxserve.worker.draft_spans import ChainEnd, Span
from mxserve.worker.host_to_device import fill_inflight_tokens, index_on, to_device
from mxserve.worker.scheduler import StepPlan


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, then 1.5x and 2x steps (24, 32, 48, 64, ...) below max_num_seqs, and
    max_num_seqs itself: padding wastes at most a third of a step's rows past 16."""
    sizes, p = [1, 2, 4, 8, 16], 16
    while p < max_num_seqs:
        sizes += [p * 3 // 2, p * 2]
        p *= 2
    return sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs})


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [size, vocab] float32, written by each replay
    hidden: torch.Tensor  # [size, hidden]
    mass: torch.Tensor | None = None  # [size, max_model_len] fp32 attention mass (H2O)


@dataclass
class _DraftGraph:
    graph: torch.cuda.CUDAGraph
    drafts: torch.Tensor  # [size, k] int64 target ids, written by each replay
    confidence: torch.Tensor  # [size, k] float32: the head's probability of each
    features: torch.Tensor  # [size, k, hidden]: the head's output that predicted each


class DecodeGraphs:
    """The captured decode graphs of one ModelRunner and the static buffers they read."""

    def __init__(self, runner, max_model_len: int, tokens_per_row: int = 1,
                 max_rows: int | None = None, with_mass: bool = False) -> None:
        self.runner = runner
        self.q = tokens_per_row  # tokens a request computes (VerifyGraphs: k + 1)
        self.block_size = runner.config.block_size
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_rows or runner.config.max_num_seqs)
        n, q, dev = self.sizes[-1], tokens_per_row, runner.device
        self.max_blocks = -(-max_model_len // self.block_size)
        # ids, positions and slots of a graph of `size` rows: tokens(size), [3, size * q] at
        # the front of one buffer, so a step's token inputs are one copy
        self._tokens = torch.zeros(3 * n * q, dtype=torch.long, device=dev)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=dev)
        self.graphs: dict[int, _Graph] = {}
        # KV eviction (H2O): the attention mass every replay returns, summed over layers
        self.mass = torch.zeros(n, max_model_len, dtype=torch.float32, device=dev) \
            if with_mass else None  # [n, max_model_len]
        # Pinned staging of the inputs, two sets used in turn: (tokens [3 * n * q] int64,
        # lengths [2 * n] int32 (seq_lens, then VerifyGraphs' context_lens), block tables
        # [n * max_blocks] int32), and an event after each set's copies.
        # A step fills the front of each, contiguously: a strided pinned source would be
        # staged through pageable memory, and that copy waits for the device, losing the
        # overlap (bench/results/host_step_probe.json).
        pin = dev.type == "cuda"  # (bench/host_overhead.py runs these on CPU tensors)
        self._staging = [(torch.zeros(3 * n * q, dtype=torch.long, pin_memory=pin),
                          torch.zeros(2 * n, dtype=torch.int32, pin_memory=pin),
                          torch.zeros(n * self.max_blocks, dtype=torch.int32, pin_memory=pin))
                         for _ in range(2)]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        # The rows' block tables, kept from step to step: row i holds the first _row_blocks[i]
        # blocks of the table whose version (KVCacheManager.table_version) is _row_version[i].
        # A step writes only the blocks a row's table gained, or the whole row when the version
        # differs (another request, or its table made anew or trimmed): rebuilding every row
        # each step took most of this method at 512 rows.
        self._tables = np.zeros((n, self.max_blocks), dtype=np.int32)
        self._row_version = [0] * n
        self._row_blocks = [0] * n
        self.num_replays = 0  # steps served by a replay (tests, stats)
        # The size whose graph the latest step replayed (None: that step ran eagerly). Graphs of
        # different sizes lay out the shared token buffer differently (tokens(size)), so only
        # this graph may be replayed again as it is, with that step's inputs (bench/).
        self.last_size: int | None = None
        self.capture_seconds = 0.0

    def tokens(self, size: int) -> torch.Tensor:
        """[3, size * q]: the ids, positions and slots the graph of `size` requests reads."""
        return self._tokens[:3 * size * self.q].view(3, size * self.q)

    def can_run(self, plan: StepPlan) -> bool:
        """Every scheduled request decodes one token, the batch fits the captured sizes, and the
        plan asks for attention mass exactly when the graphs compute it."""
        return (bool(self.graphs) and plan.num_decodes == len(plan.scheduled) <= self.sizes[-1]
                and (plan.mass_window > 0) == (self.mass is not None)
                and max(len(s.block_table) for s in plan.scheduled) <= self.max_blocks)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size. The garbage collector is off meanwhile: a dead cycle holding an
        older engine's graphs, collected mid-capture, would reset a graph during the capture,
        which invalidates it (seen on the H200: tests building engines one after another)."""
        t0 = time.perf_counter()
        gc.collect()
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            self._capture_all()
        finally:
            if was_enabled:
                gc.enable()
        self.capture_seconds = time.perf_counter() - t0

    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self.tokens(size)[2].fill_(-1)  # capture runs the step once: padding rows only
            side = torch.cuda.Stream()  # warm up off the capture stream: compiles, workspaces
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._forward(size)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                outputs = self._forward(size)
            self.graphs[size] = self._keep(graph, outputs, size)
        torch.cuda.synchronize()

    def _keep(self, graph: torch.cuda.CUDAGraph, outputs: tuple, size: int) -> _Graph:
        hidden, logits = outputs
        return _Graph(graph, logits, hidden, None if self.mass is None else self.mass[:size])

    def _forward(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        model = self.runner.model
        tokens = self.tokens(size)
        mass = None if self.mass is None else self.mass[:size].zero_()
        meta = static_decode_metadata(tokens[2], self.block_tables[:size], self.seq_lens[:size],
                                      self.max_model_len, mass)
        hidden = model(tokens[0], tokens[1], self.runner.kv_caches,
                       self.runner.attn, meta)  # [size, hidden]
        return hidden, model.compute_logits(hidden)

    def run(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits of the plan's rows that sample, hidden states of all its rows), as the eager
        path returns them; views of the graph's outputs, valid until the next replay (as is
        the attention mass, `last_mass`)."""
        batch = len(plan.scheduled)
        size = next(s for s in self.sizes if s >= batch)
        self._copy_inputs(plan, size)
        graph = self.graphs[size]
        graph.graph.replay()
        self.num_replays += 1
        self.last_size = size
        logits, hidden = graph.logits[:batch], graph.hidden[:batch]
        rows = [i for i, s in enumerate(plan.scheduled) if s.samples]
        if len(rows) == batch:
            return logits, hidden
        return logits.index_select(0, index_on(rows, logits)), hidden  # a 1-token chunk

    def last_mass(self, batch: int) -> torch.Tensor | None:
        """The latest replay's attention mass of its first `batch` rows [batch, max_model_len],
        a view valid until the next replay; None without H2O."""
        return None if self.mass is None else self.mass[:batch]

    def _update_tables(self, sched) -> int:
        """Bring rows 0..len(sched)-1 of the kept block tables up to the plan's; returns the
        longest table's length (blocks)."""
        return self._update_rows([s.block_table for s in sched], [s.table_version for s in sched])

    def _update_rows(self, block_tables: list[list[int]], table_versions: list[int]) -> int:
        versions, written, tables = self._row_version, self._row_blocks, self._tables
        for i, (table, version) in enumerate(zip(block_tables, table_versions)):
            if versions[i] != version:
                versions[i], written[i] = version, 0
            if written[i] != len(table):  # the blocks it gained
                tables[i, written[i]:len(table)] = table[written[i]:]
                written[i] = len(table)
        return max(written[:len(block_tables)])

    def _copy_inputs(self, plan: StepPlan, size: int) -> None:
        sched, bs = plan.scheduled, self.block_size
        batch = len(sched)
        turn, self._turn = self._turn, 1 - self._turn
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()  # this set's previous copies have run
        tokens_h, seq_lens_h, tables_h = self._staging[turn]
        tokens = tokens_h[:3 * size].view(3, size).numpy()  # padding: id 0, position 0, slot -1
        width = self._update_tables(sched)
        positions = np.fromiter((s.start_position for s in sched), np.int64, batch)  # slots
        tokens[0, :batch] = [s.token_ids[0] if s.token_ids else 0 for s in sched]
        tokens[0, batch:] = 0
        tokens[1, :batch] = positions + np.fromiter((s.position_offset for s in sched), np.int64,
                                                    batch)  # RoPE: evicted tokens counted
        tokens[1, batch:] = 0
        tokens[2, :batch] = self._tables[np.arange(batch), positions // bs] * bs + positions % bs
        tokens[2, batch:] = -1
        seq_lens = seq_lens_h.numpy()[:size]
        seq_lens[:batch] = positions + 1
        seq_lens[batch:] = 0
        tables = tables_h[:batch * width].view(batch, width)  # beyond a request's length: unread
        tables.numpy()[:] = self._tables[:batch, :width]
        self._tokens[:3 * size].copy_(tokens_h[:3 * size], non_blocking=True)  # contiguous both
        self.seq_lens[:size].copy_(seq_lens_h[:size], non_blocking=True)
        self.block_tables[:batch, :width].copy_(tables, non_blocking=True)
        if self._tokens.is_cuda:
            self._copied[turn] = torch.cuda.Event()
            self._copied[turn].record()
        inflight = [(i, s.inflight_row) for i, s in enumerate(sched) if s.inflight_row >= 0]
        if inflight:
            fill_inflight_tokens(self.tokens(size)[0], inflight, plan.inflight_tokens)


def _cut(ids: list[list[int]], sure: list[list[bool]], num_drafts: list[int]) -> list[list[int]]:
    """Row i's drafts: its first num_drafts[i] ids, up to the first it is not sure of."""
    out = []
    for row, ok, n in zip(ids, sure, num_drafts):
        m = 0
        while m < n and ok[m]:
            m += 1
        out.append(row[:m])
    return out


# Verify graphs are captured for batches of at most this many tokens (rows x (k + 1)): their
# logits buffers grow with it, and past it a step's device work dwarfs its launches.
VERIFY_MAX_TOKENS = 256


class VerifyGraphs(DecodeGraphs):
    """Graphs of speculative verify steps: every request computes its last token and its drafts,
    at most `tokens_per_row` (k + 1) tokens, laid out k + 1 rows a request:

    tokens:    [t0 d d d | t1 d - - | pad pad pad pad]    request 1 verifies one draft
    slot:       s  s s s   s  s -1 -1  -1  -1  -1  -1     rows past its tokens write no KV ...
    seq_len:      c0 + 4      c1 + 2        0             ... and attend as its last one does

    The attention is the prefill kernel over fixed query runs (static_verify_metadata). The
    runner takes a verify graph when no request is prefilling, one at least has drafts, and
    none has a token in flight (speculation runs without async scheduling). Logits and hidden
    states come back for every real token, in plan order."""

    def __init__(self, runner, max_model_len: int, tokens_per_row: int) -> None:
        super().__init__(runner, max_model_len, tokens_per_row,
                         max(1, min(runner.config.max_num_seqs,
                                    VERIFY_MAX_TOKENS // tokens_per_row)))
        n, dev = self.sizes[-1], runner.device
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev) * self.q

    def can_run(self, plan: StepPlan) -> bool:
        return bool(self.graphs) and self.fits(plan)

    def fits(self, plan: StepPlan) -> bool:
        """A verify of at most q tokens a request, no prefill, no token in flight, within the
        captured sizes."""
        sched = plan.scheduled
        return (0 < len(sched) <= self.sizes[-1]
                and any(s.num_draft_tokens for s in sched)
                and all(s.samples and s.inflight_row < 0
                        and s.num_new_tokens == 1 + s.num_draft_tokens <= self.q
                        for s in sched)
                and max(len(s.block_table) for s in sched) <= self.max_blocks)

    def _forward(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        model, tokens = self.runner.model, self.tokens(size)
        meta = static_verify_metadata(tokens[2], self.block_tables[:size],
                                      self.query_start_loc[:size + 1], self.seq_lens[:size],
                                      self.context_lens[:size], self.q, self.max_model_len)
        hidden = model(tokens[0], tokens[1], self.runner.kv_caches, self.runner.attn, meta)
        return hidden, model.compute_logits(hidden)  # [size * q, hidden], [size * q, vocab]

    def run(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, hidden states) of every token of the plan (each samples), in plan order."""
        size = next(s for s in self.sizes if s >= len(plan.scheduled))
        self._copy_inputs(plan, size)
        graph = self.graphs[size]
        graph.graph.replay()
        self.num_replays += 1
        self.last_size = size
        return self.real_rows(plan, graph.logits, graph.hidden)

    def real_rows(self, plan: StepPlan, logits: torch.Tensor, hidden: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of a graph's outputs [size * q, ...] that hold the plan's tokens: views
        when every request fills its q rows, else copies."""
        sched, q = plan.scheduled, self.q
        if all(s.num_new_tokens == q for s in sched):
            return logits[:len(sched) * q], hidden[:len(sched) * q]
        rows = index_on([i * q + j for i, s in enumerate(sched) for j in range(s.num_new_tokens)],
                        logits)
        return logits.index_select(0, rows), hidden.index_select(0, rows)

    def _copy_inputs(self, plan: StepPlan, size: int) -> None:
        sched = plan.scheduled
        self._fill(size, [s.start_position for s in sched],
                   np.fromiter((s.num_new_tokens for s in sched), np.int64, len(sched)),
                   [s.block_table for s in sched], [s.table_version for s in sched],
                   [s.token_ids for s in sched], np.zeros(len(sched), np.int64))

    def _fill(self, size: int, starts: list[int], counts: np.ndarray,
              block_tables: list[list[int]], table_versions: list[int], ids: list[list[int]],
              rope_offsets: np.ndarray) -> None:
        """Stage and copy the inputs of q rows a request: request i computes counts[i] tokens
        ids[i] from position starts[i] on (slots in block_tables[i], whose version the kept
        rows compare), their RoPE positions offset by rope_offsets[i]."""
        bs, q = self.block_size, self.q
        batch = len(starts)
        turn, self._turn = self._turn, 1 - self._turn
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()
        tokens_h, lens_h, tables_h = self._staging[turn]
        width = self._update_rows(block_tables, table_versions)
        starts = np.asarray(starts, np.int64)
        offsets = np.arange(q)
        real = offsets[None, :] < counts[:, None]  # [batch, q]
        positions = starts[:, None] + offsets[None, :]
        blocks = np.minimum(positions // bs, self.max_blocks - 1)
        slots = self._tables[np.arange(batch)[:, None], blocks] * bs + positions % bs
        rows = np.zeros((batch, q), np.int64)
        for i, t in enumerate(ids):
            rows[i, :len(t)] = t
        tokens = tokens_h[:3 * size * q].view(3, size * q).numpy()
        tokens[:, batch * q:] = np.array([0, 0, -1])[:, None]  # padding requests
        tokens[0, :batch * q] = rows.ravel()
        tokens[1, :batch * q] = np.where(real, positions + rope_offsets[:, None], 0).ravel()
        tokens[2, :batch * q] = np.where(real, slots, -1).ravel()
        lens = lens_h.numpy()
        lens[:batch], lens[batch:size] = starts + counts, 0  # seq_lens
        lens[size:size + batch], lens[size + batch:2 * size] = starts, 0  # context_lens
        tables = tables_h[:batch * width].view(batch, width)
        tables.numpy()[:] = self._tables[:batch, :width]
        self._tokens[:3 * size * q].copy_(tokens_h[:3 * size * q], non_blocking=True)
        self.seq_lens[:size].copy_(lens_h[:size], non_blocking=True)
        self.context_lens[:size].copy_(lens_h[size:2 * size], non_blocking=True)
        self.block_tables[:batch, :width].copy_(tables, non_blocking=True)
        if self._tokens.is_cuda:
            self._copied[turn] = torch.cuda.Event()
            self._copied[turn].record()


class EagleGraphs(VerifyGraphs):
    """An EAGLE head's drafting round (eagle.draft_round: the catch-up pass, then its chain) as
    one CUDA graph replay a batch size. Eagerly the round is k passes of one decoder layer, each
    launched kernel by kernel from Python with a sync between passes to read the drafts; on a
    GPU that costs several times a decode step of the target.

    The catch-up is laid out as a verify (k + 1 rows a request, VerifyGraphs' inputs): request i
    kept counts[i] <= k + 1 positions, the head reads the next token of each and the target's
    hidden state there (copied on the device into `features` from the step's hidden states).
    Each request's last kept row's output drafts token 1; the chain then runs k - 1 single
    positions, every request for every step, their slots, lengths and RoPE positions computed on
    the device from the request's first chain position. A request asking fewer drafts, or whose
    chain ends at a draft the head is unsure of, is cut on the host after the one sync: the
    extra positions write head KV only into the request's own blocks past its computed tokens
    (the next catch-up rewrites them before anything reads them), and none past its block table
    (slot -1, nothing attended)."""

    def __init__(self, head, kv_cache: tuple[torch.Tensor, torch.Tensor], runner,
                 max_model_len: int, num_speculative_tokens: int,
                 rows: int | None = None) -> None:
        """k = num_speculative_tokens drafts a round; rows: positions a request catches up on
        at most (default k + 1; run-ahead's graphs: 1, and k + 1 outputs, see `ahead`)."""
        super().__init__(runner, max_model_len, rows or num_speculative_tokens + 1)
        self.k = num_speculative_tokens
        self.head, self.kv_cache = head, kv_cache
        n, dev = self.sizes[-1], runner.device
        self.features = torch.zeros(n * self.q, head.config.hidden_size, dtype=runner.dtype,
                                    device=dev)
        # [4, size] at the front: each request's last kept row (in the q-row layout), its first
        # chain position (held: slots and lengths), that position's RoPE position, and its
        # block table's capacity in tokens
        self.chain = torch.zeros(4 * n, dtype=torch.long, device=dev)
        self._fresh = 0

    def fits_spans(self, spans: list[Span]) -> bool:
        """Spans (eagle.Span: the positions to catch up on) the graphs can draft from: at most
        k + 1 positions each, within the captured sizes."""
        return (bool(self.graphs) and 0 < len(spans) <= self.sizes[-1]
                and all(sp.length <= self.q for sp in spans)
                and max(len(sp.block_table) for sp in spans) <= self.max_blocks)

    def draft(self, spans: list[Span], tokens: list[int], features: torch.Tensor,
              first_rows: list[int], num_drafts: list[int], min_confidence: float,
              table_versions: list[int] | None = None, ends: bool = False
              ) -> tuple[list[list[int]], list[ChainEnd | None] | None]:
        """eagle.draft_round by one replay: its drafts for the spans (`tokens` flat in span
        order; span i's features are rows first_rows[i] onward of `features`), up to
        num_drafts[i] each, cut before the first below min_confidence; and, with `ends`, where
        each chain ended (draft_round's ChainEnd, features copied out of the graph).
        table_versions: KVCacheManager.table_version of each span's table (None: unknown, every
        table is written)."""
        graph = self.replay(spans, tokens, features, first_rows, table_versions)
        n = len(spans)
        ids, sure = graph.drafts[:n].tolist(), (graph.confidence[:n] >= min_confidence).tolist()
        drafts = _cut(ids, sure, num_drafts)
        if not ends:
            return drafts, None
        return drafts, self.chain_ends(spans, drafts, num_drafts, ids, graph.features[:n].clone())

    def replay(self, spans: list[Span], tokens: list[int], features: torch.Tensor,
               first_rows: list[int], table_versions: list[int] | None = None) -> _DraftGraph:
        """Copy the spans' inputs and replay the graph of their batch size (its outputs: views
        valid until the next replay)."""
        size = next(s for s in self.sizes if s >= len(spans))
        self.copy_spans(spans, tokens, features, first_rows, size, table_versions)
        graph = self.graphs[size]
        graph.graph.replay()
        self.num_replays += 1
        self.last_size = size
        return graph

    def ahead(self, ends: list[ChainEnd], num_drafts: int, min_confidence: float
              ) -> tuple[list[int], list[list[int]], list[ChainEnd]]:
        """eagle.draft_ahead by one replay of graphs built with rows=1 and k + 1 outputs: each
        chain end is a one-position catch-up on its token and feature. An end on a last draft
        gives its guess at the target's next token first (output 0), then the next round's
        drafts; an end on a guess gives the drafts at once (its last output unused)."""
        spans = [Span(e.position, 1, e.block_table, e.offset) for e in ends]
        graph = self.replay(spans, [e.token for e in ends],
                            torch.stack([e.feature for e in ends]), list(range(len(ends))))
        n = len(ends)
        ids, sure = graph.drafts[:n].tolist(), (graph.confidence[:n] >= min_confidence).tolist()
        features = graph.features[:n].clone()
        skips = [0 if e.guess else 1 for e in ends]  # output 0 of an end on a draft: its guess
        guesses = [e.token if e.guess else row[0] for e, row in zip(ends, ids)]
        ids = [row[k:] for row, k in zip(ids, skips)]
        asked = [num_drafts] * n
        drafts = _cut(ids, [ok[k:] for ok, k in zip(sure, skips)], asked)
        # the drafts' chains, as if run from the position after each guess
        after = [Span(e.position + k, 1, e.block_table, e.offset) for e, k in zip(ends, skips)]
        return guesses, drafts, self.chain_ends(after, drafts, asked, ids,
                                                [features[i, k:] for i, k in enumerate(skips)])

    @staticmethod
    def cut(drafts: torch.Tensor, confidence: torch.Tensor, num_drafts: list[int],
            min_confidence: float) -> list[list[int]]:
        """Each row's drafts [R, k] up to num_drafts[i], cut before the first whose confidence is
        below min_confidence."""
        return _cut(drafts.tolist(), (confidence >= min_confidence).tolist(), num_drafts)

    @staticmethod
    def chain_ends(spans: list[Span], drafts: list[list[int]], num_drafts: list[int],
                   ids: list[list[int]], features) -> list[ChainEnd | None]:
        """draft_round's chain ends from the graph's outputs: a chain cut at draft m ends on
        that token as a guess, a full one on its last draft (features[i][m] [hidden]: the
        output that predicted row i's draft m)."""
        out: list[ChainEnd | None] = []
        for i, (sp, d, n) in enumerate(zip(spans, drafts, num_drafts)):
            if n == 0:
                out.append(None)
                continue
            m = len(d) if len(d) < n else n - 1
            out.append(ChainEnd(sp.start + sp.length + m, ids[i][m], features[i][m],
                                len(d) < n, sp.block_table, sp.offset))
        return out

    def copy_spans(self, spans: list[Span], tokens: list[int], features: torch.Tensor,
                   first_rows: list[int], size: int,
                   table_versions: list[int] | None = None) -> None:
        counts = np.fromiter((sp.length for sp in spans), np.int64, len(spans))
        rope = np.fromiter((sp.offset for sp in spans), np.int64, len(spans))
        if table_versions is None:
            self._fresh -= 1  # versions below any KVCacheManager's: every row rewritten
            table_versions = [self._fresh] * len(spans)
        cuts = np.cumsum(counts)[:-1].tolist()
        flat = np.asarray(tokens, np.int64)
        self._fill(size, [sp.start for sp in spans], counts,
                   [sp.block_table for sp in spans], table_versions, np.split(flat, cuts), rope)
        q, bs = self.q, self.block_size
        at = np.arange(len(spans)) * q
        src = np.concatenate([np.arange(o, o + c) for o, c in zip(first_rows, counts.tolist())])
        dst = np.concatenate([np.arange(a, a + c) for a, c in zip(at.tolist(),
                                                                   counts.tolist())])
        rows = index_on(np.stack([src, dst]), features)
        self.features.index_copy_(0, rows[1], features.index_select(0, rows[0]).to(
            self.features.dtype))
        first = np.fromiter((sp.start for sp in spans), np.int64, len(spans)) + counts
        chain = np.zeros((4, size), np.int64)
        chain[0, :len(spans)] = at + counts - 1
        chain[1, :len(spans)] = first
        chain[2, :len(spans)] = first + rope
        chain[3, :len(spans)] = [len(sp.block_table) * bs for sp in spans]
        self.chain[:4 * size].copy_(to_device(chain.ravel(), torch.long, features.device))

    def _forward(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        head, q, bs = self.head, self.q, self.block_size
        tokens = self.tokens(size)
        attn = self.runner.attn
        meta = static_verify_metadata(tokens[2], self.block_tables[:size],
                                      self.query_start_loc[:size + 1], self.seq_lens[:size],
                                      self.context_lens[:size], q, self.max_model_len)
        g = head(tokens[0], self.features[:size * q], tokens[1], self.kv_cache, attn, meta)
        last, held, rope, limit = self.chain[:4 * size].view(4, size)
        g = g.index_select(0, last)
        ids, confidence = head.draft_tokens(g)
        drafts, sure, outputs = [ids], [confidence], [g]
        tables = self.block_tables[:size]
        for j in range(self.k - 1):
            at = held + j
            inside = at < limit
            block = tables.gather(1, (at // bs).clamp(max=self.max_blocks - 1)[:, None])[:, 0]
            slots = torch.where(inside, block.long() * bs + at % bs, -1)
            seq_lens = torch.where(inside, at + 1, 0).to(torch.int32)
            step = static_decode_metadata(slots, tables, seq_lens, self.max_model_len)
            g = head(ids, g, rope + j, self.kv_cache, attn, step)
            ids, confidence = head.draft_tokens(g)
            drafts.append(ids)
            sure.append(confidence)
            outputs.append(g)
        return torch.stack(drafts, 1), torch.stack(sure, 1), torch.stack(outputs, 1)

    def _keep(self, graph: torch.cuda.CUDAGraph, outputs: tuple, size: int) -> _DraftGraph:
        return _DraftGraph(graph, *outputs)
