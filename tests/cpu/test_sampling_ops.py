"""kernels/sampling_ops.py under the Triton interpreter: the argmax against torch.argmax (the first
maximal index of each row, ties within and across chunks, -inf rows and masked tails), and top_p's
cutoff against the sampler's own (candidates that hold the mass, the whole-row search, ties,
top_k rows)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

from mxserve.api.sampling_params import SamplingParams  # noqa: E402
from mxserve.kernels.sampling_ops import (  # noqa: E402
    BLOCK,
    argmax_rows,
    race_rows,
    top_p_search_rows,
    top_p_threshold_rows,
)
from mxserve.worker.logits_ops import _top_p_threshold  # noqa: E402


@pytest.mark.parametrize("rows,vocab", [(1, 7), (3, BLOCK), (2, BLOCK + 1), (5, 3 * BLOCK - 17),
                                        (4, 49152)])
def test_argmax_rows_matches_torch_on_random_logits(rows, vocab):
    gen = torch.Generator().manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab, generator=gen)
    got = argmax_rows(logits, backend="triton")
    assert got.dtype == torch.long and torch.equal(got, logits.argmax(-1))


def test_argmax_rows_takes_the_first_of_tied_maxima_within_and_across_chunks():
    vocab = 3 * BLOCK + 5
    logits = torch.zeros(5, vocab)
    logits[0, [9, 2 * BLOCK + 1]] = 4.0  # across chunks: the first chunk's
    logits[1, [BLOCK + 3, BLOCK + 7]] = 4.0  # within a chunk
    logits[2] = float("-inf")  # nothing but -inf: index 0, as torch
    logits[3, -1] = 1.0  # the masked tail's last real entry
    logits[4, :] = 2.0  # all tied
    want = torch.tensor([9, BLOCK + 3, 0, vocab - 1, 0])
    assert torch.equal(logits.argmax(-1), want)
    assert torch.equal(argmax_rows(logits, backend="triton"), want)
    assert torch.equal(argmax_rows(logits[:0], backend="triton"), want[:0])


def test_argmax_rows_rejects_what_it_cannot_reduce():
    with pytest.raises(ValueError, match="2-D float"):
        argmax_rows(torch.zeros(4, dtype=torch.long).view(2, 2), backend="triton")
    with pytest.raises(ValueError, match="contiguous rows"):
        argmax_rows(torch.zeros(8, 4).t(), backend="triton")
    with pytest.raises(ValueError, match="empty"):
        argmax_rows(torch.zeros(3, 0), backend="triton")


def _close_to(counts: torch.Tensor, probs: torch.Tensor, draws: int) -> bool:
    """Pearson's chi-square of the counts against probs below 30 (p < 1e-5 for the <= 5
    degrees of freedom here); tokens with probability 0 must not come at all."""
    probs = probs.double()
    live = probs > 0
    chi2 = ((counts[live].double() - draws * probs[live]) ** 2 / (draws * probs[live])).sum()
    return bool(chi2 < 30) and int(counts[~live].sum()) == 0


def test_race_rows_draws_from_the_softmax_of_the_kept_tokens():
    """Identical rows are independent draws: their frequencies follow softmax(logits) over the
    tokens at or above the threshold; none under it ever comes; the same seed repeats them."""
    draws, base = 800, torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5, 3.0])
    logits = base.repeat(draws, 1)
    got = race_rows(logits, None, seed=11)
    assert got.dtype == torch.long and got.shape == (draws,)
    assert _close_to(torch.bincount(got, minlength=6), base.double().softmax(-1), draws)
    # Philox: the same key and counters (row * V + i) repeat the draws, another key does not
    assert torch.equal(race_rows(logits[:100], None, seed=11), got[:100])
    assert (race_rows(logits[:100], None, seed=12) != got[:100]).float().mean() > 0.3
    kept = torch.full((draws, 1), 1.0)  # tokens 1, 2, 5
    got = race_rows(logits, kept, seed=3)
    counts = torch.bincount(got, minlength=6)
    assert counts[[0, 3, 4]].sum() == 0
    want = torch.where(base >= 1.0, base, float("-inf")).double().softmax(-1)
    assert _close_to(counts, want, draws)


def test_race_rows_reads_a_seed_tensor_as_the_same_seed():
    """A seed held in an int32 tensor (a CUDA graph's input) draws what the same int draws, and
    the kernel reads the tensor when it runs."""
    logits = torch.randn(6, 5000, generator=torch.Generator().manual_seed(2))
    seed = torch.tensor([123], dtype=torch.int32)
    kept = logits.topk(40, dim=-1).values[:, -1:]
    assert torch.equal(race_rows(logits, kept, seed), race_rows(logits, kept, 123))
    seed.fill_(124)
    assert torch.equal(race_rows(logits, None, seed), race_rows(logits, None, 124))
    assert not torch.equal(race_rows(logits, None, seed), race_rows(logits, None, 123))


def test_race_rows_across_chunks_and_masked_tokens():
    draws, vocab = 150, 2 * BLOCK + 5
    logits = torch.full((draws, vocab), float("-inf"))
    logits[:, [3, BLOCK + 52, vocab - 1]] = torch.tensor([0.0, 0.5, 1.0])
    got = race_rows(logits, None, seed=5)
    counts = torch.bincount(got, minlength=vocab)
    assert counts.sum() == counts[[3, BLOCK + 52, vocab - 1]].sum()  # only the real tokens
    assert _close_to(counts[[3, BLOCK + 52, vocab - 1]], torch.tensor([0.0, 0.5, 1.0]).double()
                     .softmax(-1), draws)


def test_race_rows_rejects_what_it_cannot_draw_from():
    with pytest.raises(ValueError, match="fp32 logits"):
        race_rows(torch.zeros(2, 10, dtype=torch.float16), None, 0)
    with pytest.raises(ValueError, match="contiguous rows"):
        race_rows(torch.zeros(10, 4).t(), None, 0)
    assert race_rows(torch.zeros(0, 10), None, 0).shape == (0,)


def _sampler_inputs(logits, top_p, top_k=None):
    """values, log_total, top_p and whole as worker/sampler.py's top_p step builds them."""
    vocab = logits.shape[1]
    values = logits.topk(min(256, vocab), dim=-1).values
    log_total = logits.logsumexp(-1, keepdim=True)
    whole = torch.ones(logits.shape[0], dtype=torch.bool)
    if top_k is not None:  # rows with top_k on: candidates past k masked, mass over the k
        for i, k in enumerate(top_k):
            if k is not None:
                values[i, k:] = float("-inf")
                log_total[i] = values[i, :k].logsumexp(-1)
                whole[i] = False
    return values, log_total, torch.tensor(top_p).view(-1, 1), whole


@pytest.mark.parametrize("scale", [0.01, 1.0, 8.0], ids=["flat", "normal", "peaked"])
@pytest.mark.parametrize("vocab", [5000, 300])
def test_top_p_threshold_rows_keeps_the_samplers_nucleus(scale, vocab):
    """The kernel's cutoff against the sampler's own (candidates grown 16x at a time on CPU):
    flat rows send every top_p < 1 past the 256 candidates (the whole-row search), peaked
    ones stay within them; the vocabulary spans several search chunks and a masked tail."""
    gen = torch.Generator().manual_seed(vocab + int(scale * 100))
    top_p = [0.5, 0.9, 0.95, 0.99, 0.3, 1.0]
    logits = torch.randn(len(top_p), vocab, generator=gen) * scale
    values, log_total, p, whole = _sampler_inputs(logits, top_p)
    want = _top_p_threshold(logits, values.clone(), log_total,
                            [SamplingParams(temperature=1.0, top_p=q) for q in top_p])
    got = top_p_threshold_rows(logits, values, log_total, p, whole, backend="triton")
    kept_want, kept_got = (logits >= want).sum(-1), (logits >= got).sum(-1)
    # the same cutoff, but for a float-summation difference at the boundary token
    assert ((kept_got - kept_want).abs() <= 1).all(), (kept_want, kept_got)
    assert kept_got[-1] == vocab and torch.isinf(got[-1]).all()  # top_p = 1: everything
    if scale == 0.01:  # the search ran: its cutoff is a logit of the row
        assert all((logits[i] == got[i]).any() for i in range(len(top_p) - 1))
    assert torch.equal(top_p_threshold_rows(logits, values, log_total, p, whole), want) or \
        ((logits >= top_p_threshold_rows(logits, values, log_total, p, whole)).sum(-1)
         - kept_want).abs().max() <= 1  # the torch path (CPU default) agrees too


def test_top_p_threshold_rows_keeps_ties_and_respects_top_k():
    vocab = 1000
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(5))
    logits[0] = 0.0  # all tied, past the candidates: the cutoff is their value, all kept
    logits[1, :600] = 2.0  # 600 tied at the top hold > 0.5: all 600 kept
    logits[1, 600:] = logits[1, 600:].clamp(max=1.0)
    values, log_total, p, whole = _sampler_inputs(logits, [0.5, 0.5, 0.9, 0.9],
                                                  top_k=[None, None, 5, None])
    got = top_p_threshold_rows(logits, values, log_total, p, whole, backend="triton")
    kept = (logits >= got).sum(-1)
    assert kept[0] == vocab and kept[1] == 600
    assert 1 <= kept[2] <= 5  # top_k's 5 hold all of row 2's mass: its cutoff is among them
    assert (logits[2] >= got[2]).sum() == ((values[2, :5] >= got[2]).sum())


