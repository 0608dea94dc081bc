"""Speculative decoding (worker/spec_verify.py, drafters.py, eagle.py) on CPU: greedy output with
speculation equals output without it, token for token, whatever the drafter (ngram, a random
EAGLE head, an oracle that is always right, one that is mostly wrong), through chunked prefill,
prefix hits, preemption, logprobs, stop ids, stop strings and max_tokens landing inside accepted
runs, with the KV pool free and consistent after; sampled output keeps the target's distribution
(chi-square over 20k draws, a test that fails with plain acceptance); bad configs fail at
start-up naming the field."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mxserve import LLM, SamplingParams
from mxserve.api.errors import ModelLoadError
from mxserve.worker import spec_verify
from mxserve.worker.drafters import TokenArrays, ngram_lookup
from mxserve.worker.eagle import save_head
from mxserve.worker.eagle_train import init_head
from mxserve.worker.model.loader import open_checkpoint
from mxserve.worker.model.parallel import can_pack_for_cpu
from mxserve.worker.request import Request

ENGINE = dict(dtype="float32", num_kv_blocks=20, max_num_batched_tokens=24, max_num_seqs=8,
              load_progress=False, num_threads=1)
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def _prompts() -> list[list[int]]:
    """Repetitive ones (ngram finds drafts), mixed lengths (chunked at 24), one sharing a prefix
    with another (a prefix hit)."""
    out = [[5, 6, 7, 8, 9] * n for n in (2, 5, 9)] + [[11, 12, 13, 14] * 6 + [11, 12]]
    out.append(out[1] + [30, 31])
    return out


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def random_head(ckpt, random_eagle_head):
    return random_eagle_head(ckpt, seed=1)


@pytest.fixture(scope="module")
def reference(ckpt):
    with LLM(ckpt, **ENGINE) as llm:
        return {"greedy": [o.token_ids for o in llm.generate(_prompts(), GREEDY)], "llm": None}


class OracleDrafter:
    """Proposes the reference continuation, right or (with probability `wrong`) a wrong token:
    every draft is accepted (wrong=0), so stops land inside accepted runs."""

    needs_hidden, num_lookahead_tokens = False, 0

    def release(self, request):
        pass

    def __init__(self, reference: dict[tuple, list[int]], wrong: float = 0.0, seed: int = 0):
        self.reference, self.wrong, self.rng = reference, wrong, random.Random(seed)

    def propose(self, plan, hidden, num_drafts) -> None:
        for r, n in num_drafts.items():
            truth = self.reference[tuple(r.prompt_token_ids)][r.num_output_tokens:][:n]
            r.draft_token_ids = [t if self.rng.random() >= self.wrong else
                                 self.rng.randrange(3, 256) for t in truth]


def _check_pool(llm: LLM) -> None:
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    assert not llm.engine.requests


@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_greedy_speculation_equals_plain_decoding(ckpt, reference, random_head, method):
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "eagle":
        spec["model"] = random_head
    with LLM(ckpt, speculative_config=spec, **ENGINE) as llm:
        outs = llm.generate(_prompts(), GREEDY)
        assert [o.token_ids for o in outs] == reference["greedy"]
        done = list(llm.engine.finished_requests)
        assert sum(r.num_draft_tokens for r in done) > 0
        assert any(r.num_preemptions for r in done) and any(o.num_cached_tokens for o in outs)
        _check_pool(llm)


def test_eagle_with_lookup_first_equals_plain_decoding_and_uses_both(ckpt, reference,
                                                                    random_head):
    """lookup_first: requests whose n-gram matches draft by lookup, the rest with the head; the
    head still catches up on every step. Greedy output is plain decoding's either way."""
    spec = {"method": "eagle", "model": random_head, "num_speculative_tokens": 3,
            "lookup_first": True, "min_draft_confidence": 0.0}
    prompts = _prompts() + [[40 + i for i in range(20)]]  # no repeat: the head drafts
    with LLM(ckpt, **ENGINE) as plain:
        want = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    with LLM(ckpt, speculative_config=spec, **ENGINE) as llm:
        drafter = llm.engine.drafter
        head_rounds = []
        propose = drafter.inner.propose

        def counted(plan, hidden, num_drafts):
            head_rounds.append(sum(n > 0 for n in num_drafts.values()))
            propose(plan, hidden, num_drafts)
        drafter.inner.propose = counted
        outs = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == want
        assert drafter.num_lookup_drafts > 0 and sum(head_rounds) > 0
        assert sum(r.num_draft_tokens for r in llm.engine.finished_requests) > 0
        _check_pool(llm)


