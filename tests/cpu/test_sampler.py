"""Sampler tests. Every expected value comes from a reference written here (plain Python/math), not
from the sampler's own helpers; distribution checks use tolerances derived from the sample count."""

from __future__ import annotations

import math
import random

import pytest
import torch

from mxserve.api.sampling_params import SamplingParams
from mxserve.worker.logits_ops import apply_penalties, filter_threshold
from mxserve.worker.request import Request
from mxserve.worker.sampler import Sampler

# --- references --------------------------------------------------------------------------------


def softmax_ref(logits: list[float], temperature: float = 1.0) -> list[float]:
    scaled = [x / temperature for x in logits]
    top = max(scaled)
    exps = [math.exp(x - top) for x in scaled]
    total = sum(exps)
    return [e / total for e in exps]


def log_softmax_ref(logits: list[float]) -> list[float]:
    top = max(logits)
    log_total = top + math.log(sum(math.exp(x - top) for x in logits))
    return [x - log_total for x in logits]


def argmax_ref(values: list[float]) -> int:
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:  # strict: ties keep the lowest id
            best = i
    return best


def top_p_kept_ref(probs: list[float], top_p: float) -> set[int]:
    """Smallest set, by descending prob, whose mass reaches top_p."""
    kept, mass = set(), 0.0
    for i in sorted(range(len(probs)), key=lambda i: -probs[i]):
        kept.add(i)
        mass += probs[i]
        if mass >= top_p:
            break
    return kept


def penalize_ref(logits, prompt, output, rep, presence, frequency) -> list[float]:
    out = []
    for token, x in enumerate(logits):
        if token in prompt or token in output:
            x = x / rep if x > 0 else x * rep
        count = output.count(token)
        x -= frequency * count
        if count:
            x -= presence
        out.append(x)
    return out


# --- helpers -----------------------------------------------------------------------------------


def make_request(rid="r", prompt=(1, 2, 3), outputs=(), eos=(), **params) -> Request:
    r = Request(rid, list(prompt), SamplingParams(**params), eos_token_ids=frozenset(eos))
    for t in outputs:
        r.append_output(t)
    return r


def sample_many(logits: list[float], num_samples: int, seed: int = 0,
                top_p_on_device: bool | None = None, **params) -> list[int]:
    """num_samples draws for one row of logits, in batches of 1000 identical unseeded requests."""
    sampler, out = Sampler(seed=seed, top_p_on_device=top_p_on_device), []
    requests = [make_request(str(i), **params) for i in range(1000)]
    row = torch.tensor(logits, dtype=torch.float32)
    for _ in range(num_samples // 1000):
        out += sampler(row.repeat(1000, 1), requests).token_ids
    return out


# --- greedy ------------------------------------------------------------------------------------


def test_greedy_is_argmax():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 1000, generator=gen)
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1  # a tie: the lower id wins
    rows = logits.tolist()
    requests = [make_request(str(i), temperature=0.0) for i in range(8)]
    out = Sampler()(logits.clone(), requests)
    assert out.token_ids == [argmax_ref(r) for r in rows]
    assert out.token_ids[3] == 10
    assert out.logprobs == [None] * 8


def test_top_k_1_is_greedy():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(16, 500, generator=gen) * 3
    rows = logits.tolist()
    requests = [make_request(str(i), temperature=1.3, top_k=1) for i in range(16)]
    sampler = Sampler(seed=5)
    for _ in range(5):
        assert sampler(logits.clone(), requests).token_ids == [argmax_ref(r) for r in rows]


# --- distribution and filters ------------------------------------------------------------------


def test_distribution_matches_tempered_softmax():
    logits = [0.0, 0.5, 1.0, 1.5, 2.0, -1.0, 0.2, 2.5]
    n = 40_000
    counts = [0] * len(logits)
    for t in sample_many(logits, n, temperature=0.7):
        counts[t] += 1
    expected = softmax_ref(logits, 0.7)
    chi2 = sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, expected, strict=True))
    assert chi2 < 30.0  # chi-square, 7 degrees of freedom: P(chi2 > 30) ~ 1e-4
    for c, p in zip(counts, expected, strict=True):
        assert abs(c / n - p) < 5 * math.sqrt(p * (1 - p) / n)


# Probabilities in shuffled order so kept sets are not just a prefix of ids.
PROBS = [0.05, 0.3, 0.1, 0.4, 0.15]  # descending: id 3, 1, 4, 2, 0


