"""Engine behaviour on a tiny random Llama: prefix caching, preemption, aborts, streaming, stops."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from mxserve import LLM, InvalidRequestError, SamplingParams
from mxserve.worker.async_engine import AsyncEngine
from mxserve.worker.config import EngineConfig

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


def _prompts(n: int, lengths=(5, 19, 33, 47, 60), seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (lengths[i % len(lengths)],), generator=gen).tolist()
            for i in range(n)]


def _all_blocks_free(llm: LLM) -> bool:
    kv = llm.engine.kv
    kv.check_integrity()
    return kv.num_free_blocks == kv.num_blocks and not llm.engine.requests


def test_prefix_cache_hit_gives_same_tokens_as_miss(ckpt):
    shared = _prompts(1, (64,))[0]
    prompts = [shared + tail for tail in _prompts(3, (7, 12, 20), seed=5)]
    cold_llm = LLM(model=ckpt, enable_prefix_caching=False, load_progress=False)
    cold = cold_llm.generate(prompts, GREEDY)
    llm = LLM(model=ckpt, load_progress=False)
    first = llm.generate(prompts[:1], GREEDY)[0]
    warm = llm.generate(prompts, GREEDY)
    assert first.num_cached_tokens == 0
    assert all(o.num_cached_tokens >= 64 for o in warm)  # the shared 4 blocks were reused
    assert [o.token_ids for o in warm] == [o.token_ids for o in cold]
    # A fully cached prompt still computes its last block and gives the same answer.
    again = llm.generate(prompts[:1], GREEDY)[0]
    assert again.token_ids == first.token_ids and again.num_cached_tokens == 64
    assert _all_blocks_free(llm)


# Recomputing a preempted request runs its tokens as one prefill instead of one decode each, so
# the arithmetic differs in the last bits (GEMM blocking by row count; CPUAttention's C decode vs
# SDPA). In float32 that leaves greedy tokens unchanged: they must match exactly. In bfloat16 each
# activation rounding can magnify it to ~1e-2 in the logits, and this tiny random model's logits
# are nearly flat: a request may part from the roomy run, but only where the roomy run's top two
# candidates were within BF16_TIE of each other, and most must not part at all.
BF16_TIE = 0.05


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_preemption_under_tiny_pool_finishes_every_request_with_same_tokens(ckpt, backend,
                                                                            dtype):
    prompts = _prompts(8)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    opts = dict(attention_backend=backend, dtype=dtype, load_progress=False)
    roomy = LLM(model=ckpt, **opts).generate(prompts, params)
    # 12 blocks of 16 tokens cannot hold 8 requests of up to 84 tokens at once.
    tight = LLM(model=ckpt, num_kv_blocks=12, max_num_batched_tokens=64, **opts)
    outputs = tight.generate(prompts, params)
    assert sum(r.num_preemptions for r in _seen_requests(tight)) > 0
    assert all(len(o.token_ids) == params.max_tokens for o in outputs)
    if dtype == "float32":
        assert [o.token_ids for o in outputs] == [o.token_ids for o in roomy]
    exact = 0
    for got, want in zip(outputs, roomy):
        if got.token_ids == want.token_ids:
            exact += 1
            continue
        j = next(i for i, (a, b) in enumerate(zip(got.token_ids, want.token_ids)) if a != b)
        top = want.logprobs[j]  # the roomy run's two best at the parting step
        assert got.token_ids[j] in top and top[want.token_ids[j]] - top[got.token_ids[j]] < BF16_TIE
    assert exact > len(prompts) // 2
    assert _all_blocks_free(tight)


def _seen_requests(llm: LLM):
    return llm.engine.finished_requests


def test_bad_inputs_raise_named_errors_and_engine_keeps_serving(ckpt):
    llm = LLM(model=ckpt, max_model_len=128, load_progress=False)
    bad = [
        ([], SamplingParams(), "prompt"),
        ([5] * 128, SamplingParams(), "prompt"),
        ([5, 999], SamplingParams(), "prompt_token_ids"),
    ]
    for prompt, params, field in bad:
        with pytest.raises(InvalidRequestError) as e:
            llm.generate([prompt], params)
        assert e.value.field == field
    for kwargs, field in [(dict(max_tokens=0), "max_tokens"), (dict(temperature=-1), "temperature"),
                          (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"),
                          (dict(stop=7), "stop")]:
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(**kwargs)
        assert e.value.field == field
    # A batch with one bad prompt is rejected whole, before anything runs.
    with pytest.raises(InvalidRequestError):
        llm.generate([[5, 6, 7], []], GREEDY)
    assert _all_blocks_free(llm)
    out = llm.generate([[5, 6, 7]], GREEDY)[0]
    assert len(out.token_ids) == 24


def test_length_stop_and_stop_token_ids(ckpt):
    llm = LLM(model=ckpt, max_model_len=40, load_progress=False)
    out = llm.generate([_prompts(1, (30,))[0]], SamplingParams(temperature=0, max_tokens=100,
                                                               ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 10  # 30 + 10 = context
    free_run = llm.generate([[7, 8, 9]], GREEDY)[0].token_ids
    stop_id = free_run[5]
    out = llm.generate([[7, 8, 9]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                   stop_token_ids=[stop_id]))[0]
    assert out.finish_reason == "stop" and out.token_ids == free_run[:free_run.index(stop_id) + 1]


def test_stop_string_cuts_text(ckpt):
    llm = LLM(model=ckpt, load_progress=False)
    full = llm.generate([[7, 8, 9]], GREEDY)[0]
    words = full.text.split()
    assert len(words) > 6
    stop = " ".join(words[3:5])
    out = llm.generate([[7, 8, 9]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                   stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[:full.text.index(stop)]
    kept = llm.generate([[7, 8, 9]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                    stop=stop, include_stop_str_in_output=True))[0]
    assert kept.text == full.text[:full.text.index(stop) + len(stop)]


def test_seeded_sampling_is_reproducible_and_batch_independent(ckpt):
    llm = LLM(model=ckpt, load_progress=False)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=123, max_tokens=16, ignore_eos=True)
    alone = llm.generate([[4, 5, 6]], params)[0].token_ids
    batched = llm.generate([[9, 9, 9, 9], [4, 5, 6], [10, 11]], [GREEDY, params, params])
    assert batched[1].token_ids == alone
    other = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
    assert llm.generate([[4, 5, 6]], other)[0].token_ids != alone


def test_async_stream_merges_what_a_slow_consumer_has_not_taken(ckpt):
    """A consumer that falls behind gets the outputs that piled up as one: the same tokens,
    text and logprobs, fewer messages, the final state on the last."""
    llm = LLM(model=ckpt, load_progress=False)
    prompt = _prompts(1, (40,))[0]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    expected = llm.generate([prompt], params)[0]
    engine = AsyncEngine(llm.engine)
    engine.start()

    async def slow_consumer():
        outs = []
        async for out in engine.generate(prompt, params):
            outs.append(out)
            if len(outs) == 1:
                await asyncio.sleep(0.5)  # the engine steps on meanwhile
        return outs

    try:
        outs = asyncio.run(slow_consumer())
    finally:
        engine.shutdown()
    assert [t for o in outs for t in o.new_token_ids] == expected.token_ids
    assert [lp for o in outs for lp in o.new_logprobs] == expected.logprobs
    assert len(outs) < len(expected.token_ids)  # some were merged
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 24
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_loop_stats_count_every_step_with_its_hand_over_inside(ckpt):
    """The loop thread's counters (bench/serve_gpu.py reads them through Worker.audit): each
    step counted, the hand-over of its outputs timed inside the step's own time; and
    cluster/logs.thread_cpu_s finds the loop thread by name, its CPU at least what the loop
    counted (less /proc's tick)."""
    from mxserve.cluster.logs import thread_cpu_s

    llm = LLM(model=ckpt, load_progress=False)
    prompt = _prompts(1, (40,))[0]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    engine = AsyncEngine(llm.engine)
    engine.start()

    async def consume() -> list:
        return [out async for out in engine.generate(prompt, params)]

    try:
        outs = asyncio.run(consume())
        stats, threads = engine.loop_stats(), thread_cpu_s()
    finally:
        engine.shutdown()
    assert sum(len(o.new_token_ids) for o in outs) == 16
    assert stats["num_steps"] >= 16  # a prefill, then a step a token
    assert 0 < stats["deliver_wall_s"] < stats["step_wall_s"]
    assert 0 < stats["deliver_cpu_s"] < stats["step_cpu_s"]
    assert stats["step_cpu_s"] <= threads["mxserve-engine"] + 0.02, threads


def test_num_ending_counts_last_outputs_not_yet_taken_and_none_leak_when_streams_close(ckpt):
    """`num_ending` (what a Worker at its limit admits against): a stream whose last output the
    engine thread handed on and its consumer has not taken counts, one that took it does not;
    60 streams closed around their last token (before it, or after it came and before it was
    taken, at random) leave none counted and every block free."""
    import random

    llm = LLM(model=ckpt, load_progress=False)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine = AsyncEngine(llm.engine)
    engine.start()
    rng = random.Random(0)

    async def main():
        stream = engine.generate([5, 6, 7], params)
        outs = [await anext(stream)]
        while sum(len(o.new_token_ids) for o in outs) < 4:
            await asyncio.sleep(0.05)  # not taking: the last output waits in the stream
            if engine.num_ending:
                break
        waiting = engine.num_ending
        outs += [o async for o in stream]
        taken = engine.num_ending

        async def close_around_the_end(i: int) -> None:
            gen = engine.generate([3 + i % 50, 4, 5], params)
            seen = 0
            async for out in gen:
                seen += len(out.new_token_ids)
                if seen >= 3:
                    break
            await asyncio.sleep(rng.uniform(0, 0.004))
            await gen.aclose()

        await asyncio.gather(*(close_around_the_end(i) for i in range(60)))
        await asyncio.sleep(0.1)
        return waiting, taken, engine.num_ending, engine.num_streams

    try:
        waiting, taken, left, streams = asyncio.run(main())
    finally:
        engine.shutdown()
    assert (waiting, taken, left, streams) == (1, 0, 0, 0)
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


@pytest.mark.parametrize("due", [1, 3])
def test_a_stream_hands_over_every_output_once_in_order_across_threads(due):
    """The hand-over between the engine's thread and a stream's consumer, raced: a thread puts
    one-token outputs as fast as it can (waking as _deliver_all does, due tokens a wake-up)
    while the consumer takes on its event loop, yielding between takes; one long stream, then
    300 short ones (each a chance for the last output to land just after a take). Every token
    arrives once, in order; the last output always wakes the consumer (a stranded one times
    out); with due 3 no message but the first and the last carries fewer than 3 tokens."""
    from mxserve.api.outputs import StepOutput, merge_outputs
    from mxserve.worker.async_engine import _Stream

    async def one_stream(n: int, pause_every: int) -> list[list[int]]:
        loop = asyncio.get_running_loop()
        stream = _Stream(loop)

        def produce() -> None:
            for i in range(n):
                last = i == n - 1
                out = StepOutput("r", [i], None, last, "length" if last else None, 1, 0, i + 1)
                if stream.put(out, 1, None if last else due):
                    loop.call_soon_threadsafe(stream.ready.set)
                if i % pause_every == pause_every - 1:
                    time.sleep(0.0002)  # the engine's step: the consumer catches up

        producer = threading.Thread(target=produce)
        producer.start()
        messages, finished = [], False
        while not finished:
            await asyncio.wait_for(stream.ready.wait(), 5)  # a lost wake-up fails here
            stream.ready.clear()
            items = stream.take()
            if not items:
                continue
            item = merge_outputs(items)
            messages.append(item.new_token_ids)
            finished = item.finished
            await asyncio.sleep(0)
        producer.join()
        return messages

    async def main() -> list[list[list[int]]]:
        return [await one_stream(4000, 97)] + [await one_stream(5 + i % 7, 2 + i % 3)
                                                for i in range(300)]

    runs = asyncio.run(main())
    for messages in runs:
        assert [t for m in messages for t in m] == list(range(len(
            [t for m in messages for t in m])))
        assert all(len(m) >= due for m in messages[1:-1])
    assert sum(len(m) for m in runs[0]) == 4000 and len(runs[0]) > 10  # it did interleave
    assert [sum(len(m) for m in r) for r in runs[1:]] == [5 + i % 7 for i in range(300)]


def test_a_stream_closed_then_reopened_under_its_id_gets_only_its_own_outputs(ckpt):
    """A router re-issues a request under its id on the worker it just left (a lost stream,
    round robin). The old stream's request is aborted on the engine's thread; should the new
    stream open between that abort and the next step, the old request's last output must not
    end the new one. The engine's abort is held until the new stream is open, so the race is
    forced every run."""
    llm = LLM(model=ckpt, load_progress=False)
    prompt = _prompts(1, (12,))[0]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = llm.generate([prompt], params)[0].token_ids
    engine = AsyncEngine(llm.engine)
    opened = threading.Event()
    abort = llm.engine.abort

    def abort_then_wait(request_id):
        out = abort(request_id)
        opened.wait(10)  # the new stream opens now, before this abort's output goes anywhere
        return out
    llm.engine.abort = abort_then_wait
    engine.start()

    async def main() -> list[int]:
        old = engine.generate(prompt, params, request_id="x")
        await anext(old)  # running
        await old.aclose()
        while "x" in llm.engine.requests:  # the engine's thread took the old one out
            await asyncio.sleep(0.01)
        new = engine.generate(prompt, params, request_id="x")
        first = asyncio.ensure_future(anext(new))
        await asyncio.sleep(0.1)  # open, waiting
        opened.set()
        outs = [await first] + [o async for o in new]
        assert outs[-1].finish_reason == "length", outs[-1]
        return [t for o in outs for t in o.new_token_ids]

    try:
        assert asyncio.run(main()) == expected
    finally:
        engine.shutdown()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_async_stream_matches_offline_and_cancel_frees_blocks(ckpt):
    llm = LLM(model=ckpt, load_progress=False)
    prompt = _prompts(1, (40,))[0]
    expected = llm.generate([prompt], GREEDY)[0]
    engine = AsyncEngine(llm.engine)
    engine.start()

    async def stream_all():  # token ids only: the engine makes no text (api/stream.py does)
        ids = []
        async for out in engine.generate(prompt, GREEDY):
            ids += out.new_token_ids
        return ids

    async def cancel_early():
        agen = engine.generate(prompt, SamplingParams(max_tokens=500, ignore_eos=True))
        async for out in agen:
            if out.num_output_tokens >= 3:
                break
        await agen.aclose()

    async def main():
        results = await asyncio.gather(*(stream_all() for _ in range(4)))
        await cancel_early()
        with pytest.raises(InvalidRequestError):
            async for _ in engine.generate([], GREEDY):
                pass
        return results

    try:
        results = asyncio.run(main())
        for ids in results:
            assert ids == expected.token_ids
        for _ in range(200):  # the abort travels through the command queue
            if not llm.engine.requests:
                break
            time.sleep(0.05)
    finally:
        engine.shutdown()
    assert _all_blocks_free(llm)  # checked once the loop thread has stopped


def test_smollm2_knows_the_capital_of_france():
    llm = LLM(load_progress=False)  # the real model, default dtype
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"


def test_request_outgrowing_the_pool_stops_at_length_instead_of_livelocking(ckpt):
    llm = LLM(model=ckpt, num_kv_blocks=4, load_progress=False)  # 64 token slots in all
    assert llm.engine.max_model_len == 64
    outs = llm.generate([[5] * 10, [6] * 20], SamplingParams(temperature=0, max_tokens=500,
                                                             ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [54, 44]
    assert all(o.finish_reason == "length" for o in outs)
    assert _all_blocks_free(llm)


def test_packed_cpu_weights_give_the_same_numbers(ckpt):
    """bf16 on CPU multiplies with oneDNN's blocked copies of the weights (pack_cpu_weights):
    a faster layout of the same numbers, so logits and greedy tokens equal the plain path."""
    from mxserve.worker.model.parallel import ColumnParallelLinear, can_pack_for_cpu

    if not can_pack_for_cpu(torch.bfloat16, "cpu"):
        pytest.skip("this CPU's oneDNN has no native bf16")
    params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=3)
    prompts = [[5, 6, 7, 8, 9] * 7, [11, 12, 13]]
    outs = {}
    for pack in (True, False):
        llm = LLM(model=ckpt, dtype="bfloat16", pack_cpu_weights=pack, load_progress=False)
        linears = [m for m in llm.engine.runner.model.modules()
                   if isinstance(m, ColumnParallelLinear)]
        assert all((m.packed is not None) == pack for m in linears)
        outs[pack] = [(o.token_ids, o.logprobs) for o in llm.generate(prompts, params)]
    assert outs[True] == outs[False]


def test_bad_engine_options_are_errors_naming_them():
    from mxserve.cluster.config import ServeConfig

    for options, name in ((dict(tensor_parallel_size=0), "tensor_parallel_size"),
                          (dict(tp_timeout_s=0), "tp_timeout_s"),
                          (dict(num_threads=0), "num_threads"),
                          (dict(max_num_seqs=-1), "max_num_seqs")):
        with pytest.raises(ValueError, match=name):
            EngineConfig(**options)
        with pytest.raises(ValueError, match=name):
            ServeConfig(engine=options)
    assert EngineConfig(tensor_parallel_size=4).tensor_parallel_size == 4


def test_gemv_options_reach_every_linear_of_their_engine_only(ckpt):
    """EngineConfig.gemv is passed down to each linear, the LM head and each MX weight of that
    engine's model (no module switch: a second engine in the process keeps its own); a deploy
    config's mapping reads as the options; a bad field is a ValueError naming it."""
    from mxserve.kernels.options import GemvOptions
    from mxserve.worker.model.mx_layers import MXWeight
    from mxserve.worker.model.parallel import (
        ColumnParallelLinear,
        ParallelLMHead,
        RowParallelLinear,
    )

    path = ckpt
    off = LLM(model=path, device="cpu", load_progress=False, gemv={"max_rows": 0, "pdl": False},
              quantization="mxfp4")
    default = LLM(model=path, device="cpu", load_progress=False)
    kinds = (ColumnParallelLinear, RowParallelLinear, ParallelLMHead, MXWeight)
    for llm, want in ((off, GemvOptions(max_rows=0, pdl=False)), (default, GemvOptions())):
        layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, kinds)]
        assert len(layers) > 4 and {m.gemv_options for m in layers} == {want}
    assert any(isinstance(m, MXWeight) for m in off.engine.runner.model.modules())
    with pytest.raises(ValueError, match="gemv: unknown option 'rows'"):
        EngineConfig(gemv={"rows": 1})
    with pytest.raises(ValueError, match="gemv.max_rows must be an integer >= 0"):
        EngineConfig(gemv={"max_rows": -1})
    with pytest.raises(ValueError, match="gemv.pdl must be true or false"):
        EngineConfig(gemv={"pdl": "yes"})
