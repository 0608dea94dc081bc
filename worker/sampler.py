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
(_SampleGraph; Sampler's `graphs`), a plain-greedy batch's through its argmax graph (_ArgmaxGraph).
Under async scheduling the engine completes the previous step before sampling this one, so
every earlier output token is on the host here.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from mxserve.api.sampling_params import SamplingParams
from mxserve.worker.host_to_device import index_on, to_device
from mxserve.worker.request import Request

_NEG_INF = float("-inf")
# top_p from the host (on CPU, or top_p_on_device off) looks for its cutoff among the 256 largest
# logits (a partial sort, ~10x cheaper than a full one at vocab 49k); when they hold less than
# top_p of the mass, on CPU among 16x more, and so on. On CUDA it sorts the whole row at once
# instead: each growth waits for the device, and a flat row (random weights) grows to the whole
# vocabulary (bench/results/engine_gpu.step_order.md).
_TOP_P_CANDIDATES = 256
_TOP_P_GROWTH = 16
_TRITON_ARGMAX_ROWS = 64


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
    its temperature, top_p cutoff and race are one more graph replay (_SampleGraph, recorded for
    each decode graph at start-up) instead of ~14 kernel launches from Python; a plain-greedy
    batch's argmax is one replay of _ArgmaxGraph instead of two launches. False: never.
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
        self._graphs: dict[int, _SampleGraph] = {}
        self._argmax_graphs: dict[int, _ArgmaxGraph] = {}
        self.num_graph_samples = 0  # calls served by either graph (tests, stats)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """logits: [num_reqs, vocab] float32, row i for requests[i]; may be modified in place."""
        return self.sample(logits, requests).result()

    @torch.inference_mode()  # the buffers are inference tensors (captured so)
    def capture_graphs(self, buffers: list[torch.Tensor]) -> None:
        """Record a _SampleGraph and an _ArgmaxGraph over each static logits buffer [size,
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
                self._graphs[buffer.data_ptr()] = _SampleGraph(buffer, capture_pool=pool)
            if buffer.is_floating_point() and buffer.stride(-1) == 1 \
                    and buffer.shape[0] <= _TRITON_ARGMAX_ROWS:  # argmax_rows's, as _argmax
                self._argmax_graphs[buffer.data_ptr()] = _ArgmaxGraph(buffer, capture_pool=pool)

    def sample(self, logits: torch.Tensor, requests: list[Request],
               static: torch.Tensor | None = None) -> SampledTokens:
        """Queue the sampling of `logits` (as __call__) without waiting for the device (top_p
        from the host, top_p_on_device off, waits: whether its 256 candidates hold the mass).
        static: a decode graph's logits buffer [size >= rows, vocab]; its _SampleGraph (or, for
        a plain-greedy batch, its _ArgmaxGraph) samples when `logits` is that buffer's first
        rows (not a copy of some of them)."""
        params = [r.sampling_params for r in requests]
        if all(_is_plain_greedy(r) for r in requests):  # fast path: nothing to do but argmax
            graph = self._static_graph(self._argmax_graphs, logits, static)
            if graph is None:
                return SampledTokens(_argmax(logits), (), [], params)
            self.num_graph_samples += 1
            return SampledTokens(graph.run(len(requests)), (), [], params)
        lp_rows = [i for i, sp in enumerate(params) if sp.logprobs is not None]
        raw_logprobs = _rows(logits, lp_rows).log_softmax(-1) if lp_rows else None  # a copy
        apply_min_tokens(logits, requests)
        apply_penalties(logits, requests)
        token_ids = torch.empty(len(requests), dtype=torch.long, device=logits.device)
        greedy = [i for i, sp in enumerate(params) if sp.greedy]
        if greedy:
            _write_rows(token_ids, greedy, _argmax(_rows(logits, greedy)))
        sampled = [i for i, sp in enumerate(params) if not sp.greedy]
        graph = self._graph_for(logits, static, params)
        if graph is not None:  # every row samples
            self._race_calls += 1
            self.num_graph_samples += 1
            token_ids = graph.run(params, self._race_seed())
        elif sampled:
            sampled_reqs = [requests[i] for i in sampled]
            _write_rows(token_ids, sampled, self._sample(_rows(logits, sampled), sampled_reqs))
        parts = _logprob_parts(raw_logprobs, lp_rows, token_ids, params)
        return SampledTokens(token_ids, parts, lp_rows, params)

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Temperature, filters and the exponential race over rows that all sample. -> [rows]
        On CUDA with no seeded row the race is sampling_ops.race_rows (two kernels, draws from
        Philox keyed by the sampler's seed and call count); else torch's (a seeded row draws
        from its own generator, the same draws whatever the batch)."""
        params = [r.sampling_params for r in requests]
        if any(sp.temperature != 1.0 for sp in params):
            logits = logits.div_(_column([sp.temperature for sp in params], logits))
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
                   params: list[SamplingParams]) -> _SampleGraph | None:
        """The _SampleGraph that can sample these rows: logits are its buffer's first rows and
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
            _write_rows(q, unseeded, _exp1(shape, self._generator(probs.device), q))
        for j, r in enumerate(requests):
            if r.sampling_params.seed is not None:
                if r.generator is None:  # first sampled step of this request
                    r.generator = torch.Generator(probs.device).manual_seed(r.sampling_params.seed)
                q[j] = _exp1((probs.shape[1],), r.generator, q)  # same draws whatever the batch
        return q

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device).manual_seed(self.seed)
        return self._generators[device]


class _SampleGraph:
    """Temperature, top_p's cutoff (top_k off) and the race over one static logits buffer
    [size, vocab], recorded once as a CUDA graph (on CPU run as it is: tests). A call's rows are
    the buffer's first ones; the rows past them sample with temperature and top_p 1, unread.
    The per-row temperature and top_p and the race's seed reach the graph in one copy from
    pinned staging, two sets used in turn (a set is refilled once its last copy ran)."""

    def __init__(self, logits: torch.Tensor, capture_pool=None) -> None:
        self.logits = logits  # held: the graph keeps its address
        self.size = logits.shape[0]
        pin = logits.is_cuda
        # [temperatures (size), top_p (size), the race's seed (int32 bits)]
        self.inputs = torch.ones(2 * self.size + 1, dtype=torch.float32, device=logits.device)
        self._staging = [torch.ones(2 * self.size + 1, dtype=torch.float32, pin_memory=pin)
                         for _ in range(2)]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.tokens: torch.Tensor | None = None
        if logits.is_cuda:  # (warmed up with the inputs at ones: the buffer divided by 1)
            self.graph, self.tokens = _record(self._step, capture_pool)

    def _step(self) -> torch.Tensor:
        from mxserve.kernels.sampling_ops import race_rows, top_p_search_rows

        n = self.size
        self.logits.div_(self.inputs[:n].view(n, 1))
        threshold = top_p_search_rows(self.logits, self.inputs[n:2 * n].view(n, 1))
        return race_rows(self.logits, threshold, self.inputs[2 * n:].view(torch.int32))

    def run(self, params: list[SamplingParams], seed: int) -> torch.Tensor:
        """Queue the sampling of the first len(params) rows -> tokens [rows] int64 (on the
        device, valid until the next run)."""
        rows, n = len(params), self.size
        turn, self._turn = self._turn, 1 - self._turn
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()  # this set's previous copy has run
        staging = self._staging[turn]
        values = staging.numpy()
        values[:rows] = [sp.temperature for sp in params]
        values[rows:n] = 1.0
        values[n:n + rows] = [sp.top_p for sp in params]
        values[n + rows:2 * n] = 1.0
        values[2 * n:].view(np.int32)[0] = seed
        self.inputs.copy_(staging, non_blocking=True)
        if self.graph is None:
            return self._step()[:rows]
        self._copied[turn] = torch.cuda.Event()
        self._copied[turn].record()
        self.graph.replay()
        return self.tokens[:rows]


class _ArgmaxGraph:
    """The first maximal index of each row of one static logits buffer [size, vocab] (size <=
    _TRITON_ARGMAX_ROWS: argmax_rows, as _argmax takes them eagerly), recorded once as a CUDA
    graph (on CPU run as it is: tests): a plain-greedy decode batch's tokens in one replay
    instead of two launches from the host. A call's rows are the buffer's first ones."""

    def __init__(self, logits: torch.Tensor, capture_pool=None) -> None:
        self.logits = logits  # held: the graph keeps its address
        self.size = logits.shape[0]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.tokens: torch.Tensor | None = None
        if logits.is_cuda:
            self.graph, self.tokens = _record(lambda: _argmax(self.logits), capture_pool)

    def run(self, rows: int) -> torch.Tensor:
        """Queue the argmax of the first `rows` rows -> tokens [rows] int64 (on the device,
        valid until the next run)."""
        if self.graph is None:
            return _argmax(self.logits[:rows])
        self.graph.replay()
        return self.tokens[:rows]


def _record(step, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """step() (no arguments, returns a tensor) as a CUDA graph in `pool`, warmed up off the
    capture stream first (compiles): (graph, its output tensor)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = step()
    return graph, out