def test_the_shipped_head_on_smollm2_equals_plain_decoding():
    """The default model's own head (worker/heads/), used when no model is given."""
    questions = [[{"role": "user", "content": q}] for q in
                 ("What is the capital of France?", "Describe a river in two sentences.")]
    params = SamplingParams(temperature=0, max_tokens=32)
    with LLM(dtype="float32", load_progress=False, num_threads=1) as plain:
        want = [o.token_ids for o in plain.chat(questions, params)]
    with LLM(dtype="float32", load_progress=False, num_threads=1,
             speculative_config={"method": "eagle", "num_speculative_tokens": 3}) as llm:
        outs = llm.chat(questions, params)
        assert [o.token_ids for o in outs] == want
        assert sum(o.num_accepted_tokens for o in outs) > 0  # it is a trained head
        _check_pool(llm)


def test_the_shipped_head_in_the_default_cpu_engine_equals_plain_decoding_at_batch_1():
    """bf16, the GGUF's 4-bit linears, the head packed to int4: a verify's k + 1 rows compute
    what k + 1 decode steps would, bit for bit (int4 GEMMs of up to 16 rows on AMX, 8 else,
    the attention kernel's rows, float32 logits are row-exact), so greedy output does not
    drift."""
    questions = [[{"role": "user", "content": q}] for q in
                 ("Name three uses of copper.", "Why is the sky blue?")]
    params = SamplingParams(temperature=0, max_tokens=48)
    with LLM(load_progress=False, num_threads=2) as plain:
        want = [plain.chat([q], params)[0].token_ids for q in questions]
    with LLM(load_progress=False, num_threads=2,
             speculative_config={"method": "eagle", "num_speculative_tokens": 3}) as llm:
        if can_pack_for_cpu(torch.bfloat16, "cpu"):
            assert llm.engine.drafter.head.fc.int4 is not None
        outs = [llm.chat([q], params)[0] for q in questions]
        assert [o.token_ids for o in outs] == want
        assert sum(o.num_accepted_tokens for o in outs) > 0
        _check_pool(llm)


def _sure_of_even_ids_only(llm: LLM) -> list[list[int]]:
    """Make the engine's head sure (probability 1) of even token ids and unsure (0) of odd ones;
    returns the list its proposals will be appended to."""
    drafter, head = llm.engine.drafter, llm.engine.drafter.head
    plain_draft, plain_propose, proposals = head.draft_tokens, drafter.propose, []

    def draft_tokens(g):
        ids, _ = plain_draft(g)
        return ids, (ids % 2 == 0).float()

    def propose(plan, hidden, num_drafts):
        plain_propose(plan, hidden, num_drafts)
        proposals.extend(list(r.draft_token_ids) for r in num_drafts)

    head.draft_tokens, drafter.propose = draft_tokens, propose
    return proposals


def test_a_chain_of_drafts_ends_before_the_first_the_head_is_unsure_of(ckpt, reference,
                                                                        random_head):
    """With a floor, every proposal is a run of even ids, some cut short; without one, odd ids
    are drafted too. Outputs equal plain decoding either way."""
    seen = {}
    for floor in (0.0, 0.5):
        spec = {"method": "eagle", "num_speculative_tokens": 3, "model": random_head,
                "min_draft_confidence": floor, "lookup_first": False}
        with LLM(ckpt, speculative_config=spec, **ENGINE) as llm:
            seen[floor] = _sure_of_even_ids_only(llm)
            assert [o.token_ids for o in llm.generate(_prompts(), GREEDY)] == reference["greedy"]
            _check_pool(llm)
    assert any(t % 2 for p in seen[0.0] for t in p)
    assert all(t % 2 == 0 for p in seen[0.5] for t in p)
    assert any(len(p) == 3 for p in seen[0.5]) and any(len(p) < 3 for p in seen[0.5])


