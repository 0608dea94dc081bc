"""Turn one step's logits into the next token of each request (vLLM's sampling semantics).

Each row goes through these stages, in this order; a stage no row of the batch needs is skipped,
and a stage runs vectorized over just the rows that need it:

  1. logprobs (if asked): log_softmax of the RAW logits, before anything below changes them;
  2. min_tokens: EOS ids (unless ignore_eos) and stop_token_ids get -inf until min_tokens outputs;
  3. penalties: repetition (prompt + output tokens), presence and frequency (output tokens only);
  4. temperature 0: argmax. Otherwise divide by temperature, filter (top_k, then top_p, then
     min_p) and draw with the exponential race: argmax(probs / q), q ~ Exp(1) per vocab entry,
     which picks token i with probability probs[i].

A request with a seed draws its q from its own generator (request.generator), so its tokens do not
depend on what it is batched with; the others share the sampler's generator (on CUDA, when no
row of the batch has a seed, Philox draws inside the fused race, kernels/sampling_ops.race_rows).

`sample` only queues work (and the tokens' copy to the host) for the device; `SampledTokens`
waits for it. A decode graph's logits sampled the common way go through one more graph
(SampleGraph; Sampler's `graphs`), a plain-greedy batch's through its argmax graph (ArgmaxGraph),
both in sampler_graphs.py. The logit transforms are logits_ops.py's.
Under async scheduling the engine completes the previous step before sampling this one, so
every earlier output token is on the host here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mxserve.api.sampling_params import SamplingParams
from mxserve.worker.logits_ops import (
    ARGMAX_TRITON_ROWS,
    apply_min_tokens,
    apply_penalties,
    argmax,
    column,
    filter_threshold,
    select_rows,
    write_rows,
)
from mxserve.worker.request import Request
from mxserve.worker.sampler_graphs import ArgmaxGraph, SampleGraph


@dataclass
class SamplerOutput:
    """One sampler call's result; entry i belongs to requests[i]."""

    token_ids: list[int]  # the next token of each request
    # None where sampling_params.logprobs is None; else {sampled id: lp, each top-n id: lp}, taken
    # from the raw model distribution (before penalties, temperature and filters).
    logprobs: list[dict[int, float] | None]


class SampledTokens:
    """One sampler call's tokens (and logprobs) on their way to the host. `Sampler.sample`
    queues the work and the copies; `result()` waits for them. Meanwhile `token_ids` (on the
    device) can feed the next step's inputs: that is async scheduling (engine.py)."""

    def __init__(self, token_ids: torch.Tensor, logprob_parts: tuple[torch.Tensor, ...],
                 lp_rows: list[int], params: list[SamplingParams]) -> None:
        self.token_ids = token_ids  # [num_reqs] int64, on the logits' device
        self._lp_rows, self._params = lp_rows, params
        # Device -> pinned host copies, queued behind the sampling kernels.
        self._host = [t.to("cpu", non_blocking=True) for t in (token_ids, *logprob_parts)]
        self._copied = None
        if token_ids.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def result(self) -> SamplerOutput:
        if self._copied is not None:
            self._copied.synchronize()
        token_ids = self._host[0].tolist()
        logprobs: list[dict[int, float] | None] = [None] * len(self._params)
        if self._lp_rows:
            sampled_lps, top_lps, top_ids = (t.tolist() for t in self._host[1:])
            for j, i in enumerate(self._lp_rows):
                n = self._params[i].logprobs
                logprobs[i] = {token_ids[i]: sampled_lps[j]}
                logprobs[i].update(zip(top_ids[j][:n], top_lps[j][:n], strict=True))
        return SamplerOutput(token_ids, logprobs)