def apply_min_tokens(logits: torch.Tensor, requests: list[Request]) -> None:
    """Until a request has min_tokens outputs, it may not end: its EOS and stop ids get -inf."""
    rows: list[int] = []
    cols: list[int] = []
    for i, r in enumerate(requests):
        sp = r.sampling_params
        if r.num_output_tokens >= sp.min_tokens:
            continue
        banned = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(r.eos_token_ids))
        banned_ids = [t for t in banned if t < logits.shape[1]]  # an id past the vocab never comes
        rows += [i] * len(banned_ids)
        cols += banned_ids
    if rows:
        logits.index_put_((index_on(rows, logits), index_on(cols, logits)),
                          logits.new_full((), _NEG_INF))


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> None:
    """Repetition, presence and frequency penalties, in place, on the rows that set any."""
    rows = [i for i, r in enumerate(requests) if r.sampling_params.has_penalties]
    if not rows:
        return
    reqs = [requests[i] for i in rows]
    params = [r.sampling_params for r in reqs]
    sub = _rows(logits, rows)  # [rows, vocab]
    # Dense [rows, vocab] counts; plain arithmetic below, since where/masked_fill are slow on CPU.
    counts = _token_counts([r.output_token_ids for r in reqs], sub)
    present = counts.clamp(max=1.0)  # 1 where the id is in the output, else 0
    if any(sp.repetition_penalty != 1.0 for sp in params):
        # Tokens seen in prompt or output: a positive logit is divided by p, others multiplied,
        # so p > 1 always makes a seen token less likely. p_seen is p there and 1 elsewhere.
        seen = present.clone()
        seen[_flat_index([r.prompt_token_ids for r in reqs], sub)] = 1.0
        p = _column([sp.repetition_penalty for sp in params], sub)
        p_seen = seen.mul_(p - 1.0).add_(1.0)
        sub = sub.clamp(min=0.0).div_(p_seen).add_(sub.clamp(max=0.0).mul_(p_seen))
    if any(sp.frequency_penalty != 0.0 for sp in params):  # minus p per occurrence in the output
        sub = sub - _column([sp.frequency_penalty for sp in params], sub) * counts
    if any(sp.presence_penalty != 0.0 for sp in params):  # minus p once if in the output at all
        sub = sub - _column([sp.presence_penalty for sp in params], sub) * present
    _write_rows(logits, rows, sub)