def test_no_drafts_while_the_batch_is_larger_than_disable_by_batch_size(ckpt, reference,
                                                                         random_head):
    """Five prompts at once with disable_by_batch_size 2: steps carry drafts only once at most
    2 requests remain, and the head, catching up all along, drafts right then. Outputs equal
    plain decoding; the request left alone (its peers done) is drafted for."""
    spec = {"method": "eagle", "num_speculative_tokens": 3, "model": random_head,
            "min_draft_confidence": 0.0, "disable_by_batch_size": 2}
    with LLM(ckpt, speculative_config=spec, **ENGINE) as llm:
        engine, sizes = llm.engine, []
        plain_propose = engine.drafter.propose

        def propose(plan, hidden, num_drafts):
            plain_propose(plan, hidden, num_drafts)
            if num_drafts:
                sizes.append(len(engine.scheduler.running) + len(engine.scheduler.waiting))

        engine.drafter.propose = propose
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                  for n in (40, 10, 12, 14, 16)]
        outs = llm.generate(_prompts(), params)
        assert [o.token_ids for o in outs][1:] == [r[:n] for r, n in
                                                  zip(reference["greedy"][1:], (10, 12, 14, 16))]
        assert outs[0].token_ids == reference["greedy"][0]
        assert sizes and max(sizes) <= 2
        assert outs[0].num_drafts > 0
        _check_pool(llm)


def test_stops_inside_accepted_runs_end_where_plain_decoding_ends(ckpt, reference):
    prompts, ref = _prompts(), reference["greedy"]
    stop_id = ref[2][9]  # a token the third answer reaches mid-way
    cases = [SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                            stop_token_ids=[stop_id]),
             SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2),
             SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                            stop=[f"w{ref[3][6]} w{ref[3][7]}"])]
    with LLM(ckpt, **ENGINE) as plain:
        want = [plain.generate(prompts, p) for p in cases]
    with LLM(ckpt, speculative_config={"method": "ngram", "num_speculative_tokens": 4},
             **ENGINE) as llm:
        llm.engine.drafter = OracleDrafter({tuple(p): r for p, r in zip(prompts, ref)})
        for params, expected in zip(cases, want):
            got = llm.generate(prompts, params)
            assert [o.token_ids for o in got] == [o.token_ids for o in expected]
            assert [o.text for o in got] == [o.text for o in expected]
            assert [o.finish_reason for o in got] == [o.finish_reason for o in expected]
            if params.logprobs:
                for g, e in zip(got, expected):
                    assert [list(d) for d in g.logprobs] == [list(d) for d in e.logprobs]
                    assert [v for d in g.logprobs for v in d.values()] == pytest.approx(
                        [v for d in e.logprobs for v in d.values()], abs=1e-5)
        done = list(llm.engine.finished_requests)
        assert sum(r.num_accepted_tokens for r in done) == sum(r.num_draft_tokens for r in done)
        assert max(r.num_accepted_tokens / max(1, r.num_drafts) for r in done) > 2
        _check_pool(llm)


def test_a_stop_before_a_block_boundary_inside_an_accepted_run(ckpt, reference):
    """A stop id that ends a request with accepted drafts after it, whose KV reaches past a
    block boundary the request's tokens do not: the request ends there and only its own
    tokens' blocks are hashed into the prefix cache (a later request still hits them)."""
    prompts, ref = _prompts(), reference["greedy"]
    prompt, answer = prompts[2], ref[2]
    with LLM(ckpt, **ENGINE) as plain, \
            LLM(ckpt, speculative_config={"method": "ngram", "num_speculative_tokens": 4},
                **ENGINE) as llm:
        llm.engine.drafter = OracleDrafter({tuple(prompt): answer,
                                            tuple(prompt + answer[:8]): answer[8:]})
        tried = 0
        for i, stop_id in enumerate(answer[:24]):
            if stop_id in answer[:i]:
                continue
            params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                    stop_token_ids=[stop_id])
            want = plain.generate([prompt], params)[0]
            got = llm.generate([prompt], params)[0]
            assert got.token_ids == want.token_ids == answer[:i + 1]
            assert got.finish_reason == "stop"
            tried += 1
            _check_pool(llm)
        assert tried >= 8
        again = llm.generate([prompt + answer[:8]], GREEDY)[0]
        assert again.token_ids[:24] == answer[8:32]
        assert again.num_cached_tokens == (len(prompt) + 8) // 16 * 16


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(wrong=st.floats(0.0, 1.0), k=st.integers(1, 6), budget=st.integers(8, 40),
       blocks=st.integers(9, 30), seed=st.integers(0, 1000))