@pytest.mark.parametrize(
    ("params", "kept"),
    [
        ({"top_k": 2}, {3, 1}),
        ({"top_k": -1}, {0, 1, 2, 3, 4}),  # -1 and 0 turn top_k off
        ({"top_k": 0, "top_p": 1.0, "min_p": 0.0}, {0, 1, 2, 3, 4}),
        ({"top_k": 4}, {3, 1, 4, 2}),
        ({"top_p": 0.75}, top_p_kept_ref(PROBS, 0.75)),  # {3, 1, 4}: 0.4 + 0.3 < 0.75
        ({"top_p": 0.65}, top_p_kept_ref(PROBS, 0.65)),  # {3, 1}
        ({"top_p": 0.01}, {3}),  # the top token always survives
        ({"min_p": 0.3}, {i for i, p in enumerate(PROBS) if p >= 0.3 * max(PROBS)}),
        ({"min_p": 0.2}, {i for i, p in enumerate(PROBS) if p >= 0.2 * max(PROBS)}),
        # top_p over what top_k kept, renormalized: 0.4/0.85 + 0.3/0.85 >= 0.8, so {3, 1}.
        ({"top_k": 3, "top_p": 0.8}, {3, 1}),
        ({"top_k": 4, "min_p": 0.3, "top_p": 0.99}, {3, 1, 4}),
    ],
)
@pytest.mark.parametrize("on_device", [False, True], ids=["host_check", "on_device"])
def test_filters_keep_exactly_the_allowed_tokens(params, kept, on_device):
    """Both top_p paths: candidates grown from the host, and the device rule (top_p_on_device:
    kernels/sampling_ops' cutoff, here its torch form), wired with top_k's survivors."""
    logits = [math.log(p) for p in PROBS]
    emitted = set(sample_many(logits, 4000, top_p_on_device=on_device, temperature=1.0,
                              **params))
    assert emitted == kept


@pytest.mark.parametrize("on_device", [False, True], ids=["host_check", "on_device"])
def test_top_p_on_a_large_vocab_matches_reference(on_device):
    # A flat row needs thousands of tokens to reach top_p, more than the first candidate pass holds.
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(3, 5000, generator=gen) * 0.5).tolist()
    params, expected = [], []
    for row, m in zip(logits, (2000, 40, 4990), strict=True):
        probs = sorted(softmax_ref(row), reverse=True)
        mass_m_minus_1, mass_m = sum(probs[:m]), sum(probs[: m + 1])
        top_p = (mass_m_minus_1 + mass_m) / 2  # keeps exactly the m+1 largest, far from a boundary
        params.append(SamplingParams(top_p=top_p))
        expected.append(set(sorted(range(len(row)), key=lambda i, r=row: -r[i])[: m + 1]))
    logits = torch.tensor(logits)
    survives = logits >= filter_threshold(logits, params, on_device)
    for row, kept in zip(survives, expected, strict=True):
        assert set(row.nonzero().flatten().tolist()) == kept


# --- seeds -------------------------------------------------------------------------------------


def _run_seeded(seed: int, num_others: int, position: int, steps: int = 12) -> list[int]:
    """The seeded request's tokens when batched with num_others unseeded/other-seeded requests."""
    params = dict(temperature=0.9, top_p=0.95, top_k=200, min_p=0.01)
    target = make_request("target", seed=seed, **params)
    others_params = [
        dict(temperature=0.0),
        dict(temperature=1.0),
        dict(temperature=0.5, top_p=0.999),  # a flat row: its top_p needs a full sort
        dict(temperature=1.2, seed=seed + 1, top_k=5),
        dict(temperature=0.7, min_p=0.1, repetition_penalty=1.3),
    ]
    others = [make_request(f"o{i}", **others_params[i % 5]) for i in range(num_others)]
    batch = others[:position] + [target] + others[position:]
    sampler = Sampler(seed=100 + num_others)
    gen = torch.Generator().manual_seed(7)  # the target's logits are the same in every run
    noise = torch.Generator().manual_seed(num_others)
    tokens = []
    for _ in range(steps):
        target_row = torch.randn(1, 2000, generator=gen) * 2
        logits = torch.randn(len(batch), 2000, generator=noise) * 0.2
        logits[position] = target_row
        token = sampler(logits, batch).token_ids[position]
        tokens.append(token)
        for r in batch:
            r.append_output(token)
    return tokens


def test_seeded_request_is_independent_of_its_batch():
    alone = _run_seeded(seed=42, num_others=0, position=0)
    assert _run_seeded(seed=42, num_others=0, position=0) == alone
    assert _run_seeded(seed=42, num_others=4, position=2) == alone
    assert _run_seeded(seed=42, num_others=9, position=9) == alone
    assert _run_seeded(seed=43, num_others=0, position=0) != alone


# --- penalties and min_tokens ------------------------------------------------------------------


