"""The scheduler alone: token budget, decode-first order, chunked prefill, prefix hits, admission
limits and the preemption choice. No model: a step is simulated as the engine completes it
(computed tokens advance; a step that reaches the last known token appends one output token)."""

from __future__ import annotations

from mxserve.api.block_hash import block_hashes
from mxserve.api.sampling_params import SamplingParams
from mxserve.worker.kv_cache import KVCacheManager
from mxserve.worker.request import Request, RequestStatus
from mxserve.worker.scheduler import Scheduler, StepPlan

BLOCK = 4


def make(rid: str, num_prompt: int, first: int = 0, max_tokens: int = 64) -> Request:
    ids = list(range(first, first + num_prompt))
    request = Request(rid, ids, SamplingParams(max_tokens=max_tokens))
    request.block_hashes = block_hashes(ids, BLOCK, "m")
    return request


def scheduler(num_blocks: int = 64, max_num_seqs: int = 8, budget: int = 16) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, BLOCK), max_num_seqs, budget)


def complete(sched: Scheduler, plan: StepPlan, token: int = 7) -> None:
    """What the engine does after the runner: KV written, one new token where a step sampled,
    full blocks registered in the prefix cache."""
    for s in plan.scheduled:
        r = s.request
        r.num_computed_tokens += s.num_new_tokens
        if s.samples:
            r.append_output(token)
            r.block_hashes = block_hashes(r.all_token_ids, BLOCK, "m")
        sched.kv.cache_blocks(r.request_id, r.block_hashes, r.num_computed_tokens)
    sched.kv.check_integrity()


def counts(plan: StepPlan) -> dict[str, int]:
    return {s.request.request_id: s.num_new_tokens for s in plan.scheduled}


def test_budget_caps_the_step_and_chunks_the_prompt_that_does_not_fit():
    sched = scheduler(budget=16)
    for rid in "abc":
        sched.add(make(rid, 10, first=100 * ord(rid)))
    plan = sched.schedule()
    assert counts(plan) == {"a": 10, "b": 6} and plan.num_tokens == 16
    assert [s.samples for s in plan.scheduled] == [True, False]  # b's chunk yields no token
    assert [r.request_id for r in sched.waiting] == ["c"]


def test_chunked_prefill_continues_where_it_stopped():
    sched = scheduler(budget=16)
    sched.add(make("long", 40))
    steps = []
    while not sched.running or sched.running[0].is_prefill:
        plan = sched.schedule()
        s = plan.scheduled[0]
        steps.append((s.start_position, s.num_new_tokens, s.samples))
        assert s.token_ids == s.request.all_token_ids[s.start_position:][:s.num_new_tokens]
        complete(sched, plan)
    assert steps == [(0, 16, False), (16, 16, False), (32, 8, True)]
    assert sched.running[0].output_token_ids == [7]


def test_decodes_go_first_and_a_long_prefill_gets_what_is_left():
    sched = scheduler(budget=16)
    for rid in ("d1", "d2"):
        sched.add(make(rid, 3, first=10 * len(rid) + ord(rid[-1])))
    complete(sched, sched.schedule())  # both prefilled; each now decodes one token a step
    sched.add(make("p", 50, first=500))
    plan = sched.schedule()
    assert counts(plan) == {"d1": 1, "d2": 1, "p": 14}
    assert plan.num_decodes == 2 and [s.num_new_tokens for s in plan.scheduled[:2]] == [1, 1]
    complete(sched, plan)
    plan = sched.schedule()  # p is running but still in prefill: it stays behind the decodes
    assert list(counts(plan)) == ["d1", "d2", "p"] and counts(plan)["p"] == 14


def test_max_num_seqs_limits_admission():
    sched = scheduler(max_num_seqs=2, budget=64)
    for rid in "abc":
        sched.add(make(rid, 4, first=10 * ord(rid)))
    assert list(counts(sched.schedule())) == ["a", "b"]
    assert [r.request_id for r in sched.waiting] == ["c"]


def test_a_prefix_hit_starts_at_the_cached_blocks_and_computes_at_least_one_token():
    sched = scheduler(budget=64)
    first = make("first", 12)
    sched.add(first)
    complete(sched, sched.schedule())
    sched.finish(first)  # its 3 full blocks stay cached (free, evictable)
    same = make("same", 12)  # all 12 tokens cached: it reuses 2 blocks and computes the last 4
    longer = make("longer", 14)  # 3 blocks cached, 2 more tokens
    sched.add(same)
    sched.add(longer)
    plan = sched.schedule()
    assert counts(plan) == {"same": 4, "longer": 2}
    assert same.num_computed_tokens == 8 and same.num_cached_tokens == 8
    assert longer.num_cached_tokens == 12


def test_no_free_block_preempts_the_latest_admitted_request():
    sched = scheduler(num_blocks=4, budget=64)  # 16 token slots
    old, new = make("old", 8, first=0), make("new", 8, first=100)
    sched.add(old)
    sched.add(new)
    complete(sched, sched.schedule())  # 8 computed + 1 sampled each: 2 blocks each, none left
    assert sched.kv.num_free_blocks == 0
    plan = sched.schedule()  # each needs a third block for its 9th token
    assert counts(plan) == {"old": 1}
    assert plan.preempted == [new] and new.status is RequestStatus.WAITING
    assert new.num_computed_tokens == 0 and new.num_preemptions == 1
    assert sched.num_preemptions == 1  # the worker's load report and metrics count these
    assert sched.waiting[0] is new and sched.running == [old]
    assert not sched.kv.get_block_ids("new")
    complete(sched, plan)
    sched.finish(old)
    plan = sched.schedule()  # readmitted: what its cached blocks do not hold is recomputed
    assert new.num_computed_tokens % BLOCK == 0 and new.num_computed_tokens < new.num_tokens
    assert counts(plan) == {"new": new.num_tokens - new.num_computed_tokens}
    assert new.num_cached_tokens == 0  # counted at its first admission only
