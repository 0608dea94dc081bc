"""The EAGLE head in a draft replica of its own (worker/draft_server.py behind
worker/draft_channel.py): over a real socket, in-process and in a separate `mxserve
draft-server` process, its drafts are the local drafter's, token for token, and outputs equal
plain decoding's; the replica killed, stalled past the deadline or answering garbage makes the
target decode without drafts (outputs unchanged, nothing fails) and speculation resumes when a
replica is back; two targets share one replica."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from mxserve import LLM, SamplingParams
from mxserve.worker.config import EngineConfig
from mxserve.worker.draft_channel import DraftService, recv_frame, send_frame
from mxserve.worker.draft_server import DraftRound, DraftServer

ENGINE = dict(dtype="float32", num_kv_blocks=400, max_num_batched_tokens=64, max_num_seqs=8,
              load_progress=False, num_threads=1)
GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)


def _prompts() -> list[list[int]]:
    """Mixed lengths (some chunked at 64), two sharing a 48-token prefix (a prefix hit on the
    target, and in the replica's own cache)."""
    shared = [(7 * i) % 200 + 3 for i in range(48)]
    return [list(range(3, 23)), shared + [9, 10], list(range(40, 130)), shared + [11, 12, 13],
            [5, 6, 7] * 9]


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def head(ckpt, random_eagle_head):
    return random_eagle_head(ckpt, seed=3)


@pytest.fixture(scope="module")
def plain(ckpt):
    with LLM(ckpt, **ENGINE) as llm:
        return [o.token_ids for o in llm.generate(_prompts(), GREEDY)]


def _spec(head: str, **extra) -> dict:
    return {"method": "eagle", "model": head, "num_speculative_tokens": 3, **extra}


def _server(ckpt: str, head: str, num_blocks: int = 512, run_ahead: bool = False,
            **spec) -> DraftServer:
    return DraftServer(EngineConfig(model=ckpt, dtype="float32", num_threads=1,
                                    speculative_config=_spec(head, run_ahead=run_ahead, **spec)),
                       num_blocks)


class Recorded:
    """Wraps a drafter: every draft it proposes, per request, in order."""

    def __init__(self, inner) -> None:
        self.inner, self.drafts = inner, {}
        self.needs_hidden = inner.needs_hidden
        self.num_lookahead_tokens = inner.num_lookahead_tokens

    def propose(self, plan, hidden, num_drafts) -> None:
        self.inner.propose(plan, hidden, num_drafts)
        for r in num_drafts:
            self.drafts.setdefault(r.request_id, []).append(list(r.draft_token_ids))

    def release(self, request) -> None:
        self.inner.release(request)


def _run(llm: LLM, prompts=None) -> tuple[list[list[int]], dict]:
    engine = llm.engine
    engine.drafter = Recorded(engine.drafter)
    outs = llm.generate(prompts or _prompts(), GREEDY)
    kv = engine.kv
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks
    return [o.token_ids for o in outs], engine.drafter.drafts


@pytest.mark.parametrize("lookup_first", [False, True])
def test_the_replica_drafts_what_the_local_drafter_drafts(ckpt, head, plain, lookup_first):
    """With lookup_first, the requests whose n-gram matches draft by lookup in the worker and
    the replica only catches up on them: the drafts still match the local drafter's."""
    lookup = {"lookup_first": True, "prompt_lookup_min": 1} if lookup_first else {}
    with LLM(ckpt, speculative_config=_spec(head, **lookup), **ENGINE) as llm:
        local_tokens, local = _run(llm)
        if lookup_first:
            assert llm.engine.drafter.inner.num_lookup_drafts > 0
    server = _server(ckpt, head)
    service = DraftService(server)
    try:
        with LLM(ckpt, speculative_config=_spec(head, draft_placement="replica",
                                                draft_address=service.address, **lookup),
                 **ENGINE) as llm:
            tokens, remote = _run(llm)
            drafter = llm.engine.drafter.inner
    finally:
        service.close()
    assert tokens == local_tokens == plain
    assert [remote[k] for k in sorted(remote)] == [local[k] for k in sorted(local)]
    assert sum(len(d) for ds in remote.values() for d in ds) > 100
    assert drafter.num_failures == 0 and drafter.num_rounds > 10
    # every request released as it ended; the shared prefix was a hit in the replica's cache
    assert server.num_requests == 0 and server.kv.num_free_blocks == server.kv.num_blocks
    assert server.num_prefix_hit_blocks >= 3


def test_run_ahead_answers_a_round_that_kept_every_draft_and_the_guess(ckpt, head):
    """DraftServer alone: after a round, run-ahead prepares the next as if the target keeps the
    3 drafts and adds the head's guess; that round is answered from it (and still caught up
    on), a round that differs anywhere is drafted as usual, and no KV block leaks."""
    server = _server(ckpt, head, num_blocks=64, run_ahead=True)
    tokens = [(5 * i) % 200 + 3 for i in range(20)]
    first = server.draft([DraftRound("t/a", 0, tokens, 3)], torch.randn(19, 64), "m")[0]
    assert server.prepared([DraftRound("t/a", 19, [tokens[-1], *first, 7], 3)]) is None
    server.run_ahead(stop=lambda: True)  # a message waiting: it gives up
    assert server.num_ahead == 0 and server._states["t/a"].ahead is None
    server.run_ahead()
    assert server.num_ahead == 1
    guess = server._states["t/a"].ahead.tokens[-1]  # what the head expects the target to add
    kept = DraftRound("t/a", 19, [tokens[-1], *first, guess], 3)
    ready = server.prepared([kept])
    assert ready is not None and len(ready[0]) == 3
    other = DraftRound("t/a", 19, [tokens[-1], *first, (guess + 1) % 256], 3)
    assert server.prepared([other]) is None
    assert server.prepared([DraftRound("t/a", 19, [tokens[-1], *first[:2]], 3)]) is None
    assert server.draft([kept], torch.randn(4, 64), "m") == ready
    assert server.num_ahead_hits == 1
    server.run_ahead()  # from the prepared chain's end: the round after next
    after = DraftRound("t/a", 23, [guess, *ready[0], server._states["t/a"].ahead.tokens[-1]], 3)
    assert server.prepared([after]) is not None
    server.release(["t/a"])
    assert server.kv.num_free_blocks == server.kv.num_blocks


def test_run_ahead_waits_for_a_round_whose_drafts_were_all_kept(ckpt, head):
    """A request whose target rejected a draft of its last round gets no run-ahead; once a
    round keeps every draft, run-ahead prepares its next one again."""
    server = _server(ckpt, head, num_blocks=64, run_ahead=True)
    tokens = [(5 * i) % 200 + 3 for i in range(20)]
    first = server.draft([DraftRound("t/a", 0, tokens, 3)], torch.randn(19, 64), "m")[0]
    assert len(first) == 3
    partial = DraftRound("t/a", 19, [tokens[-1], first[0], (first[1] + 1) % 256], 3)
    second = server.draft([partial], torch.randn(2, 64), "m")[0]
    assert second
    server.run_ahead()
    assert server.num_ahead == 0 and server._states["t/a"].ahead is None
    full = DraftRound("t/a", 21, [partial.tokens[-1], *second, 9], 3)
    server.draft([full], torch.randn(len(second) + 1, 64), "m")
    server.run_ahead()
    assert server.num_ahead == 1 and server._states["t/a"].ahead is not None
    server.release(["t/a"])
    assert server.kv.num_free_blocks == server.kv.num_blocks


def test_a_replica_running_ahead_keeps_outputs_and_answers_rounds_from_it():
    """SmolLM2 and its shipped head (bf16, the default CPU engine) through an in-process
    replica over loopback: greedy outputs equal plain decoding, and some rounds (those whose
    drafts were all kept and whose next token the head guessed) are answered from run-ahead."""
    questions = [[{"role": "user", "content": q}] for q in
                 ("Name three uses of copper.", "Write the numbers from one to twenty.")]
    params = SamplingParams(temperature=0, max_tokens=48)
    with LLM(load_progress=False, num_threads=1) as llm:
        want = [llm.chat([q], params)[0].token_ids for q in questions]
    spec = {"method": "eagle", "num_speculative_tokens": 3}
    server = DraftServer(EngineConfig(num_threads=1, speculative_config=spec))
    service = DraftService(server)
    try:
        with LLM(load_progress=False, num_threads=1, speculative_config={
                **spec, "draft_placement": "replica", "draft_address": service.address}) as llm:
            assert [llm.chat([q], params)[0].token_ids for q in questions] == want
            assert llm.engine.drafter.num_failures == 0
    finally:
        service.close()
    assert server.num_ahead > 10 and server.num_ahead_hits > 0


def test_a_first_round_after_a_prefix_hit_reuses_the_replicas_blocks(ckpt, head):
    """DraftServer alone: a request starting at 48 (the target's prefix hit) with the prefix's
    hashes gets the blocks another request computed; without them (a replica that never saw
    the prefix) it drafts from zeros there, and the next round continues."""
    from mxserve.api.block_hash import extend_block_hashes

    # (no confidence floor: every round drafts all it asks for, whatever the random features)
    server = _server(ckpt, head, num_blocks=64, min_draft_confidence=0.0)
    model_id, bs = "m", server.block_size
    tokens = [(5 * i) % 200 + 3 for i in range(52)]
    feats = torch.randn(52, server.hidden_size, generator=torch.Generator().manual_seed(0))
    first = server.draft([DraftRound("t/a", 0, tokens[:51], 3)], feats[:50], model_id)
    assert len(first[0]) == 3
    hashes: list[int] = []
    extend_block_hashes(hashes, tokens, bs, model_id)
    hit = DraftRound("t/b", 48, tokens[48:51], 2, prefix=hashes[:3])
    server.draft([hit], feats[48:50], model_id)
    assert server.kv.get_block_ids("t/b")[:3] == server.kv.get_block_ids("t/a")[:3]
    blind = DraftRound("t/c", 48, tokens[48:51], 2)  # no prefix hashes
    assert len(server.draft([blind], feats[48:50], model_id)[0]) == 2
    assert server.kv.get_block_ids("t/c")[0] not in server.kv.get_block_ids("t/a")
    server.release(["t/a", "t/b", "t/c"])
    assert server.kv.num_free_blocks == server.kv.num_blocks and server.num_requests == 0
    with pytest.raises(ValueError, match="features must be"):
        server.draft([DraftRound("t/d", 0, tokens[:5], 1)], feats[:3], model_id)


def test_a_full_pool_evicts_the_least_recently_used_request(ckpt, head):
    server = _server(ckpt, head, num_blocks=8)
    feats = torch.randn(40, server.hidden_size)
    for i in range(4):  # 3 blocks each: the fourth evicts the first
        server.draft([DraftRound(f"t/{i}", 0, list(range(3, 44)), 2)], feats, "m")
    assert server.num_evicted >= 1 and "t/0" not in server._states and "t/3" in server._states
    server.kv.check_integrity()


def _start_process(ckpt: str, head: str, port: int = 0) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "mxserve.cluster.cli", "draft-server", "--model", ckpt,
         "--dtype", "float32", "--speculative-config", json.dumps(_spec(head)),
         "--port", str(port)], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    line = proc.stdout.readline()
    assert line.startswith("draft server listening on "), line
    return proc, line.split()[-1]


