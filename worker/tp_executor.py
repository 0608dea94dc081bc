"""One engine over a tensor-parallel group: rank 0 runs the engine (scheduler, KV block manager,
sampler, outputs) and its own shard of the model; ranks 1..N-1 run only their shards, the same
model step as rank 0, every step.

    rank 0 (the engine's process)                 rank r (a local process or a Ray actor)
    RankGroup: TCPStore, plan listener  --spec--> run_rank(spec)
    process group (gloo / NCCL)         <-join--  process group
    accept plan channels                <-hello-  connect
    load shard, capture graphs          <-ready-  load shard, capture graphs
    each step: plan bytes (tp_wire.py)  --------> decode, then the same runner.execute
               in-flight tokens: broadcast over the group (they stay on the device)
               model collectives: one all-reduce per attention block and per MLP
    close: an empty message (or EOF)    --------> return

The plan travels over a plain socket per rank, not a collective: a rank can wait for the next
step for ever (an idle engine sends nothing), and a socket that closes tells either side that
the other has gone. A second socket per rank carries KV blocks for transfers between workers
(worker/kv_transfer.py): rank 0 asks for, or hands over, each rank's shard of some blocks, and a
thread on the rank gathers or scatters them beside its steps (the blocks are pinned or not yet
visible to any request, so no step touches them meanwhile).

Collectives run under `tp_timeout_s`, so a rank that hangs fails the step instead of hanging
it; a failed group fails the engine for good (RankFailure), its replica reports unhealthy and
is replaced as a whole.

Where the other ranks run is the launcher's business: `LocalRankLauncher` starts them as local
processes (offline `LLM`, one machine); cluster/tp_ranks.py starts Ray actors in the worker
replica's placement group.
"""

from __future__ import annotations

import dataclasses
import datetime
import hmac
import logging
import secrets
import socket
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Protocol

import torch
import torch.distributed as dist

from mxserve.api.errors import ModelLoadError
from mxserve.worker.config import EngineConfig
from mxserve.worker.model.tp import TPGroup
from mxserve.worker.runner import load_runner
from mxserve.worker.scheduler import StepPlan
from mxserve.worker.tp_wire import decode_plan, encode_plan

logger = logging.getLogger(__name__)


class RankFailure(RuntimeError):
    """A rank of the tensor-parallel group died, hung or failed: the engine cannot step."""


@dataclass(frozen=True)
class RankSpec:
    """What rank `rank` needs to join rank 0's group (picklable: it crosses processes)."""

    config: EngineConfig  # this rank's (its device may differ from rank 0's)
    rank: int
    size: int
    host: str  # where rank 0 listens: its TCPStore and its plan and KV channels
    store_port: int
    channel_port: int
    authkey: bytes


PLAN, BLOCKS = 0, 1  # a rank's two channels to rank 0 (the hello says which)


class RankLauncher(Protocol):
    """Starts ranks 1..N-1 somewhere and can tell whether they still run."""

    host: str  # the address the other ranks reach rank 0 at

    def rank_config(self, config: EngineConfig, rank: int) -> EngineConfig:
        """Rank `rank`'s engine config (its device)."""

    def start(self, specs: list[RankSpec]) -> None:
        """Start a process running `run_rank(spec)` for each spec; return without waiting."""

    def alive(self) -> bool:
        """False once any started rank has exited."""

    def stop(self, timeout_s: float) -> None:
        """Wait up to timeout_s for the ranks to exit, then kill what remains."""


class LocalRankLauncher:
    """Ranks as processes of this machine (torch.multiprocessing, spawn), on cuda:rank on GPU."""

    host = "127.0.0.1"

    def __init__(self) -> None:
        self.processes = []

    def rank_config(self, config: EngineConfig, rank: int) -> EngineConfig:
        if config.torch_device.type != "cuda":
            return config
        return dataclasses.replace(config, device=f"cuda:{rank}")

    def start(self, specs: list[RankSpec]) -> None:
        import torch.multiprocessing as mp

        context = mp.get_context("spawn")
        for spec in specs:
            process = context.Process(target=run_rank, args=(spec,), daemon=True,
                                      name=f"mxserve-tp-rank{spec.rank}")
            process.start()
            self.processes.append(process)

    def alive(self) -> bool:
        return all(p.exitcode is None for p in self.processes)

    def stop(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.exitcode is None:
                p.kill()
                p.join(5)


def check_group_size(config: EngineConfig) -> None:
    """ValueError when this machine cannot hold the group (local ranks: one GPU each)."""
    size = config.tensor_parallel_size
    if config.torch_device.type == "cuda" and size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size {size} needs {size} GPUs; this machine has "
                         f"{torch.cuda.device_count()}")


