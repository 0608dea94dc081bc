"""The chaos harness: steady load on a served app while worker replicas (and, optionally, the
Redis prefix index) are killed at random times; what a worker loss costs the clients.

Closed-loop clients each send greedy requests drawn from a prompt pool, one at a time, and
record every request's outcome. A killer SIGKILLs a random live worker replica's process (a
busy one where any is) every `kill_every_s` (once the app has all its workers again: Serve
replaces a killed replica), after noting how many requests it was running (those must move);
optionally, halfway between two worker kills, Redis is crashed and restarted empty, or a draft
replica (speculation with draft_placement "replica") SIGKILLed, in turn. `ChaosResult` sums it
up: completed / failed / hung, output mismatches against the undisturbed run, time
to first token inside the fault windows and outside, and KV blocks still held once idle.

Used by tests/cpu/test_serve_chaos.py and bench/chaos.py; Ray must already be initialized
(the killer finds replica processes through it) and the cluster must run on this machine.
"""

from __future__ import annotations

import itertools
import os
import random
import signal
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from mxserve.cluster.client import Client
from mxserve.cluster.local import worker_pids

HEALTH_TIMEOUT_S = 10.0  # the harness's own health calls: a stuck proxy fails them, not the run


@dataclass
class Outcome:
    """One request as its client saw it."""

    prompt_index: int
    start: float  # time.monotonic() when sent
    first: float | None = None  # when its first token came
    end: float = 0.0
    status: str = "ok"  # "ok" or the gRPC status code's name
    token_ids: list[int] = field(default_factory=list)


@dataclass
class Kill:
    at: float  # time.monotonic()
    target: str  # a worker id, "redis", or "draft:<replica id>"
    num_in_flight: int = 0  # requests running or waiting on it (they must move)


@dataclass
class ChaosResult:
    outcomes: list[Outcome]
    kills: list[Kill]
    window_s: float  # how long after a kill counts as its fault window
    expected: list[list[int]]  # the undisturbed run's tokens, by prompt index
    num_kv_blocks_leaked: int  # blocks the workers still hold once idle

    def window_of(self, o: Outcome) -> str:
        """"in_window" when the request waited for its first token across a worker kill or
        was sent within window_s after one, "redis_window" the same for a Redis crash, else
        "outside"."""
        first = o.first if o.first is not None else o.end
        hit = {_kind(k) for k in self.kills if k.at < first and o.start < k.at + self.window_s}
        return "in_window" if "worker" in hit else "redis_window" if "redis" in hit else \
            "draft_window" if hit else "outside"

    def summary(self) -> dict:
        done = [o for o in self.outcomes if o.status == "ok"]
        ttft: dict[str, list[float]] = {"in_window": [], "redis_window": [], "draft_window": [],
                                        "outside": []}
        for o in done:
            if o.first is not None:
                ttft[self.window_of(o)].append(o.first - o.start)
        statuses: dict[str, int] = {}
        for o in self.outcomes:
            if o.status != "ok":
                statuses[o.status] = statuses.get(o.status, 0) + 1
        return dict(
            requests=len(self.outcomes), completed=len(done),
            failed=len(self.outcomes) - len(done), failed_by_status=statuses,
            hung=statuses.get("DEADLINE_EXCEEDED", 0),
            mismatches=sum(o.token_ids != self.expected[o.prompt_index] for o in done),
            kills=sum(_kind(k) == "worker" for k in self.kills),
            redis_kills=sum(_kind(k) == "redis" for k in self.kills),
            draft_kills=sum(_kind(k) == "draft" for k in self.kills),
            migrated=sum(k.num_in_flight for k in self.kills),
            ttft_in_window=_percentiles(ttft["in_window"]),
            ttft_redis_window=_percentiles(ttft["redis_window"]),
            ttft_draft_window=_percentiles(ttft["draft_window"]),
            ttft_outside=_percentiles(ttft["outside"]),
            kv_blocks_leaked=self.num_kv_blocks_leaked)


def _kind(kill: Kill) -> str:
    if kill.target == "redis":
        return "redis"
    return "draft" if kill.target.startswith("draft:") else "worker"


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    values = sorted(values)
    p99 = values[min(len(values) - 1, int(0.99 * len(values)))]
    return {"n": len(values), "p50_s": round(statistics.median(values), 3),
            "p99_s": round(p99, 3), "max_s": round(values[-1], 3)}