def filter_threshold(logits: torch.Tensor, params: list[SamplingParams],
                     top_p_on_device: bool | None = None) -> torch.Tensor | None:
    """top_k, top_p then min_p on temperature-scaled logits [rows, vocab], as one threshold.

    A token survives iff its logit >= threshold[row] ([rows, 1]); None when no row filters. The
    top token always survives, and so do tokens tied with the last one a filter keeps.
    top_p_on_device: as Sampler's.
    """
    vocab = logits.shape[1]
    top_k = [sp.top_k if 0 < sp.top_k < vocab else vocab for sp in params]  # vocab = off
    use_top_k_or_p = any(k < vocab for k in top_k) or any(sp.top_p < 1.0 for sp in params)
    use_min_p = any(sp.min_p > 0.0 for sp in params)
    if not (use_top_k_or_p or use_min_p):
        return None
    threshold = torch.full((len(params), 1), _NEG_INF, device=logits.device)  # [rows, 1]
    if use_top_k_or_p:
        on_device = top_p_on_device is True or (top_p_on_device is None and logits.is_cuda)
        threshold = _top_k_top_p_threshold(logits, params, top_k, on_device)
    if use_min_p:
        # prob < min_p * max prob  <=>  logit < max logit + log(min_p); log(0) = -inf keeps all.
        min_p = _column([sp.min_p for sp in params], logits)
        threshold = torch.maximum(threshold, logits.amax(-1, keepdim=True) + min_p.log())
    return threshold