class _Address:
    def __init__(self, address: str | None) -> None:
        self.value = address

    def __call__(self) -> str | None:
        return self.value


def test_a_killed_or_stalled_replica_degrades_to_plain_decoding_and_recovers(ckpt, head, plain):
    """A separate `mxserve draft-server` process: killed mid-run, every request completes with
    plain decoding's tokens and the drafter counts the fallback; a new replica (another port)
    brings speculation back; one stopped (SIGSTOP) past the deadline is a fallback too."""
    proc, address = _start_process(ckpt, head)
    where = _Address(address)
    try:
        llm = LLM(ckpt, speculative_config=_spec(head, draft_placement="replica",
                                                 draft_timeout_s=0.3, lookup_first=False),
                  **ENGINE)
        engine = llm.engine
        drafter = engine.drafter = type(engine.drafter)(where, "target-a",
                                                        engine.model_config.model_id,
                                                        engine.kv.block_size, 0.3, 0.2)
        ids = [engine.add_request(p, GREEDY) for p in _prompts()]
        got: dict[str, list[int]] = {}

        def steps(n: int) -> None:
            for _ in range(n):
                for out in engine.step():
                    got.setdefault(out.request_id, []).extend(out.new_token_ids)

        steps(6)
        assert drafter.num_rounds >= 4 and drafter.num_failures == 0
        proc.kill()
        proc.wait()
        steps(4)
        assert drafter.num_failures >= 1 and drafter.num_fallback_steps >= 1
        proc, where.value = _start_process(ckpt, head)
        time.sleep(0.25)  # past retry_after_s
        rounds = drafter.num_rounds
        steps(3)
        assert drafter.num_rounds > rounds  # speculation resumed on the new replica
        os.kill(proc.pid, signal.SIGSTOP)  # stalled: alive, never answering
        failures = drafter.num_failures
        t0 = time.monotonic()
        steps(2)
        assert drafter.num_failures == failures + 1 and time.monotonic() - t0 < 5
        os.kill(proc.pid, signal.SIGCONT)
        time.sleep(0.25)
        rounds = drafter.num_rounds
        while engine.has_unfinished_requests():
            steps(1)
        assert drafter.num_rounds > rounds
        assert [got[i] for i in ids] == plain
        kv = engine.kv
        kv.check_integrity()
        assert kv.num_free_blocks == kv.num_blocks
    finally:
        proc.kill()
        proc.wait()


