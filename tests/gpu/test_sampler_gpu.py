"""The sampler on CUDA against the same calls on CPU: top_p's cutoff (on CUDA a row whose 256
candidates fall short is sorted whole; on CPU the candidates grow 16x at a time), and greedy
tokens with logprobs through SampledTokens' pinned copies."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from mxserve.api.sampling_params import SamplingParams  # noqa: E402
from mxserve.worker.logits_ops import filter_threshold  # noqa: E402
from mxserve.worker.request import Request  # noqa: E402
from mxserve.worker.sampler import Sampler  # noqa: E402


@pytest.mark.parametrize("on_device", [False, True], ids=["host_check", "on_device"])
@pytest.mark.parametrize("scale", [0.01, 1.0, 8.0], ids=["flat", "normal", "peaked"])
def test_top_p_keeps_the_cpu_nucleus(scale, on_device):
    """Both CUDA paths: the cutoff decided on the device (top_p_on_device, on by default on
    CUDA: a whole-row radix search, top_k being off), and the candidates checked from the host."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 50000, generator=gen) * scale
    params = [SamplingParams(temperature=1.0, top_p=p) for p in (0.5, 0.9, 0.95, 0.99, 0.3, 1.0)]
    kept = {}
    for device in ("cpu", "cuda"):
        x = logits.to(device)
        kept[device] = (x >= filter_threshold(x, params, on_device)).sum(-1).cpu()
    # The same cutoff, but for a float-summation difference at the boundary token.
    assert ((kept["cuda"] - kept["cpu"]).abs() <= 1).all(), (kept["cpu"], kept["cuda"])
    assert kept["cpu"][-1] == 50000  # top_p = 1 keeps everything


@pytest.mark.parametrize("on_device", [False, True], ids=["host_check", "on_device"])
def test_top_p_with_top_k_rows_keeps_the_cpu_nucleus(on_device):
    """Rows with top_k on among top_p rows: on the device the candidates' check and the search
    past them (top_p_threshold_rows), the mass of top_k rows renormalized over their k."""
    logits = torch.randn(4, 50000, generator=torch.Generator().manual_seed(9)) * 0.01
    params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=k) for k in (20, -1, 300, -1)]
    kept = {d: (x >= filter_threshold(x, params, on_device)).sum(-1).cpu()
            for d, x in (("cpu", logits), ("cuda", logits.cuda()))}
    assert ((kept["cuda"] - kept["cpu"]).abs() <= 1).all(), kept
    assert kept["cpu"][0] <= 20 and kept["cpu"][2] <= 300 and kept["cpu"][1] > 300


def test_greedy_tokens_and_logprobs_match_the_cpu():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 32000, generator=gen) * 3
    params = SamplingParams(temperature=0, logprobs=4)
    outs = {}
    for device in ("cpu", "cuda"):
        requests = [Request(f"r{i}", [1, 2, 3], params) for i in range(5)]
        sampled = Sampler(0).sample(logits.to(device), requests)
        if device == "cuda":
            assert sampled.token_ids.is_cuda  # stays on the device for the next step's inputs
        outs[device] = sampled.result()
    assert outs["cuda"].token_ids == outs["cpu"].token_ids == logits.argmax(-1).tolist()
    for got, want in zip(outs["cuda"].logprobs, outs["cpu"].logprobs, strict=True):
        assert got.keys() == want.keys()
        assert all(abs(got[k] - want[k]) < 1e-4 for k in got)


def test_unseeded_draws_on_cuda_follow_the_nucleus(monkeypatch):
    """Rows without a seed take the fused race (sampling_ops.race_rows): over 20000 identical
    rows, temperature 0.7 and top_p 0.8, the tokens follow softmax(logits / 0.7) renormalized
    over the nucleus (Pearson's chi-square), none outside it; a seeded row in the batch takes
    the torch race and keeps its own draws."""
    from mxserve.kernels import sampling_ops

    calls = []
    real = sampling_ops.race_rows
    monkeypatch.setattr(sampling_ops, "race_rows", lambda *a: calls.append(1) or real(*a))
    base = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5, 3.0, -4.0, 2.5])
    draws = 20000
    params = SamplingParams(temperature=0.7, top_p=0.8)
    requests = [Request(f"r{i}", [1, 2, 3], params) for i in range(draws)]
    got = Sampler(0).sample(base.repeat(draws, 1).cuda(), requests).result().token_ids
    assert calls == [1]
    probs = (base.double() / 0.7).softmax(-1)
    order = probs.argsort(descending=True)
    before = probs[order].cumsum(0) - probs[order]
    nucleus = order[before < 0.8]
    want = torch.zeros_like(probs)
    want[nucleus] = probs[nucleus] / probs[nucleus].sum()
    counts = torch.bincount(torch.tensor(got), minlength=8).double()
    live = want > 0
    chi2 = ((counts[live] - draws * want[live]) ** 2 / (draws * want[live])).sum()
    assert chi2 < 30 and counts[~live].sum() == 0, (counts, want)
    seeded = SamplingParams(temperature=0.7, top_p=0.8, seed=4)
    alone = Sampler(0).sample(base.view(1, -1).cuda(), [Request("s", [1], seeded)]).result()
    mixed = Sampler(0).sample(base.repeat(3, 1).cuda(), [Request("a", [1], params),
                                                      Request("s", [1], seeded),
                                                      Request("b", [1], params)]).result()
    assert mixed.token_ids[1] == alone.token_ids[0]
