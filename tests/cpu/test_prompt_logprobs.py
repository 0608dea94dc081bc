"""Prompt logprobs (SamplingParams.prompt_logprobs) on a tiny random Llama in float32: equal to
transformers' full forward over the prompt, whatever the chunking, the prefix cache, the batch,
async scheduling or speculation around them."""

from __future__ import annotations

import math

import pytest
import torch

from mxserve import LLM, SamplingParams
from mxserve.api.outputs import StepOutput, merge_outputs

PROMPT_LENS = [1, 2, 5, 23, 41]
NUM_TOP = 5
PLP = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=NUM_TOP)
ENGINE = dict(dtype="float32", num_kv_blocks=64, load_progress=False)


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


def _prompts(lengths=PROMPT_LENS, seed: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def reference(ckpt) -> dict[tuple[int, ...], torch.Tensor]:
    """Each prompt's log_softmax over transformers' logits [len(prompt), vocab]."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        return {tuple(p): hf(torch.tensor([p])).logits[0].log_softmax(-1) for p in _prompts()}


def _check_against_reference(prompt: list[int], got: list, ref: torch.Tensor, n: int) -> None:
    """got[i] (i >= 1) is {prompt[i]: lp, then the top n}: the actual token first, every value
    the reference's to 1e-4; got[0] is None."""
    assert len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        entry, row = got[i], ref[i - 1]
        assert next(iter(entry)) == prompt[i]
        top = row.topk(n).indices.tolist()
        assert set(entry) == {prompt[i], *top}
        for token, lp in entry.items():
            assert math.isclose(lp, row[token].item(), abs_tol=1e-4), (i, token)


def _assert_same(a: list, b: list) -> None:
    """Two prompt-logprob lists equal: keys in order, values to float32 rounding."""
    assert [None if e is None else list(e) for e in a] == \
        [None if e is None else list(e) for e in b]
    for x, y in zip(a[1:], b[1:]):
        assert list(x.values()) == pytest.approx(list(y.values()), abs=1e-5)


@pytest.fixture(scope="module")
def unchunked(ckpt, reference) -> list[list]:
    """The prompts' prompt logprobs in one prefill each (and checked against transformers)."""
    with LLM(ckpt, **ENGINE) as llm:
        outs = llm.generate(_prompts(), PLP)
    for prompt, out in zip(_prompts(), outs):
        _check_against_reference(prompt, out.prompt_logprobs, reference[tuple(prompt)], NUM_TOP)
    return [o.prompt_logprobs for o in outs]


def test_prompt_logprobs_match_transformers(ckpt, reference, unchunked):
    """Also with n = 0 (the actual token only) and n = 20."""
    with LLM(ckpt, **ENGINE) as llm:
        for n in (0, 20):
            params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=n)
            for prompt, out in zip(_prompts(), llm.generate(_prompts(), params)):
                _check_against_reference(prompt, out.prompt_logprobs, reference[tuple(prompt)],
                                         n)


@pytest.mark.parametrize("chunk", [1, 7, 16])
def test_chunked_prefill_gives_the_same_prompt_logprobs(ckpt, unchunked, chunk):
    """A prompt split over several steps (1: every chunk one token, which the decode path
    would take) gives what one prefill gives."""
    with LLM(ckpt, max_num_batched_tokens=chunk, **ENGINE) as llm:
        outs = llm.generate(_prompts(), PLP)
    for got, want in zip(outs, unchunked):
        _assert_same(got.prompt_logprobs, want)


def test_no_prefix_hits_but_blocks_cached_for_others(ckpt, unchunked):
    """A request asking for prompt logprobs computes its whole prompt though its blocks are
    cached (each of its positions needs logits), and its own blocks serve later requests."""
    prompt = _prompts()[-1]  # 41 tokens: 2 full blocks of 16
    plain = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with LLM(ckpt, **ENGINE) as llm:
        assert llm.generate(prompt, plain)[0].num_cached_tokens == 0
        again = llm.generate(prompt, PLP)[0]
        assert again.num_cached_tokens == 0
        _assert_same(again.prompt_logprobs, unchunked[-1])
        assert llm.engine.num_prefix_hit_tokens(llm.engine.make_request(prompt, PLP)) == 0
    with LLM(ckpt, **ENGINE) as llm:
        first = llm.generate(prompt, PLP)[0]
        assert llm.generate(prompt, plain)[0].num_cached_tokens == 32
        assert first.token_ids == llm.generate(prompt, plain)[0].token_ids