@pytest.mark.parametrize("scale", [0.01, 1.0, 8.0], ids=["flat", "normal", "peaked"])
@pytest.mark.parametrize("vocab", [5000, 300, 1024])
def test_top_p_search_rows_keeps_the_samplers_nucleus(scale, vocab):
    """The candidate-free search (its own softmax denominator, every row with top_p < 1
    searched) against the sampler's cutoff: a logit of the row, the same nucleus but for a
    float-summation difference at the boundary token; top_p = 1 keeps all."""
    gen = torch.Generator().manual_seed(vocab + int(scale * 100) + 1)
    top_p = [0.5, 0.9, 0.95, 0.99, 0.3, 1.0, 1e-6]
    logits = torch.randn(len(top_p), vocab, generator=gen) * scale
    values, log_total, p, _ = _sampler_inputs(logits, top_p)
    want = _top_p_threshold(logits, values.clone(), log_total,
                            [SamplingParams(temperature=1.0, top_p=q) for q in top_p])
    got = top_p_search_rows(logits, p, backend="triton")
    kept_want, kept_got = (logits >= want).sum(-1), (logits >= got).sum(-1)
    assert ((kept_got - kept_want).abs() <= 1).all(), (kept_want, kept_got)
    assert kept_got[5] == vocab and torch.isinf(got[5]).all()
    assert kept_got[6] == 1  # a tiny top_p: the top token alone
    assert all((logits[i] == got[i]).any() for i in range(len(top_p)) if i != 5)
    torch_rule = top_p_search_rows(logits, p)  # CPU default: the torch rule
    assert ((logits >= torch_rule).sum(-1) - kept_want).abs().max() <= 1


