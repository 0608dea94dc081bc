"""Tensor parallelism on CPU: real rank processes over gloo. A TP=N engine computes what TP=1
does (fp32 logits within 1e-5, the same greedy tokens) through chunked prefill, prefix-cache
hits and preemption; each rank reads only its slices of every checkpoint format; a bad size is
a clear error at start-up; a rank that dies fails the engine at once (UNAVAILABLE), and no rank
process outlives its engine."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from mxserve import LLM, SamplingParams
from mxserve.api.errors import ModelLoadError
from mxserve.worker.model.llama import tensor_slice
from mxserve.worker.model.loader import open_checkpoint
from mxserve.worker.model.tp import TPGroup
from mxserve.worker.tp_executor import RankFailure

ENGINE = dict(dtype="float32", num_kv_blocks=14, max_num_batched_tokens=32, max_num_seqs=8,
              load_progress=False, num_threads=1)
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def _waves() -> list[list[list[int]]]:
    """Mixed lengths (chunked under a 32-token budget); the second wave shares the first's
    prefixes (prefix-cache hits); together they outgrow 14 blocks (preemption)."""
    first = [[3 + (i * 7 + j) % 240 for j in range(n)] for i, n in enumerate((5, 17, 40, 70))]
    second = [p[:33] + [11, 12, 13] for p in first[2:]] + [first[1] + [9] * 30]
    return [first, second]


def _run(llm: LLM) -> tuple[list[list[int]], list[torch.Tensor], list]:
    """(greedy tokens per prompt, rank 0's logits each step, the outputs)."""
    logits, execute = [], llm.engine.runner.execute

    def recording(plan):
        result = execute(plan)
        logits.append(result.logits.clone())
        return result

    llm.engine.runner.execute = recording
    outputs = [o for wave in _waves() for o in llm.generate(wave, GREEDY)]
    return [o.token_ids for o in outputs], logits, outputs


@pytest.fixture(scope="module")
def models(tiny_checkpoint):
    """Llama with 2 KV heads (split on TP=2, replicated on TP=4) and Qwen2 (q/k/v biases) with
    1 KV head (replicated) and a vocabulary TP=4 does not divide (its last range padded)."""
    return {"llama": str(tiny_checkpoint("llama")),
            "qwen2": str(tiny_checkpoint("qwen2", num_key_value_heads=1, vocab_size=250))}


@pytest.fixture(scope="module")
def single(models):
    out = {}
    for name, path in models.items():
        with LLM(path, **ENGINE) as llm:
            out[name] = _run(llm)
    return out


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_group_computes_what_one_rank_does(models, single, arch, size):
    want_tokens, want_logits, _ = single[arch]
    with LLM(models[arch], tensor_parallel_size=size, **ENGINE) as llm:
        tokens, logits, outputs = _run(llm)
        engine = llm.engine
        assert any(r.num_preemptions for r in engine.finished_requests)  # it was exercised
        assert any(o.num_cached_tokens for o in outputs)
        engine.kv.check_integrity()
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
        ranks = llm.engine.runner.followers.launcher.processes
        assert len(ranks) == size - 1 and all(p.is_alive() for p in ranks)
    assert tokens == want_tokens
    assert len(logits) == len(want_logits)
    for got, want in zip(logits, want_logits):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    for p in ranks:  # the LLM's shutdown ended them
        p.join(10)
        assert p.exitcode == 0


def test_with_async_scheduling_every_rank_gets_the_tokens_still_in_flight(models, single):
    """Each step computes the token the previous one sampled before the host has seen it: rank
    0 broadcasts those ids over the group, and the group still matches one rank."""
    with LLM(models["llama"], tensor_parallel_size=2, async_scheduling=True, **ENGINE) as llm:
        sends, send = [], llm.engine.runner.followers.send
        llm.engine.runner.followers.send = lambda plan: (sends.append(
            any(s.inflight_row >= 0 for s in plan.scheduled)), send(plan))
        tokens, _, _ = _run(llm)
    assert any(sends)
    assert tokens == single["llama"][0]


def test_a_plan_crosses_to_the_other_ranks_intact():
    from mxserve.worker.scheduler import ScheduledRequest, StepPlan
    from mxserve.worker.tp_wire import decode_plan, encode_plan

    plan = StepPlan(num_decodes=2, inflight_tokens=torch.tensor([7, 8, 9]), mass_window=32,
                    kv_moves=[([33, 34, 90], [16, 17, 18]), ([5], [2])])
    plan.scheduled = [ScheduledRequest(None, 1, 40, [5], [3, 4, 9], 17, True, -1),
                      ScheduledRequest(None, 1, 12, [], [1], 18, True, 2, position_offset=70),
                      ScheduledRequest(None, 4, 20, [7, 8, 9, 6], [1, 5], 20, True, -1, 3),
                      ScheduledRequest(None, 30, 0, list(range(30)), [2, 6], 19, False, -1,
                                       prompt_logprob_ids=list(range(1, 31)),
                                       num_prompt_logprobs=5)]
    got, num_inflight = decode_plan(encode_plan(plan))
    assert num_inflight == 3 and got.num_decodes == 2
    assert got.mass_window == 32 and got.kv_moves == plan.kv_moves
    fields = ("num_new_tokens", "start_position", "token_ids", "block_table", "table_version",
              "samples", "inflight_row", "num_draft_tokens", "position_offset",
              "num_prompt_logprobs")
    assert [list(s.prompt_logprob_ids) for s in got.scheduled] == \
        [list(s.prompt_logprob_ids) for s in plan.scheduled]
    assert [[getattr(s, f) for f in fields] for s in got.scheduled] == \
        [[getattr(s, f) for f in fields] for s in plan.scheduled]


def test_smollm2_on_three_ranks_answers_as_one_does():
    """SmolLM2-135M: 9 heads and 3 KV heads, one each a rank; its GGUF read by slices."""
    question = [{"role": "user", "content": "What is the capital of France?"}]
    one = LLM(dtype="float32", load_progress=False, num_threads=1).chat(question)[0]
    with LLM(dtype="float32", load_progress=False, tensor_parallel_size=3) as llm:
        three = llm.chat(question)[0]
    assert "Paris" in three.text
    assert three.token_ids == one.token_ids


def _check_slices(path: str, size: int, make_full=None) -> int:
    """Every tensor each rank reads equals its slice of the whole tensor; returns the number
    of tensors that were sliced."""
    checkpoint = open_checkpoint(path)
    full = dict(checkpoint.weights(progress=False))
    sliced = 0
    for rank in range(size):
        tp = TPGroup(rank, size)
        part_of = lambda name, tp=tp: tensor_slice(checkpoint.config, tp, name)  # noqa: E731
        for name, got in checkpoint.weights(progress=False, slice_for=part_of):
            part = part_of(name)
            want = full[name] if part is None else (make_full or (lambda t, p: p.take(t)))(
                full[name], part)
            sliced += part is not None
            if hasattr(got, "fmt"):  # MX: the packed codes and scales
                assert torch.equal(got.data, want.data) and torch.equal(got.scales, want.scales)
                assert got.shape == want.shape
            else:
                assert torch.equal(got, want), name
    return sliced


def test_each_rank_reads_only_its_slices_of_safetensors_and_gguf(tiny_checkpoint):
    assert _check_slices(str(tiny_checkpoint("qwen2", num_key_value_heads=1, vocab_size=250)),
                         4) > 0
    from mxserve.worker.model.loader import smollm2_path

    assert _check_slices(smollm2_path(), 3) > 0  # Q4_1 columns cut at 32-blocks, Q8_0 rows


def test_each_rank_reads_only_its_slices_of_an_mx_checkpoint(tiny_checkpoint, tmp_path):
    from mxserve.worker.model import mx_layers
    from mxserve.worker.model.quantize import quantize_checkpoint

    out = str(tmp_path / "mx")
    quantize_checkpoint(str(tiny_checkpoint("llama", intermediate_size=128)), "mxfp4", out)
    assert _check_slices(out, 2, lambda t, part: mx_layers.slice_mx(t, part)
                         if hasattr(t, "fmt") else part.take(t)) > 0


def test_an_mx_group_matches_one_rank(tiny_checkpoint):
    """Quantized while loading: each rank quantizes its slice of whole 32-blocks."""
    path = str(tiny_checkpoint("llama", intermediate_size=128))
    prompts = _waves()[0]
    with LLM(path, quantization="mxfp4", **ENGINE) as one:
        want = [o.token_ids for o in one.generate(prompts, GREEDY)]
    with LLM(path, quantization="mxfp4", tensor_parallel_size=2, **ENGINE) as two:
        assert [o.token_ids for o in two.generate(prompts, GREEDY)] == want


def test_bad_sizes_are_clear_errors_at_start_up(models, tiny_checkpoint):
    with pytest.raises(ModelLoadError, match="num_attention_heads"):
        LLM(models["llama"], tensor_parallel_size=3, **ENGINE)  # 4 heads
    three_kv = str(tiny_checkpoint("llama", hidden_size=96, num_attention_heads=6,
                                   num_key_value_heads=3))
    with pytest.raises(ModelLoadError, match="num_key_value_heads"):  # 3 KV heads on 2 ranks
        LLM(three_kv, tensor_parallel_size=2, **ENGINE)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(models["llama"], tensor_parallel_size=0, **ENGINE)


def test_a_dead_rank_fails_the_engine_at_once_and_leaves_no_process(models):
    llm = LLM(models["llama"], tensor_parallel_size=2, **ENGINE)
    (rank,) = llm.engine.runner.followers.launcher.processes
    assert llm.generate([[5, 6, 7]], GREEDY)[0].token_ids  # healthy
    os.kill(rank.pid, signal.SIGKILL)
    rank.join(10)
    start = time.monotonic()
    with pytest.raises(RankFailure):
        llm.engine.check_health()
    with pytest.raises(RankFailure, match="tensor-parallel"):
        llm.generate([[5, 6, 7]], GREEDY)
    assert time.monotonic() - start < 5
    assert not llm.engine.requests and llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    llm.shutdown()


def test_a_hung_rank_fails_the_step_after_the_collective_timeout(models):
    llm = LLM(models["llama"], tensor_parallel_size=2, tp_timeout_s=3, **ENGINE)
    (rank,) = llm.engine.runner.followers.launcher.processes
    os.kill(rank.pid, signal.SIGSTOP)  # alive, its socket open, but it takes no step
    try:
        start = time.monotonic()
        with pytest.raises(RankFailure, match="tensor-parallel"):
            llm.generate([[5, 6, 7]], GREEDY)
        assert 3 <= time.monotonic() - start < 15
        with pytest.raises(RankFailure):
            llm.engine.check_health()
    finally:
        llm.shutdown()  # kills the stopped rank: nothing outlives the engine
    rank.join(5)
    assert rank.exitcode is not None