def run_chaos(endpoint: str, app_name: str, num_workers: int, prompts: list[list[int]],
              expected: list[list[int]], *, duration_s: float, kill_every_s: float,
              num_clients: int = 8, window_s: float = 10.0, request_timeout_s: float = 120.0,
              restart_redis: Callable[[], None] | None = None, kill_drafts: bool = False,
              seed: int = 0, min_worker_kills: int = 0) -> ChaosResult:
    """Load the app for duration_s with num_clients closed-loop clients (greedy, each prompt's
    len(expected[i]) tokens), killing a random worker every kill_every_s; halfway between two
    worker kills, in turn, Redis crashed (restart_redis: kill it and start it empty) and a
    draft replica SIGKILLed (kill_drafts). Then wait for the app to be whole and idle and
    count the KV blocks still held. min_worker_kills: the load goes on past duration_s (up to
    3x it) until that many workers were killed (on a slow machine a replacement worker takes
    long to come up, and a kill waits for it)."""
    def crash_redis() -> Kill:
        restart_redis()
        return Kill(time.monotonic(), "redis")

    extras: list[Callable[[], Kill | None]] = []
    if restart_redis is not None:
        extras.append(crash_redis)
    if kill_drafts:
        extras.append(lambda: _kill_draft(app_name, rng, kill_every_s))
    start = time.monotonic()
    stop = threading.Event()
    outcomes: list[Outcome] = []
    kills: list[Kill] = []
    lock = threading.Lock()

    def client_loop(n: int) -> None:
        rng = random.Random(seed * 1000 + n)
        with Client(endpoint, app_name) as client:
            while not stop.is_set():
                i = rng.randrange(len(prompts))
                o = _one(client, i, prompts[i], len(expected[i]), request_timeout_s)
                with lock:
                    outcomes.append(o)

    threads = [threading.Thread(target=client_loop, args=(n,), daemon=True)
               for n in range(num_clients)]
    for t in threads:
        t.start()
    rng = random.Random(seed)
    next_kill = start + kill_every_s
    for n in itertools.count():  # worker kills at even turns, the extras in turn at odd ones
        enough = sum(_kind(k) == "worker" for k in kills) >= min_worker_kills
        end = start + (duration_s if enough else 3 * duration_s)
        time.sleep(max(0.0, min(next_kill, end) - time.monotonic()))
        if time.monotonic() >= end:
            break
        kill = _kill_worker(endpoint, app_name, num_workers, rng, kill_every_s) \
            if not extras or n % 2 == 0 else extras[(n // 2) % len(extras)]()
        if kill is not None:
            kills.append(kill)
        next_kill = time.monotonic() + (kill_every_s / 2 if extras else kill_every_s)
    stop.set()
    for t in threads:
        t.join(request_timeout_s + 10)
    _wait_whole(endpoint, app_name, num_workers, 120.0)
    return ChaosResult(outcomes, kills, window_s, expected, _blocks_held(endpoint, app_name))


def _one(client: Client, index: int, prompt: list[int], max_tokens: int,
         timeout_s: float) -> Outcome:
    import grpc

    o = Outcome(index, time.monotonic())
    try:
        for r in client.stream(prompt, temperature=0, max_tokens=max_tokens, ignore_eos=True,
                               timeout_s=timeout_s):
            if r.token_ids and o.first is None:
                o.first = time.monotonic()
            o.token_ids += r.token_ids
    except grpc.RpcError as e:
        o.status = e.code().name
    o.end = time.monotonic()
    return o


def _kill_worker(endpoint: str, app_name: str, num_workers: int, rng: random.Random,
                 wait_s: float) -> Kill | None:
    """SIGKILL a random worker replica's process, a busy one where any is, once all
    num_workers are up (None if they never were within wait_s, or no load report came)."""
    import grpc

    if not _wait_whole(endpoint, app_name, num_workers, wait_s, idle=False):
        return None
    pids = worker_pids(app_name)
    try:
        with Client(endpoint, app_name, timeout_s=HEALTH_TIMEOUT_S) as client:
            loads = {w.worker_id: w for w in client.health().workers}
    except grpc.RpcError:  # a worker died between the two reports: no kill this turn
        return None
    alive = sorted(set(pids) & set(loads))
    if not alive:
        return None
    # A worker with requests in flight when there is one: a kill of an idle worker (say a
    # replacement the router has not sent to yet) tests no migration.
    busy = [w for w in alive if loads[w].num_running + loads[w].num_waiting > 0]
    victim = rng.choice(busy or alive)
    os.kill(pids[victim], signal.SIGKILL)
    return Kill(time.monotonic(), victim, loads[victim].num_running + loads[victim].num_waiting)


def _kill_draft(app_name: str, rng: random.Random, wait_s: float) -> Kill | None:
    """SIGKILL a random draft replica's process (None if none is up within wait_s)."""
    deadline = time.monotonic() + wait_s
    while not (pids := worker_pids(app_name, "Draft")):
        if time.monotonic() > deadline:
            return None
        time.sleep(0.1)
    victim = rng.choice(sorted(pids))
    os.kill(pids[victim], signal.SIGKILL)
    return Kill(time.monotonic(), f"draft:{victim}")


def _wait_whole(endpoint: str, app_name: str, num_workers: int, timeout_s: float,
                idle: bool = True) -> bool:
    """Until num_workers workers report (and, with idle, none runs or waits)."""
    deadline = time.monotonic() + timeout_s
    with Client(endpoint, app_name, timeout_s=HEALTH_TIMEOUT_S) as client:
        while time.monotonic() < deadline:
            try:
                loads = client.health().workers
            except Exception:  # the router's own health call may race a dying worker
                loads = []
            if len(loads) == num_workers and (not idle or all(
                    w.num_running == w.num_waiting == 0 for w in loads)):
                return True
            time.sleep(0.1)
    return False


def _blocks_held(endpoint: str, app_name: str, timeout_s: float = 10.0) -> int:
    """KV blocks the workers hold once idle (0 unless a request's blocks leaked; -1 when no
    health answer came)."""
    import grpc

    deadline = time.monotonic() + timeout_s
    held = -1
    with Client(endpoint, app_name, timeout_s=HEALTH_TIMEOUT_S) as client:
        while True:
            try:
                held = sum(w.num_kv_blocks_used for w in client.health().workers)
            except grpc.RpcError:  # held stays the last count (-1: none came)
                pass
            if held == 0 or time.monotonic() > deadline:
                return held
            time.sleep(0.1)
