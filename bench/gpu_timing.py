"""Shared by the GPU probes (decode_step_probe.py, decode_gemv_probe.py): device time per call
inside one CUDA graph, and the header every result JSON starts with."""

from __future__ import annotations

import datetime
import statistics
import sys

import torch


def graph_us(calls, reps: int = 30) -> float:
    """Per-call device time (us, median of `reps` replays) of the no-argument functions `calls`,
    captured in order into one CUDA graph after a warm-up run on a side stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return round(statistics.median(times), 2)


def header(bench: str) -> dict:
    """bench name, device, date, versions and the command that reproduces the result."""
    return {"bench": bench, "device": torch.cuda.get_device_name(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "versions": {"torch": torch.__version__, "python": sys.version.split()[0]},
            "command": f"python bench/{bench}.py --out $OUT"}
