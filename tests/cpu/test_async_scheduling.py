"""Async scheduling (engine.py): step N + 1 is scheduled and launched before step N completes,
with the token N sampled fed to N + 1 on the device. On the CPU nothing overlaps, but every
rule is the same as on the GPU: these runs must give exactly what the synchronous engine gives
(float32, so equal arithmetic means equal tokens), drop the extra token of a request that
stopped, and free every KV block."""

from __future__ import annotations

import asyncio

import pytest
from test_engine import _prompts

from mxserve import LLM, SamplingParams
from mxserve.worker.async_engine import AsyncEngine


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


def _llm(ckpt: str, async_scheduling: bool, **options) -> LLM:
    return LLM(model=ckpt, dtype="float32", async_scheduling=async_scheduling,
               load_progress=False, **options)


def _all_blocks_free(llm: LLM) -> bool:
    kv = llm.engine.kv
    kv.check_integrity()
    return kv.num_free_blocks == kv.num_blocks and not llm.engine.requests


def _record_plans(llm: LLM) -> list:
    """The plans the runner executes, from now on."""
    plans, execute = [], llm.engine.runner.execute

    def recording(plan):
        plans.append(plan)
        return execute(plan)

    llm.engine.runner.execute = recording
    return plans


def _mixed_params(free_run: list[int]) -> list[SamplingParams]:
    """One of each way a request can sample and stop."""
    greedy = dict(temperature=0, ignore_eos=True)
    return [
        SamplingParams(max_tokens=20, **greedy),
        SamplingParams(max_tokens=1, **greedy),
        SamplingParams(max_tokens=2, **greedy),
        SamplingParams(max_tokens=20, stop_token_ids=[free_run[6]], **greedy),
        SamplingParams(max_tokens=12, logprobs=3, **greedy),
        SamplingParams(temperature=0.9, top_k=40, seed=11, max_tokens=15, ignore_eos=True),
        SamplingParams(temperature=0.7, min_p=0.05, seed=5, max_tokens=9, ignore_eos=True),
        SamplingParams(max_tokens=14, repetition_penalty=1.3, frequency_penalty=0.2, **greedy),
        SamplingParams(max_tokens=10, min_tokens=6, **greedy),  # its stop id: set by the test
        SamplingParams(max_tokens=18, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True),
    ]


def test_async_gives_the_synchronous_outputs_for_every_kind_of_request(ckpt):
    sync = _llm(ckpt, False, max_num_batched_tokens=48)
    free_run = sync.generate([_prompts(1, (9,), seed=4)[0]],
                             SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    prompts = _prompts(10, seed=4)
    prompts[3] = prompts[8] = _prompts(1, (9,), seed=4)[0]  # the free run's prompt: its stops
    params = _mixed_params(free_run.token_ids)
    # min_tokens = 6 with a stop id that comes exactly as the 7th output: one output miscounted
    # (the token in flight) would ban it once more and change the run.
    held = sync.generate([prompts[8]], SamplingParams(temperature=0, max_tokens=10, min_tokens=6,
                                                      ignore_eos=True))[0].token_ids
    assert held[6] not in held[:6]
    params[8] = SamplingParams(temperature=0, max_tokens=10, min_tokens=6, ignore_eos=True,
                               stop_token_ids=[held[6]])
    want = sync.generate(prompts, params)
    assert want[3].finish_reason == "stop" and len(want[3].token_ids) == 7
    assert want[8].finish_reason == "stop" and want[8].token_ids == held[:7]

    llm = _llm(ckpt, True, max_num_batched_tokens=48)  # 48: the long prompts take 2 chunks
    plans = _record_plans(llm)
    got = llm.generate(prompts, params)
    for g, w in zip(got, want, strict=True):
        assert (g.token_ids, g.finish_reason, g.text) == (w.token_ids, w.finish_reason, w.text)
        assert g.logprobs == w.logprobs
    assert [len(o.token_ids) for o in got[:3]] == [20, 1, 2]
    # The mechanism ran: every decode after a request's first computed a token the host had not
    # seen yet, from the device (penalties and min_tokens too: they count it there).
    fed = [s for p in plans for s in p.scheduled if s.inflight_row >= 0]
    decodes = sum(len(o.token_ids) for o in got) - len(got)
    assert len(fed) >= decodes and all(p.inflight_tokens is not None for p in plans
                                       if any(s.inflight_row >= 0 for s in p.scheduled))
    penalized = [s for p in plans for s in p.scheduled if s.request.sampling_params is params[7]]
    assert sum(s.inflight_row >= 0 for s in penalized) == len(got[7].token_ids) - 1
    assert _all_blocks_free(llm)


def test_a_request_ended_by_its_token_in_flight_gets_no_extra_token(ckpt):
    llm = _llm(ckpt, True)
    prompt = [7, 8, 9]
    free_run = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16,
                                                     ignore_eos=True))[0].token_ids
    stop_id = free_run[4]
    engine = llm.engine
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                    stop_token_ids=[stop_id]))
    plans = _record_plans(llm)
    tokens, calls = [], 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        calls += 1
        tokens += [t for o in outs if o.request_id == rid for t in o.new_token_ids]
    end = free_run.index(stop_id) + 1
    assert tokens == free_run[:end]
    # Each call launched one step and completed the one before: the step launched while the
    # stop token was in flight computed one token too many, which was dropped.
    assert len(plans) == end + 1 and calls == end + 2
    assert _all_blocks_free(llm)