def _top_k_top_p_threshold(
    logits: torch.Tensor, params: list[SamplingParams], top_k: list[int], on_device: bool
) -> torch.Tensor:
    """Per-row logit threshold [rows, 1] for top_k and, over the top_k survivors, top_p (its
    cutoff decided on the device when `on_device`)."""
    vocab = logits.shape[1]
    use_top_p = any(sp.top_p < 1.0 for sp in params)
    if on_device and use_top_p and all(k == vocab for k in top_k):
        from mxserve.kernels.sampling_ops import top_p_search_rows

        # top_k off everywhere: no candidates, the whole-row search on every row (10 launches)
        return top_p_search_rows(logits, _column([sp.top_p for sp in params], logits))
    num_candidates = max((k for k in top_k if k < vocab), default=0)
    if use_top_p:
        num_candidates = max(num_candidates, min(_TOP_P_CANDIDATES, vocab))
    values = logits.topk(num_candidates, dim=-1).values  # [rows, num_candidates], descending
    k = to_device([min(k, num_candidates) for k in top_k], torch.long, logits.device)
    k_on = to_device([k < vocab for k in top_k], torch.bool, logits.device).unsqueeze(1)
    threshold = torch.where(k_on, values.gather(1, k.unsqueeze(1) - 1), _NEG_INF)  # k-th largest
    if not use_top_p:
        return threshold
    # top_p renormalizes over what top_k kept, so its softmax denominator is over the survivors:
    # all among the candidates when top_k is on, the whole row when it is off.
    values = values.masked_fill_(values < threshold, _NEG_INF)
    log_total = values.logsumexp(-1, keepdim=True)
    if not all(k < vocab for k in top_k):
        log_total = torch.where(k_on, log_total, logits.logsumexp(-1, keepdim=True))
    if on_device:
        from mxserve.kernels.sampling_ops import top_p_threshold_rows

        top_p = _column([sp.top_p for sp in params], logits)
        cut = top_p_threshold_rows(logits, values, log_total, top_p, ~k_on.view(-1))
        return torch.maximum(threshold, cut)
    return torch.maximum(threshold, _top_p_threshold(logits, values, log_total, params))