def test_draft_verify_trim_loop_keeps_output_and_pool(ckpt, reference, wrong, k, budget,
                                                      blocks, seed):
    """Random drafters (right with probability 1 - wrong), k, token budgets and pool sizes: the
    engine steps one by one, its pool consistent after each, and ends with plain decoding's
    tokens."""
    prompts = _prompts()
    with LLM(ckpt, **{**ENGINE, "num_kv_blocks": blocks, "max_num_batched_tokens": budget},
             speculative_config={"method": "ngram", "num_speculative_tokens": k}) as llm:
        llm.engine.drafter = OracleDrafter(
            {tuple(p): r for p, r in zip(prompts, reference["greedy"])}, wrong, seed)
        engine = llm.engine
        ids = [engine.add_request(p, GREEDY) for p in prompts]
        while engine.has_unfinished_requests():
            engine.step()
            engine.kv.check_integrity()
        done = {r.request_id: r.output_token_ids for r in engine.finished_requests}
        assert [done[i] for i in ids] == reference["greedy"]
        _check_pool(llm)


def test_a_group_with_speculation_matches_one_rank(ckpt, reference, random_head):
    for spec in ({"method": "ngram", "num_speculative_tokens": 3},
                 {"method": "eagle", "model": random_head, "num_speculative_tokens": 2}):
        with LLM(ckpt, tensor_parallel_size=2, speculative_config=spec, **ENGINE) as llm:
            assert [o.token_ids for o in llm.generate(_prompts(), GREEDY)] == \
                reference["greedy"]
            _check_pool(llm)


def _chi_square_p(counts: dict, probs: dict, n: int) -> float:
    """p-value of observed counts against probabilities (cells expected < 5 pooled)."""
    observed, expected, pool_o, pool_e = [], [], 0, 0.0
    for key, p in probs.items():
        if n * p < 5:
            pool_o, pool_e = pool_o + counts.get(key, 0), pool_e + n * p
        else:
            observed.append(counts.get(key, 0))
            expected.append(n * p)
    if pool_e > 0:
        observed.append(pool_o)
        expected.append(pool_e)
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    dof = len(observed) - 1  # the chi-square survival function: Q(dof / 2, stat / 2)
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def _sampled_pairs(llm: LLM, prompt: list[int], params: SamplingParams, n: int) -> dict:
    counts: dict = {}
    for o in llm.generate([prompt] * n, params):
        key = tuple(o.token_ids[:2])
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.fixture(scope="module")
def tiny_vocab(tiny_checkpoint):
    return str(tiny_checkpoint("llama", vocab_size=12))


def _exact_pairs(path: str, prompt: list[int], params: SamplingParams) -> dict:
    """p(t1, t2) of plain sampling under `params` (temperature, top_k), from the model's logits
    through the sampler's own transforms."""
    from mxserve.worker.logits_ops import filter_threshold

    def dist(llm, tokens):
        logits = llm.generate([tokens], SamplingParams(temperature=0, max_tokens=1,
                                                       logprobs=12))[0].logprobs[0]
        row = torch.full((1, 12), -float("inf"))
        for t, lp in logits.items():
            row[0, t] = lp
        row = row / params.temperature
        threshold = filter_threshold(row, [params])
        if threshold is not None:
            row = row.masked_fill(row < threshold, -float("inf"))
        return row.softmax(-1)[0].tolist()

    with LLM(path, **ENGINE) as llm:
        first = dist(llm, prompt)
        return {(a, b): first[a] * pb for a in range(12) if first[a] > 0
                for b, pb in enumerate(dist(llm, prompt + [a])) if pb > 0}


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True),
    SamplingParams(temperature=0.7, top_k=5, max_tokens=3, ignore_eos=True)])
def test_sampled_speculation_keeps_the_target_distribution(tiny_vocab, params, monkeypatch):
    """20k draws of (t1, t2, t3): t2 is drafted by ngram (the prompt repeats, so most t1 have a
    draft) and verified; the pairs (t1, t2) follow plain sampling's p(t1) p(t2 | t1). Plain
    acceptance (keeping every draft) fails the same test."""
    prompt = [3, 4, 5, 3, 4, 5, 3, 4, 5, 3, 4, 5, 3, 4, 5, 6, 7, 8, 9, 10, 11] * 2
    probs = _exact_pairs(tiny_vocab, prompt, params)
    engine = {**ENGINE, "num_kv_blocks": 400, "max_num_seqs": 256,
              "max_num_batched_tokens": 4096}
    n = 20_000
    spec = {"method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_min": 1}
    with LLM(tiny_vocab, speculative_config=spec, seed=3, **engine) as llm:
        counts = _sampled_pairs(llm, prompt, params, n)
        done = list(llm.engine.finished_requests)
        assert sum(r.num_draft_tokens for r in done) > 0
        assert _chi_square_p(counts, probs, n) > 0.01

        def accept_all(rows, drafts, *args):
            return drafts + [int(rows[len(drafts)].argmax())]

        monkeypatch.setattr(spec_verify, "_sampled", accept_all)
        assert _chi_square_p(_sampled_pairs(llm, prompt, params, n), probs, n) < 0.01