class Sampler:
    """Samples one token per request from a batch of logits; holds only the unseeded RNG and
    the CUDA graphs it recorded.

    top_p_on_device: decide top_p's cutoff on the device (kernels/sampling_ops.py): with top_k
    off everywhere a radix search of every whole row (top_p_search_rows), else the candidates
    checked and searched past on the device (top_p_threshold_rows). No wait for the device, so
    a top_p step overlaps the next one as a greedy step does
    (bench/results/engine_gpu.top_p_radix.md). None: on CUDA only (on CPU the host path has no
    wait to save, and its candidates spare the torch rule's full sort); True: always (on CPU it
    runs the kernels' torch rule: tests); False: never.
    graphs: a decode graph replay's logits (cuda_graphs.py) sit in that graph's static buffer;
    when every row of such a batch samples the common way (no greedy row, seed, top_k or min_p),
    its temperature, top_p cutoff and race are one more graph replay (SampleGraph, recorded for
    each decode graph at start-up) instead of ~14 kernel launches from Python; a plain-greedy
    batch's argmax is one replay of ArgmaxGraph instead of two launches. False: never.
    """

    def __init__(self, seed: int = 0, *, top_p_on_device: bool | None = None,
                 graphs: bool = True) -> None:
        self.seed = seed
        self.top_p_on_device = top_p_on_device
        self.graphs = graphs
        self._race_calls = 0  # keys race_rows' draws (CUDA, rows without a seed)
        # Per device, the generator of rows without a seed (created lazily off CPU).
        self._generators = {torch.device("cpu"): torch.Generator().manual_seed(seed)}
        # by the static logits buffer's address
        self._graphs: dict[int, SampleGraph] = {}
        self._argmax_graphs: dict[int, ArgmaxGraph] = {}
        self.num_graph_samples = 0  # calls served by either graph (tests, stats)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """logits: [num_reqs, vocab] float32, row i for requests[i]; may be modified in place."""
        return self.sample(logits, requests).result()

    @torch.inference_mode()  # the buffers are inference tensors (captured so)
    def capture_graphs(self, buffers: list[torch.Tensor]) -> None:
        """Record a SampleGraph and an ArgmaxGraph over each static logits buffer [size,
        vocab] (the decode graphs' outputs; their contents are divided by 1 meanwhile) where
        their kernels take it (else the eager path runs). CUDA only; nothing with `graphs`
        off."""
        if not self.graphs:
            return
        # One pool for all of them: a replay may reuse what another's capture freed, so a
        # graph's tokens hold until the next sampler replay of any size. They are consumed
        # before it: the host copy and the next step's inputs are queued ahead of it.
        pool = torch.cuda.graph_pool_handle()
        for buffer in buffers:
            if buffer.dtype == torch.float32 and buffer.stride(-1) == 1 \
                    and buffer.numel() < 2**31:  # the fused race's
                self._graphs[buffer.data_ptr()] = SampleGraph(buffer, capture_pool=pool)
            if buffer.is_floating_point() and buffer.stride(-1) == 1 \
                    and buffer.shape[0] <= ARGMAX_TRITON_ROWS:  # argmax_rows's, as _argmax
                self._argmax_graphs[buffer.data_ptr()] = ArgmaxGraph(buffer, capture_pool=pool)

    def sample(self, logits: torch.Tensor, requests: list[Request],
               static: torch.Tensor | None = None) -> SampledTokens:
        """Queue the sampling of `logits` (as __call__) without waiting for the device (top_p
        from the host, top_p_on_device off, waits: whether its 256 candidates hold the mass).
        static: a decode graph's logits buffer [size >= rows, vocab]; its SampleGraph (or, for
        a plain-greedy batch, its ArgmaxGraph) samples when `logits` is that buffer's first
        rows (not a copy of some of them)."""
        params = [r.sampling_params for r in requests]
        if all(_is_plain_greedy(r) for r in requests):  # fast path: nothing to do but argmax
            graph = self._static_graph(self._argmax_graphs, logits, static)
            if graph is None:
                return SampledTokens(argmax(logits), (), [], params)
            self.num_graph_samples += 1
            return SampledTokens(graph.run(len(requests)), (), [], params)
        lp_rows = [i for i, sp in enumerate(params) if sp.logprobs is not None]
        raw_logprobs = select_rows(logits, lp_rows).log_softmax(-1) if lp_rows else None  # a copy
        apply_min_tokens(logits, requests)
        apply_penalties(logits, requests)
        token_ids = torch.empty(len(requests), dtype=torch.long, device=logits.device)
        greedy = [i for i, sp in enumerate(params) if sp.greedy]
        if greedy:
            write_rows(token_ids, greedy, argmax(select_rows(logits, greedy)))
        sampled = [i for i, sp in enumerate(params) if not sp.greedy]
        graph = self._graph_for(logits, static, params)
        if graph is not None:  # every row samples
            self._race_calls += 1
            self.num_graph_samples += 1
            token_ids = graph.run(params, self._race_seed())
        elif sampled:
            sampled_reqs = [requests[i] for i in sampled]
            write_rows(token_ids, sampled, self._sample(select_rows(logits, sampled), sampled_reqs))
        parts = _logprob_parts(raw_logprobs, lp_rows, token_ids, params)
        return SampledTokens(token_ids, parts, lp_rows, params)

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Temperature, filters and the exponential race over rows that all sample. -> [rows]
        On CUDA with no seeded row the race is sampling_ops.race_rows (two kernels, draws from
        Philox keyed by the sampler's seed and call count); else torch's (a seeded row draws
        from its own generator, the same draws whatever the batch)."""
        params = [r.sampling_params for r in requests]
        if any(sp.temperature != 1.0 for sp in params):
            logits = logits.div_(column([sp.temperature for sp in params], logits))
        threshold = filter_threshold(logits, params, self.top_p_on_device)
        if logits.is_cuda and logits.dtype == torch.float32 and logits.stride(-1) == 1 \
                and logits.numel() < 2**31 and all(sp.seed is None for sp in params):
            from mxserve.kernels.sampling_ops import race_rows

            # the same race fused into two kernels, its draws from Philox keyed per call
            self._race_calls += 1
            return race_rows(logits, threshold, self._race_seed())
        probs = logits.softmax(-1)  # [rows, vocab]
        if threshold is not None:
            # Zero the dropped tokens. No need to renormalize: the race only compares ratios.
            probs.mul_(logits >= threshold)
        return probs.div_(self._exponentials(probs, requests)).argmax(-1)

    def _race_seed(self) -> int:
        return (self.seed * 1000003 + self._race_calls) % 2**31

    def _graph_for(self, logits: torch.Tensor, static: torch.Tensor | None,
                   params: list[SamplingParams]) -> SampleGraph | None:
        """The SampleGraph that can sample these rows: logits are its buffer's first rows and
        every row takes the path it recorded (sampled, unseeded, top_k and min_p off)."""
        if self.top_p_on_device is False:  # (the graph decides top_p on the device)
            return None
        graph = self._static_graph(self._graphs, logits, static)
        vocab = logits.shape[1]
        if graph is not None and all(
                not sp.greedy and sp.seed is None and (sp.top_k <= 0 or sp.top_k >= vocab)
                and sp.min_p <= 0.0 for sp in params):
            return graph
        return None

    def _static_graph(self, graphs: dict, logits: torch.Tensor, static: torch.Tensor | None):
        """The graph in `graphs` recorded over `static` when `logits` are that buffer's first
        rows (not a copy of some of them) and it has room for them; else None."""
        if static is None or not self.graphs or logits.data_ptr() != static.data_ptr():
            return None
        graph = graphs.get(static.data_ptr())
        if graph is None or graph.logits.shape[1] != logits.shape[1] \
                or logits.shape[0] > graph.size:
            return None
        return graph

    def _exponentials(self, probs: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """q ~ Exp(1) like probs: seeded rows from their own generator, the others from ours."""
        q = torch.empty_like(probs)
        unseeded = [j for j, r in enumerate(requests) if r.sampling_params.seed is None]
        if len(unseeded) == len(requests):
            return _exp1(probs.shape, self._generator(probs.device), q)
        if unseeded:
            shape = (len(unseeded), probs.shape[1])
            write_rows(q, unseeded, _exp1(shape, self._generator(probs.device), q))
        for j, r in enumerate(requests):
            if r.sampling_params.seed is not None:  # same draws whatever the batch
                q[j] = _exp1((probs.shape[1],), self.generator_for(r, probs.device), q)
        return q

    def generator_for(self, request: Request, device: torch.device) -> torch.Generator:
        """Where a request's random draws come from: its own generator when it has a seed
        (made on its first draw), else the sampler's."""
        if request.sampling_params.seed is None:
            return self._generator(device)
        if request.generator is None:
            request.generator = torch.Generator(device).manual_seed(request.sampling_params.seed)
        return request.generator

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device).manual_seed(self.seed)
        return self._generators[device]


