"""The sampler's CUDA graphs (worker/sampler.py, Sampler's `graphs`): a decode graph's logits
sampled the common way, and a plain-greedy batch's argmax, each recorded over one static logits
buffer."""

from __future__ import annotations

import numpy as np
import torch

from mxserve.api.sampling_params import SamplingParams
from mxserve.worker.logits_ops import argmax


class SampleGraph:
    """Temperature, top_p's cutoff (top_k off) and the race over one static logits buffer
    [size, vocab], recorded once as a CUDA graph (on CPU run as it is: tests). A call's rows are
    the buffer's first ones; the rows past them sample with temperature and top_p 1, unread.
    The per-row temperature and top_p and the race's seed reach the graph in one copy from
    pinned staging, two sets used in turn (a set is refilled once its last copy ran)."""

    def __init__(self, logits: torch.Tensor, capture_pool=None) -> None:
        self.logits = logits  # held: the graph keeps its address
        self.size = logits.shape[0]
        pin = logits.is_cuda
        # [temperatures (size), top_p (size), the race's seed (int32 bits)]
        self.inputs = torch.ones(2 * self.size + 1, dtype=torch.float32, device=logits.device)
        self._staging = [torch.ones(2 * self.size + 1, dtype=torch.float32, pin_memory=pin)
                         for _ in range(2)]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.tokens: torch.Tensor | None = None
        if logits.is_cuda:  # (warmed up with the inputs at ones: the buffer divided by 1)
            self.graph, self.tokens = record_graph(self._step, capture_pool)

    def _step(self) -> torch.Tensor:
        from mxserve.kernels.sampling_ops import race_rows, top_p_search_rows

        n = self.size
        self.logits.div_(self.inputs[:n].view(n, 1))
        threshold = top_p_search_rows(self.logits, self.inputs[n:2 * n].view(n, 1))
        return race_rows(self.logits, threshold, self.inputs[2 * n:].view(torch.int32))

    def run(self, params: list[SamplingParams], seed: int) -> torch.Tensor:
        """Queue the sampling of the first len(params) rows -> tokens [rows] int64 (on the
        device, valid until the next run)."""
        rows, n = len(params), self.size
        turn, self._turn = self._turn, 1 - self._turn
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()  # this set's previous copy has run
        staging = self._staging[turn]
        values = staging.numpy()
        values[:rows] = [sp.temperature for sp in params]
        values[rows:n] = 1.0
        values[n:n + rows] = [sp.top_p for sp in params]
        values[n + rows:2 * n] = 1.0
        values[2 * n:].view(np.int32)[0] = seed
        self.inputs.copy_(staging, non_blocking=True)
        if self.graph is None:
            return self._step()[:rows]
        self._copied[turn] = torch.cuda.Event()
        self._copied[turn].record()
        self.graph.replay()
        return self.tokens[:rows]


class ArgmaxGraph:
    """The first maximal index of each row of one static logits buffer [size, vocab] (size <=
    ARGMAX_TRITON_ROWS: argmax_rows, as _argmax takes them eagerly), recorded once as a CUDA
    graph (on CPU run as it is: tests): a plain-greedy decode batch's tokens in one replay
    instead of two launches from the host. A call's rows are the buffer's first ones."""

    def __init__(self, logits: torch.Tensor, capture_pool=None) -> None:
        self.logits = logits  # held: the graph keeps its address
        self.size = logits.shape[0]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.tokens: torch.Tensor | None = None
        if logits.is_cuda:
            self.graph, self.tokens = record_graph(lambda: argmax(self.logits), capture_pool)

    def run(self, rows: int) -> torch.Tensor:
        """Queue the argmax of the first `rows` rows -> tokens [rows] int64 (on the device,
        valid until the next run)."""
        if self.graph is None:
            return argmax(self.logits[:rows])
        self.graph.replay()
        return self.tokens[:rows]


def record_graph(step, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """step() (no arguments, returns a tensor) as a CUDA graph in `pool`, warmed up off the
    capture stream first (compiles): (graph, its output tensor)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = step()
    return graph, out
