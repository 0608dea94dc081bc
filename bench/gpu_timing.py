"""Shared by the GPU benches: device time per call inside one CUDA graph, an engine's step times
until it is idle, host time spent in a wrapped function, a row recorder for sweeps, the header
every result JSON starts with, and the MX decode probes' command line and cases with their
baselines."""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

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
    return {"bench": bench, "device": torch.cuda.get_device_name(),
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


def decode_probe_args(name: str, variants, shapes: list[tuple[int, int]], ms: str,
                      **extra: str) -> argparse.Namespace:
    """An MX decode probe's command line: --out, --budget (s), --variants, --shapes (NxK,...),
    --ms (rows, comma list) and `extra` string options with their defaults; shapes, ms and
    variants come back as lists."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=f"/tmp/{name}.json")
    ap.add_argument("--budget", type=float, default=400.0, help="seconds; stops early past it")
    ap.add_argument("--variants", default=",".join(variants))
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in shapes))
    ap.add_argument("--ms", default=ms)
    for key, default in extra.items():
        ap.add_argument(f"--{key}", default=default)
    args = ap.parse_args()
    args.variants = args.variants.split(",")
    args.shapes = [tuple(int(v) for v in nk.split("x")) for nk in args.shapes.split(",")]
    args.ms = [int(v) for v in args.ms.split(",")]
    return args


@dataclass
class MXDecodeCase:
    """One MXFP4 linear [N, K] at M rows of x, read as a model reads it (copies cycled past
    L2), its baselines recorded: cuBLAS bf16 ("cublas") and the library's tensor-core decode
    ("bf16tc")."""

    shape: dict  # N, K, M
    x: torch.Tensor  # [M, K] bf16
    ref: torch.Tensor  # x @ dequantized(w).T in fp32
    weights: dict  # name -> copies ("tc", "dense" and the probe's own)
    ncopies: int  # MX copies a call cycles through
    mbytes: int  # one MX copy's weight and scale bytes
    t_bf16: float  # us a call
    t_tc: float
    record: Callable

    def err_of(self, y: torch.Tensor) -> float:
        return ((y.float() - self.ref).norm() / self.ref.norm()).item()

    def time(self, name: str, fn) -> bool:
        """Record variant `name`: fn() runs once over every MX copy and returns the output; its
        error and time a copy, with its ratios to the baselines. False, with an error row, when
        it fails (a variant Triton cannot compile, say)."""
        try:
            err = self.err_of(fn())
            t = graph_median_us(fn) / self.ncopies
        except Exception as exc:
            self.record(**self.shape, var=name, error=str(exc)[:300])
            return False
        self.record(**self.shape, var=name, us=t, x_bf16=self.t_bf16 / t, x_tc=self.t_tc / t,
                    tbs=self.mbytes / t / 1e6, err=err)
        return True


def mx_decode_cases(shapes: list[tuple[int, int]], ms: list[int], record, deadline: float,
                    prepare: dict) -> Iterator[MXDecodeCase]:
    """For each N x K (weights N(0, 0.02) quantized to e2m1) and each M (bf16 x), until
    time.time() passes `deadline`: the case, its baselines recorded. prepare: name ->
    fn(MXTensor) making the probe's own copies, in case.weights[name]."""
    import torch.nn.functional as F

    from mxserve.kernels.mx import dequantize_mx, quantize_mx
    from mxserve.kernels.mx_linear import _launch_decode, prepare_mx_weight

    gen = torch.Generator(device="cuda").manual_seed(0)
    for n, k in shapes:
        w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
        q = quantize_mx(w, "e2m1")
        deq = dequantize_mx(q, torch.float32)
        mbytes = n * k // 2 + n * k // 32
        ncopies = 1 + int(120e6 // mbytes)
        weights = {"tc": [prepare_mx_weight(q) for _ in range(ncopies)],
                   **{name: [fn(q) for _ in range(ncopies)] for name, fn in prepare.items()},
                   "dense": [w.to(torch.bfloat16) for _ in range(1 + int(120e6 // (2 * n * k)))]}
        for m in ms:
            if time.time() > deadline:
                break
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            shape = dict(N=n, K=k, M=m)
            dense = weights["dense"]
            t_bf16 = graph_median_us(lambda x=x, ws=dense: [F.linear(x, d) for d in ws]) \
                / len(dense)
            record(**shape, var="cublas", us=t_bf16, tbs=n * k * 2 / t_bf16 / 1e6)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)

            def tc_fn(x=x, out=out, ws=weights["tc"]):
                for w_i in ws:
                    _launch_decode(x, w_i, out, None, None, tc=True)
                return out
            case = MXDecodeCase(shape, x, x.float() @ deq.T, weights, ncopies, mbytes, t_bf16,
                                0.0, record)
            err = case.err_of(tc_fn())
            case.t_tc = graph_median_us(tc_fn) / ncopies
            record(**shape, var="bf16tc", us=case.t_tc, x_bf16=t_bf16 / case.t_tc,
                   tbs=mbytes / case.t_tc / 1e6, err=err)
            yield case
        del weights
        torch.cuda.empty_cache()