def test_batched_with_other_requests_changes_neither(ckpt, unchunked):
    """Requests without prompt logprobs get none, and the same tokens and logprobs as alone."""
    others = _prompts([9, 30, 17], seed=8)
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    with LLM(ckpt, max_num_batched_tokens=24, enable_prefix_caching=False, **ENGINE) as llm:
        alone = llm.generate(others, plain)
        mixed = llm.generate(_prompts() + others, [PLP] * len(PROMPT_LENS) + [plain] * 3)
    for got, want in zip(mixed, unchunked):
        _assert_same(got.prompt_logprobs, want)
    for got, want in zip(mixed[len(PROMPT_LENS):], alone):
        assert got.prompt_logprobs is None
        assert got.token_ids == want.token_ids
        assert [list(d) for d in got.logprobs] == [list(d) for d in want.logprobs]


@pytest.mark.parametrize("options", [
    dict(async_scheduling=True, max_num_batched_tokens=16),
    dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3}),
    dict(tensor_parallel_size=2, max_num_batched_tokens=16, num_threads=1),
], ids=["async", "ngram", "tp2"])
def test_async_speculation_and_tensor_parallel_give_the_same(ckpt, unchunked, options):
    """(tp2: the other rank computes the same prompt rows: the logits gather the vocabulary
    over the group.)"""
    with LLM(ckpt, **ENGINE, **options) as llm:
        outs = llm.generate(_prompts(), PLP)
    for got, want in zip(outs, unchunked):
        _assert_same(got.prompt_logprobs, want)


def test_preempted_requests_give_the_same(ckpt, unchunked):
    """A pool too small for the batch: requests preempted mid-prompt recompute it, and those
    preempted after their first token recompute it without prompt logprobs (taking prefix
    hits); each still gets every entry, once."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                            prompt_logprobs=NUM_TOP)
    with LLM(ckpt, **{**ENGINE, "num_kv_blocks": 5}, max_num_batched_tokens=16) as llm:
        preempted = []  # (in its prompt still, has output) of each preempted request
        preempt = llm.engine.scheduler._preempt

        def recording(request, plan):
            preempted.append((request.is_prefill, request.num_output_tokens > 0))
            preempt(request, plan)

        llm.engine.scheduler._preempt = recording
        outs = llm.generate(_prompts(), params)
    assert (True, False) in preempted and (False, True) in preempted
    for got, want in zip(outs, unchunked):
        _assert_same(got.prompt_logprobs, want)


def test_streamed_once_with_the_first_token(ckpt, unchunked):
    """The engine's outputs: the list on the first one only."""
    prompt = _prompts()[3]
    with LLM(ckpt, max_num_batched_tokens=8, **ENGINE) as llm:
        llm.engine.add_request(prompt, PLP)
        outs = []
        while llm.engine.has_unfinished_requests():
            outs += llm.engine.step()
    assert [o.prompt_logprobs is not None for o in outs] == [True, False, False]
    _assert_same(outs[0].prompt_logprobs, unchunked[3])


def test_merged_outputs_keep_the_prompt_logprobs_of_the_first():
    """A slow consumer's piled-up outputs, merged into one (AsyncEngine), keep them."""
    plp = [None, {7: -0.5, 3: -0.2}]
    first = StepOutput("r", [4], None, False, None, 2, 0, 1, prompt_logprobs=plp)
    then = StepOutput("r", [5], None, True, "length", 2, 0, 2)
    assert merge_outputs([first, then]).prompt_logprobs is plp
    assert merge_outputs([then, then]).prompt_logprobs is None

