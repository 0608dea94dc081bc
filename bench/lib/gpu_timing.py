"""Shared by the GPU benches: device time per call inside one CUDA graph, an engine's step times
until it is idle, host time spent in a wrapped function, a row recorder for sweeps, and the
header every result JSON starts with."""

from __future__ import annotations

import datetime
import json
import statistics
import sys
import time

import torch


def capture(calls) -> torch.cuda.CUDAGraph:
    """The no-argument functions `calls`, in order, in one CUDA graph (after a warm-up run on a
    side stream: compiles, workspaces)."""
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
    return graph


def replay_times_ms(graph: torch.cuda.CUDAGraph, reps: int, warmup: int = 0) -> list[float]:
    """Device time (ms) of each of `reps` replays, after `warmup` untimed ones."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for i in range(warmup + reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return times


def replay_ms(graph: torch.cuda.CUDAGraph, reps: int) -> float:
    """Median replay time (ms) over `reps`, after 5 warm-up replays."""
    return round(statistics.median(replay_times_ms(graph, reps, warmup=5)), 4)


def graph_total_us(calls, reps: int = 30) -> float:
    """Device time (us, median of `reps` replays) of one graph of all of `calls`."""
    return statistics.median(replay_times_ms(capture(calls), reps)) * 1e3


def graph_us(calls, reps: int = 30) -> float:
    """Per-call device time (us) of the no-argument functions `calls`, captured in order into
    one CUDA graph: graph_total_us / len(calls)."""
    return round(graph_total_us(calls, reps) / len(calls), 2)


def drain(engine) -> tuple[list[float], list[int]]:
    """Step `engine` until it has nothing left: each step's wall time (ms) and every token the
    steps returned, in order."""
    times, tokens = [], []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        for out in engine.step():
            tokens += out.new_token_ids
        times.append((time.perf_counter() - t0) * 1e3)
    return times, tokens


def recorder(rows: list):
    """record(**row): append the row to `rows` and print it on one line (floats to 4 digits),
    for the sweeps that print as they go."""
    def record(**r):
        rows.append(r)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in r.items()), flush=True)
    return record


def timed(totals: dict, key: str, fn):
    """fn wrapped to add its wall time (s) to totals[key] on every call."""
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        totals[key] += time.perf_counter() - t0
        return out
    return wrapper


def header(bench: str) -> dict:
    """bench name, device, date, versions and the command that reproduces the result."""
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"bench": bench, "device": device,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "versions": {"torch": torch.__version__, "python": sys.version.split()[0]},
            "command": f"python bench/{bench}.py --out $OUT"}


def graph_median_us(fn, rep: int = 30) -> float:
    """Median device time (us) of fn replayed in a CUDA graph (triton.testing's
    do_bench_cudagraph), for the kernel sweeps."""
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1e3


def write_sweep(path: str, rows: list, t0: float, **extra) -> None:
    """A kernel sweep's result JSON (device, date, torch and Triton versions, `extra`, the
    command, the rows) and a closing line."""
    import triton

    result = {"device": torch.cuda.get_device_name(),
              "date": datetime.date.today().isoformat(), "torch": torch.__version__,
              "triton": triton.__version__, **extra, "command": " ".join(sys.argv), "rows": rows}
    with open(path, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"done in {time.time() - t0:.0f} s, {len(rows)} rows")
