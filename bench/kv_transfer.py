"""KV blocks over gRPC on CPU: SmolLM2-135M-Instruct (float32) on two workers in two processes
(one thread each), loopback gRPC between them, side by side in one run.

- Pull vs recompute, for prompts of 512, 2,048 and 8,160 tokens of KJV text (+ a 16-token tail
  no worker holds): the receiver's time to first token when it pulls the prefix from the holder
  (cluster/kv_service.KVPuller: probe done, then reserve, stream, verify, scatter, commit; then
  the tail's prefill) against computing the whole prompt, and the pull alone.
- Transfer throughput: the pull's bytes over its time, the chunks over the holder's data port
  (kv_transfer.data_plane "socket", the default: cache to cache, no copy in Python) and in the
  gRPC stream ("grpc"), against a plain TCP socket copy of as many bytes between the same two
  processes (from bytes in the holder's memory into a buffer of their size: `socket_copy_s`),
  and for reference the loopback's ceiling (the zero page into a reused 8 MiB buffer, no
  memory traffic); Python gRPC's own ceiling between them (the
  holder's Probe RPC: preallocated 2 MiB messages, no KV work, over 1 and 4 streams); and, in
  the receiver alone, the rates of the parts (gather, checksum, scatter).
- Migration pause: two workers in this process behind the router's logic (router/ingress.py);
  rounds of 8 greedy streams (300-token prompts) on one worker, drained once each stream has 8
  tokens: the time from a stream's last token on the old worker to its first on the new one,
  p50/p99 over 32 migrations, with KV pulled vs recomputed (KV transfer off).

Targets (issue 26): pull >= 10x faster than recompute at 2k; transfer >= 50% of the socket copy.

Run: python bench/kv_transfer.py [--reps 3] [--out bench/results/kv_transfer.json]  (~5 min)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lib.revision import head_commit, write_result  # noqa: E402
from mx_quality import kjv_tokens  # noqa: E402

from mxserve import LLM, SamplingParams  # noqa: E402
from mxserve.cluster.kv_service import KVNode, TransferOptions  # noqa: E402
from mxserve.cluster.kv_socket import _recv_exact  # noqa: E402
from mxserve.cluster.worker import Worker  # noqa: E402
from mxserve.worker.kv_transfer import (  # noqa: E402
    checksum,
    engine_block_io,
    measure_prefill_rate,
)

SIZES = (512, 2048, 8160)
PLANES = ("socket", "grpc")  # kv_transfer.data_plane
TAIL = 16
SECRET = "bench"
ENGINE = dict(dtype="float32", num_threads=1, num_kv_blocks=1200, max_model_len=8192,
              max_num_batched_tokens=2048, load_progress=False)
FIRST_TOKEN = SamplingParams(temperature=0, max_tokens=1)


def _prompts(sizes: list[int]) -> dict[int, list[int]]:
    from mxserve.worker.model.loader import open_checkpoint

    text = kjv_tokens(open_checkpoint(None).tokenizer, max(sizes))
    return {n: text[:n] for n in sizes}


# ---- the holder process --------------------------------------------------------------------


def holder_main(sizes: list[int]) -> None:
    """Cache every size's prefix, serve the blocks and a plain socket, print the addresses,
    and run until stdin closes."""
    prefixes = _prompts(sizes)
    llm = LLM(**ENGINE)
    llm.generate(list(prefixes.values()), FIRST_TOKEN)

    sock = socket.create_server(("127.0.0.1", 0))
    # "copy": bytes in memory, as many as asked (random, so every page is its own); "sink":
    # one zero-filled buffer never written, whose pages all map the kernel's one zero page
    # (always in cache), sent again and again
    largest = max(sizes) // 16 * engine_block_io(llm.engine)[1].bytes_per_block
    real = memoryview(torch.randint(0, 256, (largest,), dtype=torch.uint8).numpy())
    zeros = memoryview(bytes(64 << 20))

    def serve_socket() -> None:  # each connection: mode, 8-byte length in; the bytes out
        while True:
            conn, _ = sock.accept()
            with conn:
                mode = conn.recv(1)
                n = int.from_bytes(_recv_exact(conn, 8), "little")
                if mode == b"c":
                    conn.sendall(real[:n])
                    continue
                while n:
                    k = min(n, len(zeros))
                    conn.sendall(zeros[:k])
                    n -= k

    threading.Thread(target=serve_socket, daemon=True).start()

    async def main() -> None:
        worker = Worker(llm.engine, 8, "holder")
        worker.start()
        node = await KVNode.start(worker, TransferOptions(secret=SECRET), "127.0.0.1", 1.0)
        print(json.dumps({"kv": node.address, "socket": sock.getsockname()[1]}), flush=True)
        await asyncio.to_thread(sys.stdin.read)
        await node.stop()
        worker.shutdown()

    asyncio.run(main())


# ---- the receiver (this process) ------------------------------------------------------------


def socket_copy_s(port: int, num_bytes: int, mode: str) -> float:
    """A plain TCP copy of num_bytes from the holder. "copy": from bytes in its memory into a
    buffer of their size here (touched before, as a pool is): the same bytes' copy the
    target compares with. "sink": from the zero page into one reused 8 MiB buffer: the
    loopback's ceiling with no memory traffic, for reference."""
    copy = mode == "copy"
    buf = bytearray(num_bytes if copy else 8 << 20)
    buf[::4096] = b"\x01" * len(range(0, len(buf), 4096))  # every page touched
    view = memoryview(buf)
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(mode[0].encode() + num_bytes.to_bytes(8, "little"))
        done = 0
        while done < num_bytes:
            into = view[done:] if copy else view[:min(len(buf), num_bytes - done)]
            got = conn.recv_into(into)
            if not got:
                raise RuntimeError("socket closed early")
            done += got
    return time.perf_counter() - start