def test_penalties_match_reference():
    vocab = 40
    rng = random.Random(4)
    cases = [  # (prompt, output, repetition, presence, frequency)
        ([1, 2, 3, 3], [3, 5, 5, 7], 1.5, 0.0, 0.0),
        ([0, 9], [9, 9, 9, 12], 1.0, 0.7, 0.0),
        ([4], [4, 4, 11, 30, 30], 1.0, 0.0, 0.4),
        ([6, 8, 39], [8, 8, 1, 2, 2, 2], 1.2, -0.5, 1.1),
        ([5, 6], [7, 8], 1.0, 0.0, 0.0),  # no penalties: row must stay as it was
        ([], [], 0.8, 0.3, 0.3),  # nothing seen yet: unchanged
    ]
    rows = [[rng.uniform(-4, 4) for _ in range(vocab)] for _ in cases]
    requests = [
        make_request(str(i), prompt=p, outputs=o, repetition_penalty=rep,
                     presence_penalty=pres, frequency_penalty=freq)
        for i, (p, o, rep, pres, freq) in enumerate(cases)
    ]
    logits = torch.tensor(rows)
    apply_penalties(logits, requests)
    for got, row, (p, o, rep, pres, freq) in zip(logits.tolist(), rows, cases, strict=True):
        assert got == pytest.approx(penalize_ref(row, p, o, rep, pres, freq), abs=1e-5)
    assert logits[4].tolist() == torch.tensor(rows[4]).tolist()


def test_greedy_with_penalties_picks_argmax_of_penalized_logits():
    row = [3.0, 2.9, -1.0, 2.5, 0.1]
    r = make_request(prompt=[0], outputs=[1, 1], temperature=0.0,
                     repetition_penalty=1.3, frequency_penalty=0.3)
    expected = argmax_ref(penalize_ref(row, [0], [1, 1], 1.3, 0.0, 0.3))
    assert expected == 3  # 3.0/1.3 = 2.31 and 2.9/1.3 - 0.6 = 1.63 both fall below 2.5
    assert Sampler()(torch.tensor([row]), [r]).token_ids == [expected]


def test_min_tokens_blocks_eos_and_stop_ids():
    row = [0.0, 1.0, 0.5, 9.0, 0.2, 8.0]  # EOS (3) and the stop id (5) are the likeliest
    params = dict(min_tokens=2, stop_token_ids=[5], temperature=0.0)
    sampler = Sampler()
    young = make_request(outputs=[1], eos=[3], **params)
    assert sampler(torch.tensor([row]), [young]).token_ids == [1]
    grown = make_request(outputs=[1, 1], eos=[3], **params)
    assert sampler(torch.tensor([row]), [grown]).token_ids == [3]
    ignoring = make_request(outputs=[], eos=[3], ignore_eos=True, **params)
    assert sampler(torch.tensor([row]), [ignoring]).token_ids == [3]  # EOS is not a stop then
    no_eos_row = [0.0, 1.0, 0.5, 0.0, 0.2, 8.0]
    assert sampler(torch.tensor([no_eos_row]), [ignoring]).token_ids == [1]  # stop id still is
    # Sampled at temperature 1, EOS and the stop id never come while min_tokens is unmet.
    assert set(sample_many(row, 2000, eos=[3], min_tokens=3, stop_token_ids=[5])) == {0, 1, 2, 4}


# --- logprobs and mixed batches ----------------------------------------------------------------


def test_logprobs_come_from_raw_logits():
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(3, 300, generator=gen) * 2
    rows = logits.tolist()
    requests = [
        make_request("a", logprobs=3, temperature=0.6, top_k=20, repetition_penalty=1.4,
                     outputs=[argmax_ref(rows[0])]),
        make_request("b", logprobs=0, temperature=0.0),
        make_request("c", temperature=1.0),
    ]
    out = Sampler()(logits, requests)
    for i, n in ((0, 3), (1, 0)):
        ref = log_softmax_ref(rows[i])
        top_ids = sorted(range(len(ref)), key=lambda t: -ref[t])[:n]
        lps = out.logprobs[i]
        assert set(lps) == set(top_ids) | {out.token_ids[i]}
        for token, lp in lps.items():
            assert lp == pytest.approx(ref[token], abs=1e-4)
    assert out.logprobs[2] is None


def test_mixed_batch_of_greedy_and_sampled_rows():
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(4, 100, generator=gen)
    rows = logits.tolist()
    requests = [
        make_request("g0", temperature=0.0),
        make_request("s1", temperature=1.0, top_k=2),
        make_request("g2", temperature=0.0),
        make_request("s3", temperature=2.0, top_k=2, seed=1),
    ]
    top2 = [set(sorted(range(100), key=lambda t, r=r: -r[t])[:2]) for r in rows]
    sampler, seen = Sampler(), [set() for _ in rows]
    for _ in range(200):
        out = sampler(logits.clone(), requests).token_ids
        assert out[0] == argmax_ref(rows[0]) and out[2] == argmax_ref(rows[2])
        for i in (1, 3):
            seen[i].add(out[i])
    assert seen[1] == top2[1] and seen[3] == top2[3]


