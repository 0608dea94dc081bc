"""The engine one worker replica runs: add requests, then `step()` until they finish.

    step(): schedule -> run the model -> sample -> complete (append the tokens, stop checks,
            prefix cache, outputs)

Single-threaded; `AsyncEngine` (async_engine.py) drives it from a background thread for the server.
The engine emits token ids only and ends a request on EOS, a stop token id or a length limit;
text (incremental detokenization) and stop strings are `api.stream.OutputStream`'s, which the
router and the offline `LLM` both wrap around its outputs.

Async scheduling (on by default on CUDA): a step is completed by the next `step()` call, after
that call has scheduled step N + 1 and queued its model run, so the host's work (scheduling,
input copies, completing step N) runs while the device computes:

    host:    sched N+1 | run N+1 | complete N | sample N+1 | sched N+2 | run N+2 | complete N+1
    device:  ... N ...           |       N+1 model      ...  | N+1 sampling |     N+2 model

Step N + 1 computes the token step N sampled before the host has seen it: the scheduler counts it
(Request.num_inflight) and the runner copies its id from N's samples on the device. Step N is
completed before N + 1 samples, so the sampler sees every earlier token on the host (penalties,
min_tokens), and a sampler that must wait for the device (top_p checked from the host, with
top_p_on_device off) waits after the completion work is done. A request whose in-flight
token ends it (EOS or a stop id) got one step too many: that token is dropped. Length
limits are known ahead: such a request is not scheduled again.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from mxserve.api.block_hash import extend_block_hashes
from mxserve.api.errors import InvalidRequestError
from mxserve.api.outputs import StepOutput
from mxserve.api.sampling_params import SamplingParams
from mxserve.api.tokenizer import Tokenizer
from mxserve.worker import draft_tree
from mxserve.worker.config import EngineConfig
from mxserve.worker.drafters import Drafter, build_drafter
from mxserve.worker.kv_cache import KVCacheManager
from mxserve.worker.kv_eviction import EvictionPolicy, KVEvictor
from mxserve.worker.model.config import ModelConfig
from mxserve.worker.model.tp import TPGroup, check_tensor_parallel
from mxserve.worker.prompt_logprobs import PromptLogprobs
from mxserve.worker.request import FinishReason, Request, RequestStatus
from mxserve.worker.runner import ModelRunner, StepResult, context_limit, load_runner, open_model
from mxserve.worker.sampler import SampledTokens, Sampler
from mxserve.worker.scheduler import ScheduledRequest, Scheduler, StepPlan
from mxserve.worker.spec_verify import verify_plan
from mxserve.worker.stop import check_stop
from mxserve.worker.tp_executor import RankGroup, RankLauncher, check_group_size

logger = logging.getLogger(__name__)


@dataclass
class LaunchedStep:
    """A step whose work is queued on the device: its plan and its samples, on their way."""

    plan: StepPlan
    samples: SampledTokens  # a row per sampling request, in plan order
    rows: dict[Request, int]  # sampling request -> its row in samples.token_ids
    prompt_logprobs: PromptLogprobs | None = None  # its prefill chunks', on their way


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks_free: int


class Engine:
    def __init__(self, runner: ModelRunner, model_config: ModelConfig, config: EngineConfig,
                 tokenizer: Tokenizer | None = None, drafter: Drafter | None = None) -> None:
        self.runner = runner
        self.model_config = model_config
        self.config = config
        self.tokenizer = tokenizer  # the model's, for callers (LLM, the CLI); unused here
        self.kv = KVCacheManager(runner.num_kv_blocks, config.block_size,
                                 config.enable_prefix_caching)
        self.max_model_len = self._max_model_len(config, model_config)
        self.drafter = drafter  # speculative decoding (drafters.py); None: off
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len,
                                   drafter.num_lookahead_tokens if drafter else 0)
        self.sampler = Sampler(config.seed, top_p_on_device=config.top_p_on_device,
                               graphs=config.sample_graphs)
        self.async_scheduling = config.async_scheduling
        if self.async_scheduling is None:  # the host overlaps a device; on CPU there is none.
            # Speculation decides where the next step starts only once this one completes.
            self.async_scheduling = runner.device.type == "cuda" and drafter is None
        policy = EvictionPolicy.from_config(config)  # KV eviction (kv_eviction.py); None: off
        self.evictor = KVEvictor(policy, runner.device) if policy else None
        self._kv_moves: list[tuple[np.ndarray, np.ndarray]] = []  # for the next step to make
        self._inflight: LaunchedStep | None = None  # launched, not yet completed
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.generation_defaults: dict = {}  # from the checkpoint's generation_config.json
        # The last few finished requests, for tests and debugging (bounded).
        self.finished_requests: collections.deque[Request] = collections.deque(maxlen=256)

    def _max_model_len(self, config: EngineConfig, model_config: ModelConfig) -> int:
        """The context limit, capped so one request always fits the KV pool alone (else a
        request growing past the pool would preempt itself forever)."""
        limit = context_limit(config, model_config, self.kv.num_blocks)
        if config.max_model_len and limit < config.max_model_len:
            logger.warning("max_model_len %d exceeds the KV pool's %d tokens; using %d",
                           config.max_model_len, limit, limit)
        return limit

    # ---- requests in and out -------------------------------------------------------------
    def make_request(self, prompt_token_ids: list[int],
                     sampling_params: SamplingParams | None = None,
                     request_id: str | None = None) -> Request:
        """Validate and build a request without touching engine state (safe from any thread)."""
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling_params", "must be a SamplingParams")
        ids = list(prompt_token_ids)
        if not ids:
            raise InvalidRequestError("prompt", "is empty")
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise InvalidRequestError("prompt_token_ids", f"ids must be integers in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                "prompt", f"has {len(ids)} tokens; the model's context is {self.max_model_len}")
        request = Request(request_id or f"req-{next(self._ids)}", ids, params,
                          eos_token_ids=frozenset(self.model_config.eos_token_ids))
        extend_block_hashes(request.block_hashes, ids, self.kv.block_size,
                            self.model_config.model_id)
        return request

    def num_prefix_hit_tokens(self, request: Request) -> int:
        """Prompt tokens the prefix cache would supply if the request were admitted now. Reads
        one dict by key per block, so another thread may call it while the engine steps."""
        return len(self.scheduler.prefix_hits(request)) * self.kv.block_size

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already running")
        self.requests[request.request_id] = request
        self.scheduler.add(request)

    def add_request(self, prompt_token_ids: list[int],
                    sampling_params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        request = self.make_request(prompt_token_ids, sampling_params, request_id)
        self.add(request)
        return request.request_id

    def abort(self, request_id: str) -> StepOutput | None:
        """Stop a request and free its KV blocks; None if it is not (or no longer) here."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.abort_as(request, FinishReason.ABORT)
        return self.output_of(request)

    def abort_as(self, request: Request, reason: FinishReason) -> None:
        """End a running or waiting request now, for `reason`, freeing its blocks (full ones
        stay in the prefix cache)."""
        request.finish_reason = reason
        self._finish(request)

    def output_of(self, request: Request) -> StepOutput:
        """The request's state as an output with no new tokens."""
        return self._output(request, [], 0)

    def complete_inflight(self) -> list[StepOutput]:
        """Complete the launched step (async scheduling), if any: the engine then has nothing
        on the device."""
        step, self._inflight = self._inflight, None
        return [] if step is None else self._complete(step)

    def check_health(self) -> None:
        """Raise when the engine cannot step (a tensor-parallel rank has failed)."""
        if self.runner.followers is not None:
            self.runner.followers.check()

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks, if any (the engine cannot step after)."""
        self.runner.shutdown()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or self._inflight is not None

    def stats(self) -> EngineStats:
        free = self.kv.num_free_blocks
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting),
                           self.kv.num_blocks - free, free)

    # ---- the loop ----------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Schedule and launch a step; return the outputs of the step completed in this call
        (this one, or with async scheduling the previous one)."""
        previous, self._inflight = self._inflight, None
        if self.evictor is not None:
            self._evict()
        plan = self.scheduler.schedule()
        plan.keep_hidden = self.drafter is not None and self.drafter.needs_hidden
        if self.evictor is not None:
            self._with_eviction(plan)
        result = None if plan.is_empty else self._run_model(plan, previous)
        outputs = [] if previous is None else self._complete(previous)
        if result is None:
            return outputs
        launched = self._sample(plan, result)
        if self.async_scheduling:
            self._inflight = launched
        else:
            outputs += self._complete(launched)
        if self.drafter is not None:
            self._draft(plan, result)
        return outputs

    def _run_model(self, plan: StepPlan, previous: LaunchedStep | None) -> StepResult:
        """Queue the plan's model run (nothing here waits for the device); a token still in
        flight from `previous` is read from its samples on the device."""
        for s in plan.scheduled:
            request = s.request
            if request.num_inflight:  # its newest token is one of `previous`'s samples
                s.inflight_row = previous.rows[request]
                plan.inflight_tokens = previous.samples.token_ids
            request.num_computed_tokens += s.num_new_tokens
        result = self.runner.execute(plan)
        if result.attn_mass is not None:
            self.evictor.observe([s.request.request_id for s in plan.scheduled],
                                 [s.start_position + s.num_new_tokens for s in plan.scheduled],
                                 result.attn_mass)
        return result

    def _evict(self) -> None:
        """Every running request past its KV budget keeps what the policy chooses, compacted
        into fewer blocks; the KV moves go with the next step the runner makes."""
        for request in self.scheduler.running:
            num_held = request.num_computed_tokens - request.num_evicted
            keep = self.evictor.select(request.request_id, num_held,
                                       request.num_computed_tokens)
            if keep is None:
                continue
            moves = self.kv.compact(request.request_id, keep)
            if moves is None:  # no block to move into: try again after the next step
                continue
            self._kv_moves.append(moves)
            request.num_evicted += num_held - len(keep)
            self.evictor.compacted(request.request_id, keep, num_held)

    def _with_eviction(self, plan: StepPlan) -> None:
        """Hand the plan the pending KV moves and the request for attention mass; forget the
        scores of requests preempted (they recompute from scratch)."""
        for request in plan.preempted:
            self.evictor.forget(request.request_id)
        plan.mass_window = self.evictor.mass_window
        plan.kv_moves, self._kv_moves = self._kv_moves, []
        if plan.is_empty and plan.kv_moves:  # nothing to run: make the moves alone
            self.runner.execute(plan)

    def _sample(self, plan: StepPlan, result: StepResult) -> LaunchedStep:
        """Queue the sampling of the plan's logits and the copy of the tokens to the host."""
        sampling = [s.request for s in plan.scheduled if s.samples]
        with torch.inference_mode():  # the logits are inference tensors
            if any(s.num_draft_tokens for s in plan.scheduled):
                samples = verify_plan(result.logits, [s for s in plan.scheduled if s.samples],
                                      self.sampler)
            else:
                samples = self.sampler.sample(result.logits, sampling, result.static_logits)
        for request in sampling:
            request.num_inflight += 1
        if result.prompt_logprobs is not None:
            result.prompt_logprobs.start_copy()
        return LaunchedStep(plan, samples, {r: i for i, r in enumerate(sampling)},
                            result.prompt_logprobs)

    def _complete(self, step: LaunchedStep) -> list[StepOutput]:
        """Take a launched step's tokens (waiting for the device): append them, check stops,
        register the blocks it filled in the prefix cache, and make the step's outputs."""
        sampled = step.samples.result()
        if step.prompt_logprobs is not None:
            self._take_prompt_logprobs(step)
        outputs = []
        tokens = iter(zip(sampled.token_ids, sampled.logprobs))
        bs = self.kv.block_size
        # The checks below skip calls that would do nothing (a block filled): this loop runs for
        # every request each step (bench/host_overhead.py).
        for s in step.plan.scheduled:
            request = s.request
            if s.samples:
                token, lp = next(tokens)
                request.num_inflight -= 1
            if request.status is RequestStatus.FINISHED:  # aborted, or ended by its previous
                continue  # token: this one is dropped
            if s.num_draft_tokens:  # token: the kept drafts and one more
                outputs.append(self._complete_verified(s, token, lp))
                continue
            end = s.start_position + s.num_new_tokens
            filled_block = end // bs != s.start_position // bs
            if not s.samples:
                if filled_block:
                    self._cache_blocks(request, end)
                continue
            request.append_output(token, lp)
            check_stop(request, self.max_model_len)
            if filled_block:
                self._cache_blocks(request, end)
            outputs.append(self._output(request, [token], 1 if lp is not None else 0))
            if request.finish_reason is not None:
                self._finish(request)
        return outputs

    def _take_prompt_logprobs(self, step: LaunchedStep) -> None:
        """Place a completed step's prompt logprobs at their prompt positions: chunk [start,
        end) gives the entries of prompt tokens start + 1 onwards (a request recomputing its
        prompt after a preemption overwrites the same entries)."""
        entries = iter(step.prompt_logprobs.result())
        for s in step.plan.scheduled:
            if not s.prompt_logprob_ids:
                continue
            lps = next(entries)
            request = s.request
            if request.status is not RequestStatus.FINISHED:
                first = s.start_position + s.position_offset + 1
                request.prompt_logprobs[first:first + len(lps)] = lps

    def _complete_verified(self, s: ScheduledRequest, tokens: list[int],
                           logprobs: list[dict[int, float]] | None) -> StepOutput:
        """A request that verified drafts: roll back the rejected ones' KV, then append the
        tokens one by one, stopping where a stop condition lands."""
        request, num_kept = s.request, len(tokens) - 1
        request.num_draft_tokens += s.num_draft_tokens
        request.num_accepted_tokens += num_kept
        request.num_drafts += 1
        if s.kept_draft_rows:  # a draft tree's kept nodes: their KV to a chain's positions
            root = s.start_position + s.num_new_tokens - s.num_draft_tokens - 1
            moves = draft_tree.moves(root, s.kept_draft_rows)
            if moves:
                bs, table = self.kv.block_size, s.block_table
                src, dst = ([table[p // bs] * bs + p % bs for p in side] for side in zip(*moves))
                self.runner.move_kv(src, dst, drafter_too=False)
        request.num_computed_tokens -= s.num_draft_tokens - num_kept
        self.kv.trim(request.request_id, self.scheduler.with_lookahead(
            request.num_computed_tokens - request.num_evicted))
        emitted = 0
        for i, token in enumerate(tokens):
            request.append_output(token, logprobs[i] if logprobs else None)
            emitted += 1
            check_stop(request, self.max_model_len)
            if request.finish_reason is not None:
                break
        # A stop inside the run leaves KV computed for accepted drafts past the request's
        # last token: only its own tokens' blocks get hashes.
        end = min(request.num_computed_tokens, request.num_tokens)
        if end // self.kv.block_size != s.start_position // self.kv.block_size:
            self._cache_blocks(request, end)
        out = self._output(request, tokens[:emitted], emitted if logprobs else 0)
        if request.finish_reason is not None:
            self._finish(request)
        return out

    def _draft(self, plan: StepPlan, result: StepResult) -> None:
        """Ask the drafter for the next step's drafts of each request that sampled and runs on,
        as many as its max_tokens and the context leave room for."""
        num_drafts = {}
        spec = self.config.speculative_config
        k = spec.num_speculative_tokens
        # above disable_by_batch_size no drafts, but the drafter still sees the step (catch-up)
        off = spec.disable_by_batch_size is not None and \
            len(self.scheduler.running) + len(self.scheduler.waiting) > spec.disable_by_batch_size
        for s in plan.scheduled:
            request = s.request
            if not s.samples or request.status is not RequestStatus.RUNNING:
                continue
            max_tokens = request.sampling_params.max_tokens or self.max_model_len
            n = min(k, max_tokens - request.num_output_tokens - 1,
                    self.max_model_len - request.num_tokens)
            request.draft_token_ids, request.draft_parents = [], None
            if n > 0 and not off:
                num_drafts[request] = n
        with torch.inference_mode():
            self.drafter.propose(plan, result.hidden_states, num_drafts)
        for request in num_drafts:  # a tree's nodes take slots past its depth: cut to fit
            room = self.max_model_len - request.num_tokens
            if request.draft_parents is not None and len(request.draft_token_ids) > room:
                request.draft_token_ids = request.draft_token_ids[:room]
                request.draft_parents = request.draft_parents[:room]

    def _cache_blocks(self, request: Request, end: int) -> None:
        """Hash and register the full blocks of the first `end` tokens, after a step that filled
        one (none of a request preempted since: it holds no blocks)."""
        if request.status is not RequestStatus.RUNNING or request.num_evicted:
            return  # (a compacted request's KV no longer matches its tokens' hashes)
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.kv.block_size,
                            self.model_config.model_id)
        self.kv.cache_blocks(request.request_id, request.block_hashes, end)

    def _finish(self, request: Request) -> None:
        self.scheduler.finish(request)
        if self.evictor is not None:
            self.evictor.forget(request.request_id)
        if self.drafter is not None:
            self.drafter.release(request)
        self.finished_requests.append(request)
        self.requests.pop(request.request_id, None)

    def _output(self, request: Request, new_ids: list[int], num_logprobs: int) -> StepOutput:
        reason = request.finish_reason
        prompt_lps = None
        if request.prompt_logprobs and new_ids and len(new_ids) == len(request.output_token_ids):
            # with the first token, once: the request keeps no copy (finished_requests holds
            # the last few requests, and a long prompt's entries are many)
            prompt_lps, request.prompt_logprobs = request.prompt_logprobs, []
        return StepOutput(  # positional, in field order: this runs for every request each step
            request.request_id, new_ids,
            request.output_logprobs[-num_logprobs:] if num_logprobs else None,
            reason is not None, reason.value if reason else None,
            len(request.prompt_token_ids), request.num_cached_tokens,
            len(request.output_token_ids), request.num_drafts, request.num_draft_tokens,
            request.num_accepted_tokens, None, prompt_lps)


def build_engine(config: EngineConfig, launcher: RankLauncher | None = None,
                 draft_address: Callable[[], str | None] | None = None) -> Engine:
    """Open the checkpoint (or draw dummy weights), build the runner, load the weights (with a
    progress bar). With tensor_parallel_size N, this process is rank 0 and `launcher` (local
    processes by default) starts the other N - 1 ranks, each loading its own shard."""
    checkpoint = open_model(config)
    check_tensor_parallel(checkpoint.config, config.tensor_parallel_size)
    group = None
    if config.tensor_parallel_size > 1:
        check_group_size(config)
        group = RankGroup(config, launcher)
    try:
        runner = load_runner(config, group.tp if group else TPGroup(), checkpoint,
                             config.load_progress)
        if group is not None:
            group.wait_ready()
            runner.followers = group
    except BaseException:
        if group is not None:
            group.close()
        raise
    model_config = checkpoint.config
    if runner.quantization and not checkpoint.quantization:  # quantized while loading
        # Different numerics, different KV: keep prefix-cache hashes apart from the original's.
        model_config = dataclasses.replace(
            model_config, model_id=f"{model_config.model_id}+{runner.quantization}")
    drafter = None
    if config.speculative_config is not None:
        drafter = build_drafter(config.speculative_config, runner, model_config,
                                draft_address)
    engine = Engine(runner, model_config, config, checkpoint.tokenizer, drafter)
    if runner.graphs is not None:
        engine.sampler.capture_graphs([g.logits for g in runner.graphs.graphs.values()])
    engine.generation_defaults = dict(checkpoint.generation_defaults)
    return engine