async def first_token_s(worker: Worker, prompt: list[int], rid: str, source=None
                        ) -> tuple[float, int]:
    start = time.perf_counter()
    cached = 0
    async for out in worker.generate(prompt, FIRST_TOKEN, rid, source):
        cached = out.num_cached_tokens
    return time.perf_counter() - start, cached


async def measure(args, holder: dict, prefixes: dict[int, list[int]]) -> dict:
    llm = LLM(**ENGINE)
    prefill_rate = measure_prefill_rate(llm.engine)
    worker = Worker(llm.engine, 8, "receiver")
    worker.start()
    node = await KVNode.start(worker, TransferOptions(secret=SECRET), "127.0.0.1",
                              prefill_rate)
    puller = node.puller
    options = puller.options
    layout = puller.layout
    source = {"address": holder["kv"], "num_blocks": 1 << 20}
    rows = []
    try:
        for n, prefix in prefixes.items():
            compute, pulled, checks = [], [], []
            pull_only = {plane: [] for plane in PLANES}
            for rep in range(args.reps):
                tail = [(rep * 131 + 7 * i) % 20000 + 100 for i in range(TAIL)]
                prompt = prefix + tail
                await worker.async_engine.call(lambda e: e.kv.reset_prefix_cache())
                t, cached = await first_token_s(worker, prompt, f"c{n}-{rep}")
                compute.append(t)
                assert cached == 0
                await worker.async_engine.call(lambda e: e.kv.reset_prefix_cache())
                before = dict(puller.counts)
                t, cached = await first_token_s(worker, prompt, f"p{n}-{rep}", source)
                pulled.append(t)
                checks.append(cached == n - n % 16
                              and puller.counts["ok"] == before.get("ok", 0) + 1)
                # the pull alone, into an emptied cache, by each data plane
                for plane in PLANES:
                    puller.options = dataclasses.replace(options, data_plane=plane)
                    await worker.async_engine.call(lambda e: e.kv.reset_prefix_cache())
                    request = llm.engine.make_request(prompt, FIRST_TOKEN)
                    start = time.perf_counter()
                    got = await puller.maybe_pull(request.block_hashes, request.num_tokens,
                                                  source)
                    pull_only[plane].append(time.perf_counter() - start)
                    assert got == n // 16, (plane, got)
                puller.options = options
            num_bytes = (n // 16) * layout.bytes_per_block
            socket_s = statistics.median(socket_copy_s(holder["socket"], num_bytes, "copy")
                                         for _ in range(args.reps))
            sink_s = statistics.median(socket_copy_s(holder["socket"], num_bytes, "sink")
                                       for _ in range(args.reps))
            est_pull, est_compute = puller.policy.estimate(holder["kv"], n // 16, layout)
            row = dict(prompt_tokens=n, bytes=num_bytes,
                       compute_ttft_s=round(statistics.median(compute), 4),
                       pull_ttft_s=round(statistics.median(pulled), 4),
                       pull_only_s=round(statistics.median(pull_only["socket"]), 4),
                       pull_only_grpc_s=round(statistics.median(pull_only["grpc"]), 4),
                       socket_copy_s=round(socket_s, 4), socket_sink_s=round(sink_s, 4),
                       policy_estimate_s=dict(pull=round(est_pull, 4),
                                              compute=round(est_compute, 4)),
                       pulled_correctly=all(checks))
            row["ttft_speedup"] = round(row["compute_ttft_s"] / row["pull_ttft_s"], 2)
            row["pull_vs_compute"] = round(row["compute_ttft_s"] / row["pull_only_s"], 2)
            row["pull_gb_s"] = round(num_bytes / row["pull_only_s"] / 1e9, 3)
            row["socket_gb_s"] = round(num_bytes / socket_s / 1e9, 3)
            row["pull_vs_socket"] = round(socket_s / row["pull_only_s"], 3)
            row["socket_sink_gb_s"] = round(num_bytes / sink_s / 1e9, 3)
            row["pull_vs_socket_sink"] = round(sink_s / row["pull_only_s"], 3)
            row["pull_grpc_gb_s"] = round(num_bytes / row["pull_only_grpc_s"] / 1e9, 3)
            row["pull_grpc_vs_socket"] = round(socket_s / row["pull_only_grpc_s"], 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
        parts = part_rates(node, layout)
        ceiling = await grpc_ceiling(holder["kv"])
    finally:
        await node.stop()
        worker.shutdown()
    return dict(prefill_tokens_per_s=round(prefill_rate, 1), rows=rows, parts_gb_s=parts,
                grpc_probe_gb_s=ceiling,
                bytes_per_block=layout.bytes_per_block, counts=dict(puller.counts))


async def grpc_ceiling(address: str, num_bytes: int = 64 << 20) -> dict:
    """GB/s of the holder's Probe stream (2 MiB messages of nothing, no KV work) over one
    channel, with 1 and 4 streams at once: what Python gRPC itself moves here."""
    import grpc

    from mxserve.proto import kv_transfer_pb2 as pb
    from mxserve.proto import kv_transfer_pb2_grpc as pb_grpc

    out = {}
    async with grpc.aio.insecure_channel(
            address, options=[("grpc.max_receive_message_length", 64 << 20)]) as channel:
        stub = pb_grpc.KVTransferStub(channel)

        async def one(n: int) -> int:
            stream = stub.Probe(pb.ProbeRequest(num_bytes=n, chunk_bytes=2 << 20),
                                metadata=(("x-mxserve-kv-secret", SECRET),))
            return sum([len(m.data.payload) async for m in stream])

        for k in (1, 4):
            times = []
            for _ in range(3):
                start = time.perf_counter()
                got = sum(await asyncio.gather(*(one(num_bytes // k) for _ in range(k))))
                times.append(time.perf_counter() - start)
            out[f"streams_{k}_gb_s"] = round(got / statistics.median(times) / 1e9, 3)
    return out


def part_rates(node: KVNode, layout) -> dict:
    """GB/s of the transfer's parts on one chunk's blocks of this pool (the chunk size a pull
    streams, `TransferOptions.chunk_bytes`): gather (cache -> bytes), XXH3-64 checksum,
    scatter (bytes -> cache)."""
    io = node.puller.io
    ids = list(range(max(1, node.service.options.chunk_bytes // layout.bytes_per_block)))
    data = io.read(ids)
    out = {}
    for name, fn in (("gather", lambda: io.read(ids)), ("checksum", lambda: checksum(data)),
                     ("scatter", lambda: io.write(ids, data))):
        times = []
        for _ in range(5):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        out[name] = round(len(data) / statistics.median(times) / 1e9, 3)
    return out


class _TwoWorkers:
    """router.ingress.Workers over two in-process Workers: new requests to `first`, a handed-
    back one to the other; each output's arrival time kept per request and call."""

    def __init__(self, workers: dict, first: str, pull: bool) -> None:
        self.workers, self.first, self.pull = workers, first, pull
        self.times: dict[str, list[list[float]]] = {}  # request -> per call, token times

    def generate(self, prompt, params, request_id, **hints):
        resume = hints.get("resume")
        target = self.first if resume is None else \
            next(w for w in self.workers if w != resume.worker_id)
        source = hints.get("kv_source") if self.pull else None
        calls = self.times.setdefault(request_id, [])
        calls.append([])
        return self._timed(self.workers[target].generate(prompt, params, request_id, source,
                                                         resume), calls[-1])

    @staticmethod
    async def _timed(stream, times: list[float]):
        async for out in stream:
            if out.new_token_ids:
                times.append(time.perf_counter())
            yield out

    async def loads(self):
        return []


async def migration_pauses(llms: list[LLM], prompts: list[list[int]], pull: bool,
                           rounds: int) -> list[float]:
    """Seconds from each stream's last token on the drained worker to its first on the other."""
    from mxserve.proto import mxserve_pb2 as mpb
    from mxserve.router.ingress import Router
    from mxserve.router.requests import ModelCard

    workers, nodes = {}, []
    for i, llm in enumerate(llms):
        rate = measure_prefill_rate(llm.engine, 256) if pull else 0.0  # before it serves
        w = Worker(llm.engine, 16, f"w{i}")
        w.start()
        workers[w.worker_id] = w
        if pull:
            nodes.append(await KVNode.start(w, TransferOptions(secret=SECRET), "127.0.0.1",
                                            rate))
    engine = llms[0].engine
    card = ModelCard("smollm2", engine.max_model_len, engine.model_config.vocab_size,
                     tuple(engine.model_config.eos_token_ids))
    pauses = []
    try:
        for r in range(rounds):
            first = f"w{r % 2}"
            local = _TwoWorkers(workers, first, pull)
            router = Router(llms[0].tokenizer, card, local)
            batch = prompts[8 * r:8 * r + 8]

            async def run(router: Router, prompt: list[int]) -> list[int]:
                request = mpb.GenerateRequest(
                    token_ids=mpb.TokenIds(ids=prompt),
                    sampling_params=mpb.SamplingParams(temperature=0, max_tokens=40,
                                                       ignore_eos=True))
                return [t async for resp in router.generate(request) for t in resp.token_ids]

            tasks = [asyncio.create_task(run(router, p)) for p in batch]
            while len(local.times) < len(batch) or \
                    min(len(c[0]) for c in local.times.values()) < 8:
                await asyncio.sleep(0.002)
            await workers[first].drain()
            await asyncio.gather(*tasks)
            workers[first].draining = False  # (this bench reuses the drained worker)
            for calls in local.times.values():
                assert len(calls) == 2 and calls[1], "a stream was not moved"
                pauses.append(calls[1][0] - calls[0][-1])
    finally:
        for node in nodes:
            await node.stop()
        for w in workers.values():
            w.shutdown()
    return pauses


def migration_section(args) -> dict:
    from mxserve.worker.model.loader import open_checkpoint

    text = kjv_tokens(open_checkpoint(None).tokenizer, 300 * 8 * args.rounds + 300)
    prompts = [text[300 * i:300 * i + 300] for i in range(8 * args.rounds)]
    out = {}
    for pull in (True, False):
        llms = [LLM(**{**ENGINE, "num_kv_blocks": 600}) for _ in range(2)]
        pauses = asyncio.run(migration_pauses(llms, prompts, pull, args.rounds))
        out["pull" if pull else "recompute"] = dict(
            n=len(pauses), p50_ms=round(1e3 * statistics.median(pauses), 1),
            p99_ms=round(1e3 * sorted(pauses)[min(len(pauses) - 1,
                                                  int(0.99 * len(pauses)))], 1),
            max_ms=round(1e3 * max(pauses), 1))
        print(json.dumps(out), flush=True)
        del llms
    return out


def markdown(result: dict) -> str:
    lines = [f"# KV transfer over gRPC (CPU, {result['date']}, {result['commit']})", "",
             f"SmolLM2-135M-Instruct float32, {result['bytes_per_block']:,} bytes a block; "
             f"two processes, one thread each, loopback. Prefill measured at start-up: "
             f"{result['prefill_tokens_per_s']} tokens/s. Medians of {result['reps']}.", "",
             "| prompt tokens | MB | TTFT compute s | TTFT pull s | speedup | pull alone s "
             "| compute / pull | pull GB/s | socket copy GB/s | pull / copy | pull in gRPC GB/s "
             "| in gRPC / copy | socket sink GB/s | pull / sink |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['prompt_tokens']} | {r['bytes'] / 1e6:.1f} | {r['compute_ttft_s']} "
                     f"| {r['pull_ttft_s']} | {r['ttft_speedup']}x | {r['pull_only_s']} | "
                     f"{r['pull_vs_compute']}x | {r['pull_gb_s']} | {r['socket_gb_s']} | "
                     f"{r['pull_vs_socket']} | {r['pull_grpc_gb_s']} | "
                     f"{r['pull_grpc_vs_socket']} | {r['socket_sink_gb_s']} | "
                     f"{r['pull_vs_socket_sink']} |")
    lines += ["", "Socket copy: the same number of bytes from memory in the holder (random bytes, "
                  "every page its own) into a buffer of their size in the receiver (touched "
                  "before, as a pool is): the target's plain copy. Socket sink: a zero-filled "
                  "buffer (every page the kernel's one zero page, always in cache) into one "
                  "reused 8 MiB buffer: the loopback's ceiling with no memory traffic."]
    p = result["parts_gb_s"]
    g = result["grpc_probe_gb_s"]
    lines += ["", f"Parts on one chunk's blocks, in one process (GB/s): gather {p['gather']}, "
                  f"checksum {p['checksum']}, "
                  f"scatter {p['scatter']}. Python gRPC's own ceiling between the two processes "
                  f"(Probe: 2 MiB messages, no KV work): {g['streams_1_gb_s']} GB/s on one "
                  f"stream, {g['streams_4_gb_s']} on four.", ""]
    m = result.get("migration")
    if m:
        lines += ["Migration pause (last token on the drained worker to first on the other, "
                  f"8 streams a drain, {m['pull']['n']} migrations):", "",
                  "| KV | p50 ms | p99 ms | max ms |", "|---|---|---|---|"]
        for name in ("pull", "recompute"):
            lines.append(f"| {name} | {m[name]['p50_ms']} | {m[name]['p99_ms']} | "
                         f"{m[name]['max_ms']} |")
        lines.append("")
    lines += [f"Targets: {result['targets_met']}", ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--holder", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="prompt tokens")
    p.add_argument("--rounds", type=int, default=4, help="migration rounds of 8 streams")
    p.add_argument("--out", default="bench/results/kv_transfer.json")
    args = p.parse_args()
    sizes = [int(n) for n in args.sizes.split(",")]
    if args.holder:
        holder_main(sizes)
        return
    torch.manual_seed(0)
    t0 = time.perf_counter()
    prefixes = _prompts(sizes)
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--holder",
                             "--sizes", args.sizes],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        holder = json.loads(proc.stdout.readline())
        measured = asyncio.run(measure(args, holder, prefixes))
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
    measured["migration"] = migration_section(args) if args.rounds else None
    at_2k = next(r for r in measured["rows"] if r["prompt_tokens"] == 2048)
    targets_met = {"pull_10x_faster_than_recompute_at_2k": at_2k["pull_vs_compute"] >= 10,
                   "transfer_ge_50pct_of_socket_copy": at_2k["pull_vs_socket"] >= 0.5}
    result = dict(bench="kv_transfer", device=f"cpu ({platform.processor() or 'x86_64'}, "
                                             f"{os.cpu_count()} cores)",
                  date=datetime.date.today().isoformat(), commit=head_commit(),
                  versions=dict(python=platform.python_version(), torch=torch.__version__,
                                grpcio=__import__("grpc").__version__),
                  command="python bench/kv_transfer.py " + " ".join(sys.argv[1:]),
                  reps=args.reps, **measured, targets_met=targets_met,
                  seconds=round(time.perf_counter() - t0))
    write_result(args.out, result, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