def test_the_accept_rule_with_a_drafter_distribution_keeps_the_target_distribution():
    """Drafts drawn from q (not one-hot): the first emitted token follows p_0."""
    gen = torch.Generator().manual_seed(0)
    vocab, n = 6, 20_000
    logits = torch.randn(2, vocab, generator=gen)
    q = torch.randn(1, vocab, generator=gen).softmax(-1)
    p0 = logits[0].softmax(-1).tolist()

    class R:
        sampling_params = SamplingParams(temperature=1.0)
        prompt_token_ids, output_token_ids, eos_token_ids = [1], [], frozenset()

    counts: dict = {}
    for _ in range(n):
        draft = int(torch.multinomial(q[0], 1, generator=gen))
        (v,) = spec_verify.verify(logits.clone(), [R()], [[draft]], lambda r, d: gen,
                                  draft_probs=[q])
        counts[v.token_ids[0]] = counts.get(v.token_ids[0], 0) + 1
    assert _chi_square_p(counts, dict(enumerate(p0)), n) > 0.01


def test_ngram_lookup_proposes_what_followed_the_latest_match():
    assert ngram_lookup([1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3], 3, 1, 3) == [5, 7, 1]
    assert ngram_lookup([1, 2, 3, 4], 2, 2, 3) == []
    assert ngram_lookup([4, 8, 4], 3, 1, 2) == [8, 4]
    rng = random.Random(0)  # against a plain search of every earlier window, latest first
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        min_n, n = rng.randrange(1, 4), rng.randrange(1, 5)
        max_n = min_n + rng.randrange(3)
        want = []
        for size in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
            ends = [i + size for i in range(len(tokens) - size)
                    if tokens[i:i + size] == tokens[-size:]]
            if ends:
                want = tokens[ends[-1]:ends[-1] + n]
                break
        assert ngram_lookup(tokens, n, min_n, max_n) == want, (tokens, n, min_n, max_n)
    # a request's tokens kept as a growing array: the same proposals as its list, step by step
    arrays, request = TokenArrays(), Request("r", [rng.randrange(3) for _ in range(5)],
                                             SamplingParams())
    for _ in range(200):
        request.all_token_ids.extend(rng.randrange(3) for _ in range(rng.randrange(1, 4)))
        assert ngram_lookup(arrays.of(request), 3, 1, 3) == \
            ngram_lookup(request.all_token_ids, 3, 1, 3)
    arrays.release(request)
    assert not arrays._arrays


def test_bad_speculative_configs_fail_at_start_up_naming_the_field(ckpt, tiny_checkpoint,
                                                                   tmp_path):
    for spec, field in (({"method": "eagle", "num_speculative_tokens": 0}, "num_speculative"),
                        ({"method": "eagle", "num_speculative_tokens": 17}, "num_speculative"),
                        ({"method": "medusa"}, "method"),
                        ({"num_speculative_tokens": 2}, "method"),
                        ({"method": "ngram", "k": 2}, "'k'"),
                        ({"method": "eagle", "min_draft_confidence": 1.0}, "min_draft_conf"),
                        ({"method": "eagle", "disable_by_batch_size": 0}, "disable_by_batch"),
                        ({"method": "eagle", "run_ahead": "no"}, "run_ahead"),
                        ({"method": "eagle", "lookup_first": 1}, "lookup_first"),
                        ({"method": "ngram", "lookup_first": True}, "lookup_first")):
        with pytest.raises(ValueError, match=field):
            LLM(ckpt, speculative_config=spec, **ENGINE)
    other = open_checkpoint(str(tiny_checkpoint("llama", hidden_size=96))).config
    save_head(init_head(other), str(tmp_path / "wide"))
    with pytest.raises(ModelLoadError, match="hidden_size"):
        LLM(ckpt, speculative_config={"method": "eagle", "model": str(tmp_path / "wide")},
            **ENGINE)
    other = open_checkpoint(str(tiny_checkpoint("llama", vocab_size=300))).config
    save_head(init_head(other), str(tmp_path / "vocab"))
    with pytest.raises(ModelLoadError, match="vocab_size"):
        LLM(ckpt, speculative_config={"method": "eagle", "model": str(tmp_path / "vocab")},
            **ENGINE)
