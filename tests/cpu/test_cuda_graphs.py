"""CUDA graph bookkeeping that needs no GPU (the replays themselves: tests/gpu)."""

from __future__ import annotations

from mxserve import LLM
from mxserve.worker.cuda_graphs import capture_sizes


def test_capture_sizes_cover_every_batch_with_bounded_padding():
    assert capture_sizes(1) == [1]
    assert capture_sizes(13) == [1, 2, 4, 8, 13]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    sizes = capture_sizes(512)
    assert sizes[-1] == 512 and sizes == sorted(set(sizes))
    for batch in range(1, 513):
        padded = next(s for s in sizes if s >= batch)
        assert padded <= max(2 * batch, 16) and (batch <= 16 or padded <= batch * 1.5)


def test_cpu_engine_captures_no_graphs(tiny_checkpoint):
    llm = LLM(model=str(tiny_checkpoint("llama")), device="cpu", load_progress=False)
    assert llm.engine.runner.graphs is None