def test_preemption_with_tokens_in_flight_keeps_tokens_and_frees_blocks(ckpt):
    prompts = _prompts(8)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    roomy = _llm(ckpt, False).generate(prompts, params)
    # 12 blocks of 16 tokens cannot hold 8 requests of up to 84 tokens at once.
    tight = _llm(ckpt, True, num_kv_blocks=12, max_num_batched_tokens=64)
    outputs = tight.generate(prompts, params)
    assert sum(r.num_preemptions for r in tight.engine.finished_requests) > 0
    assert [o.token_ids for o in outputs] == [o.token_ids for o in roomy]
    assert _all_blocks_free(tight)


def test_prefix_cache_hits_under_async_scheduling_give_the_same_tokens(ckpt):
    shared = _prompts(1, (64,))[0]
    prompts = [shared + tail for tail in _prompts(3, (7, 12, 20), seed=5)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    cold = _llm(ckpt, False, enable_prefix_caching=False).generate(prompts, params)
    llm = _llm(ckpt, True)
    llm.generate(prompts[:1], params)
    warm = llm.generate(prompts, params)
    assert all(o.num_cached_tokens >= 64 for o in warm)
    assert [o.token_ids for o in warm] == [o.token_ids for o in cold]
    # The blocks a request's decode filled were registered too: its whole prompt + output hits.
    again = llm.generate([prompts[0] + warm[0].token_ids[:-1]], params)[0]
    assert again.num_cached_tokens == (len(prompts[0]) + 23 - 1) // 16 * 16
    assert _all_blocks_free(llm)


def test_abort_and_cancel_with_a_step_in_flight_free_every_block(ckpt):
    llm = _llm(ckpt, True)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in _prompts(4)]
    for _ in range(6):
        engine.step()
    assert engine._inflight is not None
    out = engine.abort(ids[1])
    assert out.finished and out.finish_reason == "abort"
    seen = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            seen.setdefault(o.request_id, []).append(o)
    assert ids[1] not in seen  # its token in flight was dropped
    assert all(seen[i][-1].num_output_tokens == 40 for i in (ids[0], ids[2], ids[3]))
    assert _all_blocks_free(llm)

    async def cancel_mid_stream():
        aengine = AsyncEngine(engine)
        aengine.start()
        try:
            stream = aengine.generate(_prompts(1, (30,))[0], params)
            got = 0
            async for out in stream:
                got += len(out.new_token_ids)
                if got >= 5:
                    break
            await stream.aclose()
            for _ in range(100):
                if not engine.has_unfinished_requests():
                    break
                await asyncio.sleep(0.05)
        finally:
            aengine.shutdown()

    asyncio.run(cancel_mid_stream())
    assert _all_blocks_free(llm)


def test_async_scheduling_is_on_for_cuda_only_by_default(ckpt):
    assert _llm(ckpt, None).engine.async_scheduling is False  # CPU: no device to overlap
    assert _llm(ckpt, True).engine.async_scheduling is True


def test_a_failing_step_fails_its_streams_and_the_engine_serves_on(ckpt):
    """A step that raises (a device error, a bug) with another step in flight: every stream gets
    the error, no block stays held, and the next request is served normally."""
    llm = _llm(ckpt, True)
    engine = llm.engine
    execute, calls = engine.runner.execute, [0]

    def flaky(plan):
        # the second step that runs all three (the first is then in flight): counted on those,
        # not on every call, since the engine thread may start the first request before the
        # event loop hands it the others (a clean-clone CI run failed on call 5 that way)
        if len(plan.scheduled) == 3:
            calls[0] += 1
            if calls[0] == 2:
                raise RuntimeError("device fell over")
        return execute(plan)

    engine.runner.execute = flaky
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def run():
        aengine = AsyncEngine(engine)
        try:
            async def consume(prompt):
                tokens = []
                try:
                    async for out in aengine.generate(prompt, params):
                        tokens += out.new_token_ids
                except RuntimeError as e:
                    return e
                return tokens

            # the three are queued before the engine thread starts, so they run together: in a
            # fresh clone the thread once ran them one after another (the step that raises never
            # came), the event loop starved while the first request's steps ran
            streams = [asyncio.create_task(consume(p)) for p in _prompts(3)]
            await asyncio.sleep(0)  # each task queues its request and waits for outputs
            aengine.start()
            first = await asyncio.gather(*streams)
            after = await consume([7, 8, 9])
            return first, after
        finally:
            aengine.shutdown()

    first, after = asyncio.run(asyncio.wait_for(run(), 120))
    assert all(isinstance(r, RuntimeError) and "device fell over" in str(r) for r in first), first
    want = _llm(ckpt, False).generate([[7, 8, 9]], params)[0].token_ids
    assert after == want
    assert _all_blocks_free(llm) and engine._inflight is None