def test_unseeded_sampler_is_reproducible_from_its_seed():
    logits = torch.zeros(4, 1000)
    requests = [make_request(str(i)) for i in range(4)]
    a = Sampler(seed=9)(logits.clone(), requests).token_ids
    assert Sampler(seed=9)(logits.clone(), requests).token_ids == a
    assert Sampler(seed=10)(logits.clone(), requests).token_ids != a


# --- the sampler's graph of a static logits buffer (run as it is on CPU; replays: tests/gpu) ----


def test_sample_graph_takes_eligible_batches_and_draws_the_fused_race():
    """A batch whose logits are the first rows of a buffer with a SampleGraph, every row
    sampled the common way, goes through it: temperature, top_p cutoff and race of those rows
    as the kernels draw them with this call's seed (the rows past the batch do not matter);
    a greedy row, a seed, top_k, min_p, logits that are not the buffer's start or top_p kept
    off the device do not."""
    from mxserve.kernels.sampling_ops import race_rows, top_p_search_rows
    from mxserve.worker.sampler_graphs import SampleGraph

    gen = torch.Generator().manual_seed(4)
    with torch.inference_mode():  # as the decode graphs' buffers
        buffer = torch.randn(4, 3000, generator=gen) * 3
    sampler = Sampler(seed=5)
    sampler._graphs[buffer.data_ptr()] = SampleGraph(buffer)
    params = [dict(temperature=0.7, top_p=0.9), dict(temperature=1.3), dict(top_p=0.5)]
    for step in range(3):
        with torch.inference_mode():
            buffer.copy_(torch.randn(4, 3000, generator=gen) * 3)
        logits = buffer[:3]
        before = logits.clone()
        requests = [make_request(str(i), **p) for i, p in enumerate(params)]
        with torch.inference_mode():  # as the engine samples
            got = sampler.sample(logits, requests, static=buffer).result().token_ids
        assert sampler.num_graph_samples == step + 1
        temps = torch.tensor([[0.7], [1.3], [1.0]])
        scaled = before / temps
        cut = top_p_search_rows(scaled, torch.tensor([[0.9], [1.0], [0.5]]))
        seed = (5 * 1000003 + step + 1) % 2**31
        assert got == race_rows(scaled, cut, seed).tolist()
    for other in (dict(temperature=0.0), dict(seed=3), dict(top_k=20), dict(min_p=0.1)):
        requests = [make_request("a", top_p=0.9), make_request("b", **other)]
        with torch.inference_mode():
            sampler.sample(buffer[:2], requests, static=buffer).result()
        assert sampler.num_graph_samples == 3, other
    with torch.inference_mode():
        two = [make_request("a"), make_request("b")]
        sampler.sample(buffer[1:3], two, static=buffer).result()
        sampler.sample(buffer[:2].clone(), two).result()
        sampler.top_p_on_device = False
        sampler.sample(buffer[:2], two, static=buffer).result()
    assert sampler.num_graph_samples == 3


def test_argmax_graph_takes_plain_greedy_batches_of_its_buffer():
    """A plain-greedy batch whose logits are the first rows of a buffer with an ArgmaxGraph
    gets its tokens from it (each row's first maximal index, the rows past the batch unread);
    a batch with min_tokens still to go or a sampled row, logits that are not the buffer's
    start, a copy, or `graphs` off take the eager paths, with the same tokens."""
    from mxserve.worker.sampler_graphs import ArgmaxGraph

    gen = torch.Generator().manual_seed(6)
    with torch.inference_mode():
        buffer = torch.randn(5, 700, generator=gen)
        buffer[1, 3] = buffer[1, 9] = buffer[1].max() + 1  # a tie: the first index wins
    sampler = Sampler(seed=1)
    sampler._argmax_graphs[buffer.data_ptr()] = ArgmaxGraph(buffer)
    greedy = [make_request(str(i), temperature=0.0) for i in range(3)]
    with torch.inference_mode():
        got = sampler.sample(buffer[:3], greedy, static=buffer).result().token_ids
    assert got == buffer[:3].argmax(-1).tolist() and got[1] == 3
    assert sampler.num_graph_samples == 1
    with torch.inference_mode():
        eager = [sampler.sample(buffer[1:4], greedy, static=buffer),
                 sampler.sample(buffer[:3].clone(), greedy, static=buffer),
                 sampler.sample(buffer[:3], greedy),
                 sampler.sample(buffer[:3], greedy[:2] + [make_request(  # its EOS: a low logit
                     "m", temperature=0.0, min_tokens=2, eos=(int(buffer[2].argmin()),))],
                     static=buffer)]
        sampler.graphs = False
        eager.append(sampler.sample(buffer[:3], greedy, static=buffer))
    assert [e.result().token_ids for e in eager] == [buffer[1:4].argmax(-1).tolist()] + [got] * 4
    assert sampler.num_graph_samples == 1