def _logprob_parts(
    raw_logprobs: torch.Tensor | None,
    lp_rows: list[int],
    token_ids: torch.Tensor,
    params: list[SamplingParams],
) -> tuple[torch.Tensor, ...]:
    """(sampled lp [L], top-n lps [L, n], top-n ids [L, n]) of the rows asking for logprobs, on
    the device, from raw_logprobs [L, vocab]; () when none asks. SampledTokens builds the
    per-request {id: lp} dicts from them on the host."""
    if raw_logprobs is None:
        return ()
    sampled_ids = select_rows(token_ids, lp_rows).unsqueeze(1)  # [L, 1]
    sampled_lps = raw_logprobs.gather(1, sampled_ids).squeeze(1)
    num_top = max(params[i].logprobs for i in lp_rows)
    top_lps, top_ids = raw_logprobs.topk(num_top, dim=-1)  # [L, num_top] each
    return sampled_lps, top_lps, top_ids


def _exp1(shape: tuple[int, ...], generator: torch.Generator, like: torch.Tensor) -> torch.Tensor:
    """Exp(1) samples as -log(u), u ~ U[0, 1) in float64: faster than exponential_ on CPU, and
    float64 keeps q's resolution near 0 (where race winners come from) at 2^-53, not 2^-24."""
    u = torch.empty(shape, dtype=torch.float64, device=like.device).uniform_(generator=generator)
    return u.log_().neg_().to(like.dtype)  # u = 0 gives q = inf: that token loses this draw


def _is_plain_greedy(r: Request) -> bool:
    sp = r.sampling_params
    return sp.plain_greedy and (sp.min_tokens == 0 or r.num_output_tokens >= sp.min_tokens)