class RankGroup:
    """Rank 0's end of the group: starts the others, joins the process group, and sends each
    step's plan. Build it, build and load rank 0's runner over `tp`, then `wait_ready()`."""

    def __init__(self, config: EngineConfig, launcher: RankLauncher | None = None) -> None:
        self.config, self.size = config, config.tensor_parallel_size
        self.launcher = launcher or LocalRankLauncher()
        self.conns: list[Connection] = []  # plan channels, ranks 1..N-1
        self.block_conns: list[Connection] = []  # KV block channels, likewise
        self._blocks_lock = threading.Lock()  # one block request on the channels at a time
        self.failure: str | None = None
        startup = datetime.timedelta(seconds=config.tp_startup_timeout_s)
        host = self.launcher.host
        store = dist.TCPStore(host, 0, self.size, True, timeout=startup, wait_for_workers=False)
        server = socket.create_server((host, 0))
        authkey = secrets.token_bytes(16)
        specs = [RankSpec(self.launcher.rank_config(config, r), r, self.size, host, store.port,
                          server.getsockname()[1], authkey) for r in range(1, self.size)]
        try:
            self.launcher.start(specs)
            self.tp = TPGroup(0, self.size, process_group(store, 0, self.size,
                                                          config.torch_device,
                                                          config.tp_timeout_s))
            channels = _accept(server, self.size - 1, authkey, config.tp_startup_timeout_s)
            self.conns, self.block_conns = channels[PLAN], channels[BLOCKS]
        except BaseException:
            server.close()
            self.launcher.stop(0)
            raise
        server.close()
        self._store = store  # the other ranks' process groups still talk to it

    def wait_ready(self) -> None:
        """Wait until every rank has loaded its shard (and captured its graphs); a rank's own
        error is raised here."""
        deadline = time.monotonic() + self.config.tp_startup_timeout_s
        for rank, conn in enumerate(self.conns, start=1):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                raise RankFailure(f"tensor-parallel rank {rank} not ready after "
                                  f"{self.config.tp_startup_timeout_s:.0f} s")
            message = _recv(conn, rank)
            if message != b"ready":
                raise ModelLoadError(f"tensor-parallel rank {rank}: {message.decode()}")

    def send(self, plan: StepPlan) -> None:
        """Hand the step to the other ranks: the plan, then (over the group) the in-flight
        tokens it reads. Raises RankFailure when a rank has gone."""
        if self.failure is not None:
            raise RankFailure(self.failure)
        data = encode_plan(plan)
        try:
            for conn in self.conns:
                conn.send_bytes(data)
        except OSError as e:
            self.fail(f"a tensor-parallel rank went away ({e!r})")
        if any(s.inflight_row >= 0 for s in plan.scheduled):
            self.tp.broadcast(plan.inflight_tokens)

    def read_blocks(self, block_ids: Sequence[int]) -> list[bytes]:
        """Ranks 1..N-1's shards of these blocks: each rank's model layers, K then V, each
        [n, block_size, its KV heads, head_dim], as bytes. RankFailure when a rank has gone."""
        request = b"R" + _ids_bytes(block_ids)
        with self._blocks_lock:
            self._send_all(request)
            return [self._answer(rank, conn) for rank, conn in
                    enumerate(self.block_conns, start=1)]

    def write_blocks(self, block_ids: Sequence[int], shards: Sequence[bytes]) -> None:
        """Write each rank's shard (as `read_blocks` gives them) into its pool; returns once
        every rank has written it."""
        request = b"W" + _ids_bytes(block_ids)
        with self._blocks_lock:
            try:
                for conn, shard in zip(self.block_conns, shards, strict=True):
                    conn.send_bytes(request)
                    conn.send_bytes(shard)
            except OSError as e:
                raise RankFailure(f"a tensor-parallel rank went away ({e!r})") from None
            for rank, conn in enumerate(self.block_conns, start=1):
                self._answer(rank, conn)

    def _send_all(self, message: bytes) -> None:
        try:
            for conn in self.block_conns:
                conn.send_bytes(message)
        except OSError as e:
            raise RankFailure(f"a tensor-parallel rank went away ({e!r})") from None

    @staticmethod
    def _answer(rank: int, conn: Connection) -> bytes:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            raise RankFailure(f"tensor-parallel rank {rank} went away") from None
        if data[:1] != b"+":
            raise RankFailure(f"tensor-parallel rank {rank}: {data[1:].decode()}")
        return data[1:]

    def check(self) -> None:
        """Raise RankFailure once any rank has exited or failed (a rank writes to its channel
        only to report an error, and a channel that closes reads as ready too)."""
        if self.failure is None and (not self.launcher.alive()
                                     or any(conn.poll() for conn in self.conns)):
            self.failure = "a tensor-parallel rank exited"
        if self.failure is not None:
            raise RankFailure(self.failure)

    def fail(self, reason: str) -> None:
        """Mark the group failed for good and raise RankFailure."""
        self.failure = reason
        raise RankFailure(reason)

    def close(self) -> None:
        """Tell the ranks to stop (an empty plan), wait for them, kill what remains. The group
        takes no step after; a failed group's ranks are killed at once."""
        failed = self.failure is not None
        self.failure = self.failure or "the tensor-parallel group was shut down"
        for conn in self.conns + self.block_conns:
            try:
                conn.send_bytes(b"")
                conn.close()
            except OSError:
                pass
        self.conns, self.block_conns = [], []
        self.launcher.stop(timeout_s=0 if failed else 10)


