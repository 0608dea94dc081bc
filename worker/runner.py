"""Model runner: turns a StepPlan into input tensors, runs the model, returns logits."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NoReturn, Protocol

import numpy as np
import torch

from mxserve.api.errors import ModelLoadError
from mxserve.kernels import cpu_attention, cpu_linear
from mxserve.worker import draft_tree
from mxserve.worker.attention import AttentionBatch
from mxserve.worker.attention_backends import get_attention_backend
from mxserve.worker.config import EngineConfig
from mxserve.worker.host_to_device import fill_inflight_tokens, to_device
from mxserve.worker.model.checkpoint import Checkpoint
from mxserve.worker.model.config import ModelConfig
from mxserve.worker.model.llama import LlamaForCausalLM
from mxserve.worker.model.parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    can_pack_for_cpu,
)
from mxserve.worker.model.tp import TPGroup
from mxserve.worker.prompt_logprobs import PromptLogprobs, compute_prompt_logprobs
from mxserve.worker.scheduler import StepPlan


class Followers(Protocol):
    """Rank 0's view of the other ranks of its tensor-parallel group (tp_executor.RankGroup)."""

    def send(self, plan: StepPlan) -> None:
        """Hand them the step before rank 0 runs it; RankFailure when one has gone."""

    def fail(self, reason: str) -> NoReturn:
        """Mark the group failed for good (its collectives are out of step); RankFailure."""

    def check(self) -> None:
        """RankFailure once any rank has exited, failed or hung."""

    def read_blocks(self, block_ids: Sequence[int]) -> list[bytes]:
        """Each other rank's shard of these KV blocks (KV transfers, worker/kv_transfer.py)."""

    def write_blocks(self, block_ids: Sequence[int], shards: Sequence[bytes]) -> None:
        """Write each other rank's shard of these KV blocks."""

    def close(self) -> None:
        """Stop them; the group takes no step after."""


@dataclass
class StepResult:
    """The runner's answer to a StepPlan."""

    # [num_sampling, vocab] float32: a row per scheduled request with `samples` True, in plan
    # order; 1 + num_draft_tokens rows for a request verifying drafts.
    logits: torch.Tensor
    # Final hidden states [num_tokens, hidden] of every token of the plan, in plan order, when
    # plan.keep_hidden (a drafter reads them); else None.
    hidden_states: torch.Tensor | None = None
    # The static logits buffer of the decode graph replayed (`logits` is its first rows when
    # every row samples, else a copy), for the sampler's own graphs of it (sampler_graphs.py:
    # SampleGraph, ArgmaxGraph); None for an eager step.
    static_logits: torch.Tensor | None = None
    # KV eviction: attention mass [num_scheduled, longest context] fp32 (plan.mass_window).
    attn_mass: torch.Tensor | None = None
    # The prompt logprobs of the plan's prefill chunks that ask for them, on the device
    # (plan.has_prompt_logprobs); else None.
    prompt_logprobs: PromptLogprobs | None = None


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, tp: TPGroup | None = None) -> int:
    """K and V of every layer for one token, on one tensor-parallel rank."""
    elem = torch.empty(0, dtype=dtype).element_size()
    start, stop = (tp or TPGroup()).kv_heads(cfg.num_key_value_heads)
    return 2 * cfg.num_hidden_layers * (stop - start) * cfg.head_dim * elem


def _quantization(config: EngineConfig) -> str | None:
    """The MX format of the decoder linears: the checkpoint's own (an `mxserve quantize`
    directory), else `config.quantization` (quantize while loading), else None."""
    from mxserve.worker.model.loader import declared_quantization

    declared = declared_quantization(config.model)
    if declared and config.quantization not in (None, declared):
        raise ModelLoadError(f"{config.model} is quantized to {declared} already; "
                             f"quantization={config.quantization!r} can't re-quantize it")
    return declared or config.quantization


