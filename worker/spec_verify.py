"""Speculative verify: which of a request's drafted tokens it keeps, and the one token more.

A request with drafts x_1..x_d was computed for d + 1 positions in one pass; logits row i is the
target's next-token distribution p_i after the known tokens and x_1..x_i (row 0: after the known
tokens alone). Each row is processed as the sampler would process it had x_1..x_i already been
output (min_tokens, penalties; then temperature, top-k/top-p/min-p), so p_i is exactly the
distribution plain decoding would draw from at that point.

    greedy:   keep x_i while x_i == argmax p_{i-1}; then add argmax p_a (a = drafts kept).
    sampled:  for i = 1..d: keep x_i with probability min(1, p_{i-1}(x_i) / q_i(x_i));
              at the first rejection draw from normalize(max(0, p_{i-1} - q_i)) and stop;
              with all d kept, draw the bonus token from p_d.

q_i is the drafter's distribution for x_i; a drafter that picks tokens deterministically
(ngram, argmax EAGLE) has q_i one-hot at x_i, so x_i is kept with probability p(x_i) and a
rejection draws from p with x_i removed. Either way every emitted token is distributed as plain
decoding's (Leviathan et al. 2023, speculative sampling). Draws use the request's own generator
when it has a seed, so seeded outputs are reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mxserve.api.sampling_params import SamplingParams
from mxserve.worker import draft_tree
from mxserve.worker.logits_ops import apply_min_tokens, apply_penalties, filter_threshold
from mxserve.worker.request import Request
from mxserve.worker.sampler import Sampler
from mxserve.worker.scheduler import ScheduledRequest


@dataclass
class Verified:
    """One request's verify: the tokens it emits (kept drafts, then one more) and their
    logprobs (raw target distribution; None unless asked)."""

    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    num_drafts: int
    kept: list[int] | None = None  # a draft tree's kept nodes (None: a chain's first ones)

    @property
    def num_accepted(self) -> int:
        return len(self.token_ids) - 1


@dataclass
class VerifiedTokens:
    """A step's tokens when some request verified drafts: entry i belongs to the plan's i-th
    sampling request, a token (and its logprobs dict) for one without drafts, a Verified for one
    with. Already on the host (the engine steps synchronously under speculation)."""

    token_ids: list
    logprobs: list

    def result(self) -> VerifiedTokens:
        return self


def verify_plan(logits: torch.Tensor, sampling: list[ScheduledRequest],
                sampler: Sampler) -> VerifiedTokens:
    """The tokens of a step whose plan verifies drafts. logits: [rows, vocab], 1 + drafts rows
    for each sampling request in plan order. Requests without drafts sample as usual."""
    first, at = [], 0
    for s in sampling:
        first.append(at)
        at += 1 + s.num_draft_tokens
    tokens: list = [None] * len(sampling)
    lps: list = [None] * len(sampling)
    plain = [i for i, s in enumerate(sampling) if not s.num_draft_tokens]
    if plain:
        out = sampler.sample(logits[[first[i] for i in plain]],
                             [sampling[i].request for i in plain]).result()
        for i, t, lp in zip(plain, out.token_ids, out.logprobs):
            tokens[i], lps[i] = t, lp
    spec = [i for i, s in enumerate(sampling) if s.num_draft_tokens]
    if spec:
        rows = [first[i] + j for i in spec for j in range(1 + sampling[i].num_draft_tokens)]
        verified = verify(logits[rows], [sampling[i].request for i in spec],
                          [sampling[i].token_ids[-sampling[i].num_draft_tokens:] for i in spec],
                          sampler.generator_for, top_p_on_device=sampler.top_p_on_device,
                          parents=[sampling[i].draft_parents for i in spec])
        for i, v in zip(spec, verified):
            tokens[i], lps[i] = v.token_ids, v.logprobs
            sampling[i].kept_draft_rows = v.kept
    return VerifiedTokens(tokens, lps)


@dataclass(slots=True)
class _AsIfOutput:
    """A request as verify row i sees it: the drafts before that row already output."""

    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: frozenset[int]

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


def verify(logits: torch.Tensor, requests: list[Request], drafts: list[list[int]],
           generator_for, draft_probs: list[torch.Tensor | None] | None = None,
           top_p_on_device: bool | None = None,
           parents: list[list[int] | None] | None = None) -> list[Verified]:
    """logits: [sum(len(d) + 1), vocab] float32, request after request, modified in place.
    generator_for(request, device): the torch.Generator its draws come from. draft_probs: per
    request [d, vocab] q rows, or None (q one-hot at each draft). parents: per request None
    (a chain) or its draft tree (worker/draft_tree.py; greedy requests only): row 1 + j is
    node j's, processed as if its path were output."""
    parents = parents or [None] * len(requests)
    starts, views = [], []
    for r, d, tree in zip(requests, drafts, parents):
        if tree is not None and not r.sampling_params.greedy:
            raise ValueError("verify: draft trees are for greedy requests (sampled ones get "
                             "chains)")
        starts.append(len(views))
        before = [d[:i] for i in range(len(d) + 1)] if tree is None else \
            [[]] + [[d[n] for n in draft_tree.path(tree, j)] for j in range(len(d))]
        views += [_AsIfOutput(r.sampling_params, r.prompt_token_ids, r.output_token_ids + b,
                              r.eos_token_ids) for b in before]
    lp_rows = [i for i, v in enumerate(views) if v.sampling_params.logprobs is not None]
    raw = {}
    if lp_rows:
        raw = dict(zip(lp_rows, logits[lp_rows].log_softmax(-1)))
    apply_min_tokens(logits, views)
    apply_penalties(logits, views)
    top = _argmax_rows(logits, [(starts[j], len(d) + 1) for j, (r, d)
                                in enumerate(zip(requests, drafts)) if r.sampling_params.greedy])
    out = []
    for j, (r, d, tree) in enumerate(zip(requests, drafts, parents)):
        rows = logits[starts[j]:starts[j] + len(d) + 1]
        q = draft_probs[j] if draft_probs else None
        kept = None
        if tree is not None:
            tokens, kept = draft_tree.accept(top[starts[j]:starts[j] + len(d) + 1], d, tree)
        elif r.sampling_params.greedy:
            tokens = _greedy(top[starts[j]:starts[j] + len(d) + 1], d)
        else:
            tokens = _sampled(rows, d, r.sampling_params, q,
                              generator_for(r, logits.device), top_p_on_device)
        lps = None
        if r.sampling_params.logprobs is not None:
            n = r.sampling_params.logprobs
            # token i comes from the row of the node before it (the root's for the first)
            src = range(len(tokens)) if kept is None else [0] + [1 + k for k in kept]
            lps = [_logprobs(raw[starts[j] + i], t, n) for i, t in zip(src, tokens)]
        out.append(Verified(tokens, lps, len(d), kept))
    return out