def _top_p_threshold(
    logits: torch.Tensor,
    values: torch.Tensor,
    log_total: torch.Tensor,
    params: list[SamplingParams],
) -> torch.Tensor:
    """Per-row logit threshold [rows, 1] for top_p, given the largest logits (descending) and the
    log of the softmax denominator over top_k's survivors.

    Keep the smallest prefix (in descending order) whose mass reaches top_p: token j survives iff
    the mass strictly before it is < top_p, so the top token always does. Usually the candidates
    in `values` hold that mass; if some row's do not, take _TOP_P_GROWTH times more (CUDA: all).
    Rows with top_p = 1 get -inf (a float cumsum can reach 1 early and would drop the tail).
    """
    top_p, vocab = _column([sp.top_p for sp in params], logits), logits.shape[1]
    while True:
        probs = (values - log_total).exp_()  # [rows, num_candidates]
        mass = probs.cumsum(-1)
        short = (mass[:, -1:] < top_p) & (top_p < 1.0)  # rows whose cutoff lies further down
        if values.shape[1] == vocab or not bool(short.any()):
            break
        num_candidates = vocab if logits.is_cuda else min(values.shape[1] * _TOP_P_GROWTH, vocab)
        # A row with top_k on has all its mass within its first k candidates, so the tokens past
        # them (no longer masked here) never move its cutoff.
        values = logits.sort(dim=-1, descending=True).values if num_candidates == vocab \
            else logits.topk(num_candidates, dim=-1).values
    num_keep = ((mass - probs) < top_p).sum(-1, keepdim=True)
    return torch.where(top_p < 1.0, values.gather(1, num_keep - 1), _NEG_INF)


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
    sampled_ids = _rows(token_ids, lp_rows).unsqueeze(1)  # [L, 1]
    sampled_lps = raw_logprobs.gather(1, sampled_ids).squeeze(1)
    num_top = max(params[i].logprobs for i in lp_rows)
    top_lps, top_ids = raw_logprobs.topk(num_top, dim=-1)  # [L, num_top] each
    return sampled_lps, top_lps, top_ids


def _exp1(shape: tuple[int, ...], generator: torch.Generator, like: torch.Tensor) -> torch.Tensor:
    """Exp(1) samples as -log(u), u ~ U[0, 1) in float64: ~4x faster than exponential_ on CPU, and
    float64 keeps q's resolution near 0 (where race winners come from) at 2^-53, not 2^-24."""
    u = torch.empty(shape, dtype=torch.float64, device=like.device).uniform_(generator=generator)
    return u.log_().neg_().to(like.dtype)  # u = 0 gives q = inf: that token loses this draw


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first maximal index. On CUDA, up to _TRITON_ARGMAX_ROWS rows: two short
    kernels (kernels/sampling_ops.py) instead of torch.argmax's one block a row, which is far
    slower for a few rows; at many rows both read the logits at about the same speed and
    torch's single launch costs the host less (bench/results/decode_step_probe.json)."""
    if logits.is_cuda and logits.shape[0] <= _TRITON_ARGMAX_ROWS:
        from mxserve.kernels.sampling_ops import argmax_rows

        return argmax_rows(logits)
    return logits.argmax(-1)


def _is_plain_greedy(r: Request) -> bool:
    sp = r.sampling_params
    return sp.plain_greedy and (sp.min_tokens == 0 or r.num_output_tokens >= sp.min_tokens)


def _token_counts(token_lists: list[list[int]], like: torch.Tensor) -> torch.Tensor:
    """How often each id occurs in each row's list: [rows, vocab] float, like `like`."""
    counts = torch.zeros_like(like)
    index = _flat_index(token_lists, like)
    counts.index_put_(index, torch.ones(len(index[0]), device=like.device), accumulate=True)
    return counts


def _flat_index(
    token_lists: list[list[int]], like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, id) index tensors [num_tokens] each, over all lists; row j for token_lists[j]."""
    rows = [j for j, ids in enumerate(token_lists) for _ in ids]
    return index_on(rows, like), index_on(list(chain.from_iterable(token_lists)), like)


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    """Per-row values as a [rows, 1] tensor of like's dtype and device."""
    return to_device(values, like.dtype, like.device).unsqueeze(1)


def _rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """logits itself when rows is every row (in order), else a copy of those rows."""
    if len(rows) == logits.shape[0]:
        return logits
    return logits.index_select(0, index_on(rows, logits))


def _write_rows(logits: torch.Tensor, rows: list[int], sub: torch.Tensor) -> None:
    """logits[rows] = sub (no copy when sub is logits itself)."""
    if sub is logits:
        return
    if len(rows) == logits.shape[0]:
        logits.copy_(sub)
    else:
        logits.index_copy_(0, index_on(rows, logits), sub)