def process_group(store: dist.Store, rank: int, size: int, device: torch.device,
                  timeout_s: float):
    """This engine's own process group: NCCL on CUDA, gloo on CPU; every collective fails
    after timeout_s rather than waiting for a rank that never comes."""
    store = dist.PrefixStore("mxserve-tp", store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type != "cuda":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    torch.cuda.set_device(device)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, options)


def run_rank(spec: RankSpec) -> None:
    """Rank spec.rank's whole life: join the group, load its shard, then run each step rank 0
    sends until it says stop or goes away. Load errors go back to rank 0 (RankGroup.wait_ready)."""
    logging.basicConfig(level=logging.WARNING)
    conn, blocks = (_connect(spec, kind) for kind in (PLAN, BLOCKS))
    try:
        store = dist.TCPStore(spec.host, spec.store_port, spec.size, False, timeout=(
            datetime.timedelta(seconds=spec.config.tp_startup_timeout_s)))
        tp = TPGroup(spec.rank, spec.size, process_group(
            store, spec.rank, spec.size, spec.config.torch_device, spec.config.tp_timeout_s))
        runner = load_runner(spec.config, tp)
        conn.send_bytes(b"ready")
    except BaseException as e:
        conn.send_bytes(f"{type(e).__name__}: {e}".encode())
        raise
    server = threading.Thread(target=serve_blocks, args=(runner, blocks), daemon=True,
                              name=f"mxserve-tp-rank{spec.rank}-blocks")
    server.start()
    follow(runner, conn)
    server.join(10)  # rank 0 closes both channels; the process exits with no thread left


def _connect(spec: RankSpec, kind: int) -> Connection:
    sock = socket.create_connection((spec.host, spec.channel_port),
                                    timeout=spec.config.tp_startup_timeout_s)
    sock.settimeout(None)
    conn = Connection(sock.detach())
    conn.send_bytes(spec.authkey + spec.rank.to_bytes(4, "little") + bytes([kind]))
    return conn


def serve_blocks(runner, conn: Connection) -> None:
    """A rank's KV block channel: answer rank 0's reads ("R" + block ids -> "+" + this rank's
    shard) and writes ("W" + block ids, then the shard -> "+") until an empty message or EOF.
    A failure is answered "-" + what failed, and the channel goes on."""
    from mxserve.worker.kv_transfer import BlockIO

    io = BlockIO([c for pair in runner.kv_caches for c in pair])
    while True:
        try:
            request = conn.recv_bytes()
            if not request:
                return
            ids = _ids_of(request[1:])
            try:
                if request[:1] == b"R":
                    answer = b"+" + io.read(ids)
                else:
                    io.write(ids, conn.recv_bytes())
                    answer = b"+"
            except Exception as e:  # (a bad block id: rank 0's transfer fails, not the rank)
                answer = b"-" + f"{type(e).__name__}: {e}".encode()
            conn.send_bytes(answer)
        except (EOFError, OSError):
            return  # rank 0 went away


def _ids_bytes(block_ids: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(block_ids)}q", *block_ids)


def _ids_of(data: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(data) // 8}q", data))


def follow(runner, conn: Connection) -> None:
    """Run every step rank 0 sends until an empty message or EOF."""
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return  # rank 0 went away
        if not data:
            return
        plan, num_inflight = decode_plan(data)
        if num_inflight:
            plan.inflight_tokens = runner.tp.broadcast(
                torch.empty(num_inflight, dtype=torch.long, device=runner.device))
        runner.execute(plan)


def _accept(server: socket.socket, n: int, authkey: bytes, timeout_s: float
            ) -> tuple[list[Connection], list[Connection]]:
    """The plan and KV block channels of ranks 1..n, each in rank order, each proven by the
    group's key."""
    deadline = time.monotonic() + timeout_s
    by_rank: dict[tuple[int, int], Connection] = {}
    while len(by_rank) < 2 * n:
        server.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            sock, _ = server.accept()
        except TimeoutError:
            raise RankFailure(f"{2 * n - len(by_rank)} tensor-parallel rank channel(s) did "
                              f"not connect within {timeout_s:.0f} s") from None
        sock.settimeout(None)
        conn = Connection(sock.detach())
        hello = conn.recv_bytes() if conn.poll(5) else b""
        if len(hello) != len(authkey) + 5 or not hmac.compare_digest(hello[:-5], authkey) \
                or hello[-1] not in (PLAN, BLOCKS):
            conn.close()  # not one of ours
            continue
        by_rank[int.from_bytes(hello[-5:-1], "little"), hello[-1]] = conn
    return tuple([by_rank[r, kind] for r in range(1, n + 1)] for kind in (PLAN, BLOCKS))


def _recv(conn: Connection, rank: int) -> bytes:
    try:
        return conn.recv_bytes()
    except (EOFError, OSError):
        raise RankFailure(f"tensor-parallel rank {rank} exited while loading") from None