def _argmax_rows(logits: torch.Tensor, runs: list[tuple[int, int]]) -> list[int]:
    """Per row of logits, its argmax where the row is in one of the runs (first row, count),
    else -1: one device pass and one read-back for the whole step."""
    rows = [i for first, n in runs for i in range(first, first + n)]
    top = [-1] * logits.shape[0]
    if len(rows) == logits.shape[0]:
        return logits.argmax(-1).tolist()
    if rows:
        for i, t in zip(rows, logits[rows].argmax(-1).tolist()):
            top[i] = t
    return top


def _greedy(top: list[int], drafts: list[int]) -> list[int]:
    """top: the argmax of each of the request's 1 + len(drafts) rows."""
    a = 0
    while a < len(drafts) and drafts[a] == top[a]:
        a += 1
    return drafts[:a] + [top[a]]


def _sampled(rows: torch.Tensor, drafts: list[int], sp: SamplingParams,
             q: torch.Tensor | None, generator: torch.Generator,
             top_p_on_device: bool | None) -> list[int]:
    if sp.temperature != 1.0:
        rows = rows / sp.temperature
    threshold = filter_threshold(rows, [sp] * rows.shape[0], top_p_on_device)
    probs = rows.softmax(-1)
    if threshold is not None:
        probs = probs * (rows >= threshold)
        probs = probs / probs.sum(-1, keepdim=True)
    u = torch.rand(len(drafts), generator=generator, device=rows.device, dtype=torch.float64)
    u = u.tolist()
    for i, x in enumerate(drafts):
        p_x = probs[i, x].item()
        q_x = q[i, x].item() if q is not None else 1.0
        if u[i] * q_x < p_x:  # u < p / q: keep x
            continue
        residual = (probs[i] - q[i]).clamp_(min=0) if q is not None else probs[i].clone()
        if q is None:
            residual[x] = 0.0
        return drafts[:i] + [_draw(residual, generator)]
    return drafts + [_draw(probs[len(drafts)], generator)]


def _draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    """A token with probability proportional to weights [vocab] (the exponential race)."""
    u = torch.rand(weights.shape, generator=generator, device=weights.device,
                   dtype=torch.float64)
    return int((weights.double() / u.log_().neg_()).argmax())


def _logprobs(raw: torch.Tensor, token: int, n: int) -> dict[int, float]:
    """{token: its logprob, then the top-n's}, as the sampler reports them."""
    out = {token: raw[token].item()}
    if n:
        top = raw.topk(n)
        for lp, i in zip(top.values.tolist(), top.indices.tolist()):
            out.setdefault(i, lp)
    return out