def open_model(config: EngineConfig) -> Checkpoint:
    """config.model's checkpoint, or dummy weights of its shape (`load_format`)."""
    from mxserve.worker.model.loader import open_checkpoint

    if config.load_format == "dummy":
        from mxserve.worker.model.dummy import open_dummy

        return open_dummy(config.model, config.torch_device, config.torch_dtype, config.seed)
    return open_checkpoint(config.model)


def context_limit(config: EngineConfig, model_config: ModelConfig, num_kv_blocks: int) -> int:
    """The longest request: max_model_len (else the model's), capped so one request always fits
    the KV pool alone (else a request growing past the pool would preempt itself forever)."""
    limit = config.max_model_len or model_config.max_position_embeddings
    return min(limit, num_kv_blocks * config.block_size)


def load_runner(config: EngineConfig, tp: TPGroup, checkpoint: Checkpoint | None = None,
                progress: bool = False) -> ModelRunner:
    """This rank's runner: its shard of the weights read (only its slices) and loaded, the
    decode graphs captured. Every rank of a group calls it alike (the capture runs the model's
    collectives)."""
    if config.threads_per_rank:
        torch.set_num_threads(config.threads_per_rank)
    checkpoint = checkpoint or open_model(config)
    runner = ModelRunner(checkpoint.config, config, tp)
    runner.load_weights(checkpoint.weights(progress=progress,
                                           slice_for=runner.model.tensor_slice),
                        checkpoint.linear_bits)
    runner.capture_cuda_graphs(context_limit(config, checkpoint.config, runner.num_kv_blocks))
    return runner