def test_two_targets_share_one_replica(ckpt, head, plain):
    """Two target engines stepping on their own threads against one replica process: both
    get plain decoding's tokens; their requests are apart in it (keys by target)."""
    proc, address = _start_process(ckpt, head)
    try:
        outs = {}

        def target(name: str) -> None:
            with LLM(ckpt, speculative_config=_spec(head, draft_placement="replica",
                                                    draft_address=address), **ENGINE) as llm:
                outs[name] = ([o.token_ids for o in llm.generate(_prompts(), GREEDY)],
                              llm.engine.drafter.num_rounds, llm.engine.drafter.num_failures)

        threads = [threading.Thread(target=target, args=(n,)) for n in "ab"]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        for name in "ab":
            tokens, rounds, failures = outs[name]
            assert tokens == plain and rounds > 10 and failures == 0
    finally:
        proc.kill()
        proc.wait()


def test_bad_messages_get_an_error_and_the_connection_keeps_working(ckpt, head):
    service = DraftService(_server(ckpt, head, num_blocks=32))
    try:
        host, port = service.address.split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            send_frame(sock, {"rounds": [{"key": "x", "start": 0}]})  # no tokens, no hidden
            answer, _ = recv_frame(sock)
            assert "bad draft request" in answer["error"]
            hidden = service.server.hidden_size
            feats = torch.randn(4, hidden + 1)  # the wrong feature size
            send_frame(sock, {"model_id": "m", "dtype": "float32", "hidden": hidden + 1,
                              "rounds": [{"key": "x", "start": 0, "tokens": [3, 4, 5, 6, 7],
                                          "n": 2}]}, feats.numpy().tobytes())
            answer, _ = recv_frame(sock)
            assert "features must be" in answer["error"]
            feats = torch.randn(4, hidden)
            send_frame(sock, {"model_id": "m", "dtype": "float32", "hidden": hidden,
                              "rounds": [{"key": "y", "start": 0, "tokens": [3, 4, 5, 6, 7],
                                          "n": 2}]}, feats.numpy().tobytes())
            answer, _ = recv_frame(sock)
            assert len(answer["drafts"][0]) == 2
    finally:
        service.close()