def test_top_p_search_rows_keeps_ties_and_masked_logits():
    vocab = 1500
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(8))
    logits[0] = 0.0  # all tied: the cutoff is their value, all kept
    logits[1, :600] = 2.0  # 600 tied at the top hold > 0.5 of the mass: all 600 kept
    logits[1, 600:] = logits[1, 600:].clamp(max=1.0)
    logits[2, 100:] = float("-inf")  # masked tokens (min_tokens, a bad-words list) never count
    got = top_p_search_rows(logits, torch.tensor([[0.5], [0.5], [0.999]]), backend="triton")
    kept = (logits >= got).sum(-1)
    assert kept[0] == vocab and kept[1] == 600 and 1 <= kept[2] <= 100
    assert torch.isfinite(got).all()


def test_top_p_threshold_rows_rejects_what_it_cannot_read():
    with pytest.raises(ValueError, match="fp32 logits"):
        top_p_threshold_rows(torch.zeros(2, 10, dtype=torch.float64), torch.zeros(2, 3),
                             torch.zeros(2, 1), torch.ones(2, 1), torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="values"):
        top_p_threshold_rows(torch.zeros(2, 10), torch.zeros(2, 11), torch.zeros(2, 1),
                             torch.ones(2, 1), torch.ones(2, dtype=torch.bool))


# Compiled in a subprocess (tests/cpu run kernels in the interpreter, which also takes code the
# compiler refuses, e.g. a plain global read in a kernel): the top_p kernels build for sm_90.
COMPILE = r"""
from mxserve.kernels import sampling_ops

I32 = ("need_ptr", "prefix_ptr", "part_idx_ptr", "seed_ptr")
kernels = [(sampling_ops._top_p_candidates_kernel, dict(BLOCK_C=256)),
           (sampling_ops._row_stats_kernel, dict(BLOCK=1024)),
           (sampling_ops._chunk_argmax_kernel, dict(RACE=True, HAS_THR=True, SEED_PTR=False,
                                                    BLOCK=2048)),
           (sampling_ops._chunk_argmax_kernel, dict(RACE=True, HAS_THR=False, SEED_PTR=True,
                                                    BLOCK=2048)),
           (sampling_ops._chunk_argmax_kernel, dict(RACE=False, HAS_THR=False, SEED_PTR=False,
                                                    BLOCK=2048)),
           (sampling_ops._top_p_level_kernel, dict(LEVEL=0, BITS=4, BLOCK=1024, BLOCK_C=128,
                                                   FROM_TOP_P=True)),
           (sampling_ops._top_p_level_kernel, dict(LEVEL=3, BITS=4, BLOCK=1024, BLOCK_C=128,
                                                   FROM_TOP_P=False)),
           (sampling_ops._top_p_finish_kernel, dict(LEVELS=8, BITS=4, BLOCK_C=128,
                                                    UNSEARCHED_INF=True)),
           (sampling_ops._top_p_finish_kernel, dict(LEVELS=8, BITS=4, BLOCK_C=128,
                                                    UNSEARCHED_INF=False))]
types = {"whole_ptr": "*i8", **{name: "*i32" for name in I32}}
for fn, const in kernels:
    kernel, _ = compile_for(fn, const, types, pointer="*fp32")
    assert kernel.asm.get("cubin")
print("sass")
"""


def test_top_p_kernel_compiles_for_the_gpu(compile_outside_interpreter):
    assert compile_outside_interpreter(COMPILE, 600) == "sass"