class ModelRunner:
    """Owns the model weights and the per-layer KV cache tensors of one worker (one TP rank)."""

    def __init__(self, model_config: ModelConfig, config: EngineConfig,
                 tp: TPGroup | None = None) -> None:
        self.model_config = model_config
        self.config = config
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        self.tp = tp or TPGroup()
        self.quantization = _quantization(config)
        self.model = LlamaForCausalLM(model_config, self.tp, self.dtype, self.device,
                                      self.quantization, config.quantize_lm_head,
                                      config.gemv)
        self.attn = get_attention_backend(self._attention_backend_name())
        self.num_kv_blocks = config.num_kv_blocks or self._blocks_for_memory()
        self.kv_caches = self._allocate_kv_caches(self.num_kv_blocks)
        self.graphs = None  # DecodeGraphs once captured (capture_cuda_graphs)
        self.verify_graphs = None  # VerifyGraphs, likewise, when the engine speculates
        # KV caches laid out as the model's and indexed by the same slots (an EAGLE head's):
        # KV eviction's moves apply to them too.
        self.extra_kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Rank 0 of a tensor-parallel group: the other ranks, sent each step's plan
        # (tp_executor.RankGroup); None on one rank and on the other ranks themselves.
        self.followers: Followers | None = None

    def _attention_backend_name(self) -> str:
        """config.attention_backend; "auto": Triton on CUDA, else the CPU kernel where this
        machine builds it for the model's dtype and shape, else plain torch."""
        name = self.config.attention_backend
        if name == "auto" and self.device.type == "cuda":
            return "triton"
        if name not in ("auto", "cpu"):
            return name
        attn = self.model.layers[0].self_attn
        shape = (attn.num_heads, attn.num_kv_heads, attn.head_dim, self.config.block_size)
        cpu_ok = self.device.type == "cpu" and cpu_attention.available(self.dtype, *shape)
        if name == "cpu" and not cpu_ok:
            raise ValueError(f"attention_backend 'cpu' needs a CPU float32/bfloat16 model with "
                             f"head_dim a multiple of 16 and a C compiler; got {self.device} "
                             f"{self.dtype}, (Hq, Hkv, head_dim, block_size) = {shape}")
        return "cpu" if cpu_ok else "torch"

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     linear_bits: int | None = None) -> None:
        """linear_bits: the checkpoint's (`Checkpoint.linear_bits`), for `config.cpu_int4`."""
        self.model.load_weights(weights)
        if self.device.type == "cpu" and self.dtype == torch.bfloat16 and cpu_linear.available():
            self.model.lm_head.use_float32_logits()  # whether or not the rest is packed
        if self.config.pack_cpu_weights and can_pack_for_cpu(self.dtype, self.device):
            int4 = self.config.cpu_int4
            int4 = linear_bits == 4 if int4 is None else int4
            for module in self.model.modules():
                if isinstance(module, ColumnParallelLinear | RowParallelLinear | ParallelLMHead):
                    module.pack_for_cpu(int4=int4)

    def capture_cuda_graphs(self, max_model_len: int) -> None:
        """Capture the decode CUDA graphs (cuda_graphs.py), and the verify graphs when the engine
        speculates, when on CUDA with the Triton backend and not `enforce_eager`; otherwise do
        nothing. Call once, after the weights are loaded:
        the graphs hold the addresses of the weights and the KV caches."""
        if self.config.enforce_eager or self.device.type != "cuda" \
                or type(self.attn).__name__ != "TritonAttention":
            return
        from mxserve.worker.cuda_graphs import DecodeGraphs, VerifyGraphs

        # H2O: the decode graphs return attention mass. Verify graphs neither do nor offset
        # positions, so a speculating engine with eviction verifies eagerly.
        self.graphs = DecodeGraphs(self, max_model_len,
                                   with_mass=self.config.kv_eviction == "h2o")
        self.graphs.capture()
        spec = self.config.speculative_config
        if spec is not None and not self.config.kv_eviction:
            self.verify_graphs = VerifyGraphs(self, max_model_len,
                                              spec.num_speculative_tokens + 1)
            self.verify_graphs.capture()

    def _blocks_for_memory(self) -> int:
        per_block = kv_bytes_per_token(self.model_config, self.dtype, self.tp)
        per_block *= self.config.block_size
        return max(1, int(self.config.kv_cache_memory_gb * 2**30) // per_block)

    def _allocate_kv_caches(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        cfg, attn = self.model_config, self.model.layers[0].self_attn
        shape = (num_blocks, self.config.block_size, attn.num_kv_heads,
                 cfg.head_dim)  # [num_blocks, block_size, num_kv_heads on this rank, head_dim]
        return [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                 torch.zeros(shape, dtype=self.dtype, device=self.device))
                for _ in range(cfg.num_hidden_layers)]

    def shutdown(self) -> None:
        if self.followers is not None:
            self.followers.close()

    def execute(self, plan: StepPlan) -> StepResult:
        """Run the plan's model step (on every rank of a group: rank 0 sends it to the others
        first). A failure on a group fails the group for good: its collectives are out of step."""
        if self.followers is None:
            return self._execute(plan)
        self.followers.send(plan)
        try:
            return self._execute(plan)
        except Exception as e:
            self.followers.fail(f"a step failed on the tensor-parallel group: {e!r}")

    @torch.inference_mode()
    def _execute(self, plan: StepPlan) -> StepResult:
        if plan.kv_moves:  # KV eviction's compaction, before any step reads the KV: every
            # request's moves at once (their sources are read before any slot is written)
            src, dst = zip(*plan.kv_moves)
            self.move_kv(np.concatenate(src), np.concatenate(dst))
        # A step with prompt logprobs runs eagerly: the graphs make only the sampling rows'
        # logits (a 1-token prompt chunk would otherwise fit the decode graphs).
        if self.graphs is not None:
            if self.graphs.can_run(plan) and not plan.has_prompt_logprobs:
                logits, hidden = self.graphs.run(plan)
                mass = self.graphs.last_mass(len(plan.scheduled))
                return StepResult(logits=logits, hidden_states=hidden if plan.keep_hidden
                                  else None,
                                  static_logits=self.graphs.graphs[self.graphs.last_size].logits,
                                  attn_mass=None if mass is None else self.tp.all_reduce(mass))
            self.graphs.last_size = None
        if self.verify_graphs is not None:
            if self.verify_graphs.can_run(plan) and not plan.has_prompt_logprobs:
                logits, hidden = self.verify_graphs.run(plan)
                return StepResult(logits=logits,
                                  hidden_states=hidden if plan.keep_hidden else None)
            self.verify_graphs.last_size = None
        if not plan.scheduled:
            return StepResult(logits=torch.empty(0, 0))
        input_ids, positions, sample_rows = self._prepare_inputs(plan)
        meta = self.attn.build_metadata(AttentionBatch(
            query_lens=[s.num_new_tokens for s in plan.scheduled],
            start_positions=[s.start_position for s in plan.scheduled],
            block_tables=[s.block_table for s in plan.scheduled],
            num_decodes=plan.num_decodes, block_size=self.config.block_size, device=self.device,
            mass_window=plan.mass_window,
            query_rows=[s.num_draft_tokens > 0 for s in plan.scheduled]
            if any(s.num_draft_tokens for s in plan.scheduled) else None,
            row_contexts=[_tree_contexts(s) for s in plan.scheduled]
            if any(s.draft_parents for s in plan.scheduled) else None))
        hidden = self.model(input_ids, positions, self.kv_caches, self.attn, meta)  # [T, hidden]
        # logits only for the rows that pick a next token
        logits = self.model.compute_logits(hidden[sample_rows])
        mass = None
        if plan.mass_window:  # each rank saw its own heads: the group sums them
            mass = self.tp.all_reduce(meta.mass)
        prompt_lps = None
        if plan.has_prompt_logprobs:  # (on every rank: compute_logits gathers the vocabulary)
            prompt_lps = compute_prompt_logprobs(plan, hidden, self.model.compute_logits)
        return StepResult(logits=logits, hidden_states=hidden if plan.keep_hidden else None,
                          attn_mass=mass, prompt_logprobs=prompt_lps)

    def move_kv(self, src: np.ndarray | list[int], dst: np.ndarray | list[int],
                drafter_too: bool = True) -> None:
        """Copy the KV of flat slots `src` to slots `dst` in every layer (all sources are read
        before any is written): KV eviction's compaction; a draft tree's kept nodes with
        drafter_too False (the drafter's own KV there is recomputed by its catch-up)."""
        if not len(src):
            return
        src_t = torch.from_numpy(np.asarray(src, dtype=np.int64)).to(self.device)
        dst_t = torch.from_numpy(np.asarray(dst, dtype=np.int64)).to(self.device)
        layers = self.kv_caches + (self.extra_kv_caches if drafter_too else [])
        for cache in (c for pair in layers for c in pair):
            flat = cache.view(-1, *cache.shape[2:])
            flat.index_copy_(0, dst_t, flat.index_select(0, src_t))

    def _prepare_inputs(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        inflight: list[tuple[int, int]] = []  # (token index, row of plan.inflight_tokens)
        for s in plan.scheduled:
            ids.extend(s.token_ids)
            if s.inflight_row >= 0:
                inflight.append((len(ids), s.inflight_row))
                ids.append(0)  # filled on the device below
            first = s.start_position + s.position_offset
            if s.draft_parents:  # a draft tree: each node at the root's position + its depth
                root = first + s.num_new_tokens - s.num_draft_tokens - 1
                positions.extend(range(first, root + 1))
                positions.extend(root + d for d in draft_tree.depths(s.draft_parents))
            else:
                positions.extend(range(first, first + s.num_new_tokens))
            if s.samples:  # the last position, and each draft's
                sample_rows.extend(range(len(ids) - 1 - s.num_draft_tokens, len(ids)))
        input_ids = to_device(ids, torch.long, self.device)
        if inflight:
            fill_inflight_tokens(input_ids, inflight, plan.inflight_tokens)
        return (input_ids, to_device(positions, torch.long, self.device),
                to_device(sample_rows, torch.long, self.device))


def _tree_contexts(s) -> list[tuple[int, list[int]]] | None:
    """A scheduled request's rows' attention contexts when it verifies a draft tree (slots in
    its table: start_position onwards), else None."""
    if not s.draft_parents:
        return None
    num_before = s.num_new_tokens - s.num_draft_tokens - 1
    return draft_tree.contexts(s.start_position + num_before, num_before, s.draft_parents)