def test_bad_placement_configs_name_the_field(ckpt):
    with pytest.raises(ValueError, match="draft_placement"):
        LLM(ckpt, speculative_config={"method": "ngram", "draft_placement": "replica"},
            **ENGINE)
    with pytest.raises(ValueError, match="draft_placement"):
        LLM(ckpt, speculative_config={"method": "eagle", "draft_placement": "far"}, **ENGINE)
    with pytest.raises(ValueError, match="draft_address"):
        LLM(ckpt, speculative_config={"method": "eagle", "draft_placement": "replica",
                                      "draft_address": "nowhere"}, **ENGINE)


def test_the_draft_autoscaling_policy_follows_the_replicas_busy_time():
    """cluster/autoscaling.DraftLoadPolicy on Serve's context fields: enough replicas for the
    summed busy fraction at target_busy (Serve applies the delays and bounds around it); no
    decision while the replicas start."""
    from types import SimpleNamespace

    from mxserve.cluster.autoscaling import DraftLoadPolicy

    policy = DraftLoadPolicy(target_busy=0.5)

    def ask(busy: list[float], running: int = 2, target: int = 2) -> int:
        ctx = SimpleNamespace(aggregated_metrics={"draft_busy": dict(enumerate(busy))},
                              current_num_replicas=running, target_num_replicas=target)
        return policy(ctx)[0]

    assert ask([0.4]) == 1
    assert ask([0.9]) == 2
    assert ask([0.9, 0.8]) == 4
    assert ask([0.5, 0.5]) == 2
    assert ask([0.1, 0.1, 0.0, 0.0]) == 1
    assert ask([], target=3) == 3  # no reports yet: no decision
    assert ask([0.1], running=0, target=2) == 2  # starting
    with pytest.raises(ValueError, match="target_busy"):
        DraftLoadPolicy(target_busy=0)
