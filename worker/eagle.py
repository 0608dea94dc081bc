"""EAGLE drafting (Li et al. 2024, EAGLE-1's head): a draft model over the target's own features.

    g_p = layer(fc([embed(x_{p+1}) ; f_p]))      f_p: the target's final hidden state at p
    draft logits at p = target_lm_head(g_p)       g_p is trained to be f_{p+1}

The head is one Llama decoder layer of the target's shape, an fc from [embedding ; feature] to
the hidden size, and the target's embedding and LM head (shared; own full copies when the target
is split over tensor-parallel ranks). Its KV cache is one layer of the target's block pool: the
same block ids, so a request's blocks, prefix-cache hits, preemption and rollback cover the
head's KV too, and the scheduler holds `num_speculative_tokens` slots past each request's
computed tokens for the chain below.

After each step (EagleDrafter.propose): for every request the step computed (and kept), the head
runs over the same positions with the target's features (the catch-up pass, batched like the
target's step); its output at the last kept position gives draft 1 (argmax). Each next draft
runs one position further on (draft j, the head's own previous output as the feature): k drafts
cost k small passes. A block the prefix cache shares was drafted over with the next token of the
request that computed it, which only costs acceptance.

A draft vocabulary: a head may carry the target's token ids ranked by how often the target
wrote them in training (`draft_vocab_ranking`) and a `draft_vocab_size` N in its config; drafts
are then the argmax over the N most frequent only, scored by those N rows of the target's LM
head. On a CPU the full LM head is most of a draft's cost (49152 rows for SmolLM2 against one
decoder layer); the verify step still scores the whole vocabulary, so outputs do not change,
only a draft the subset cannot express is lost (bench/spec_decode.py runs a head both ways).

A head is a directory: config.json (the target's shape it was trained for, the draft vocabulary
size) and model.safetensors (this module's state dict, and the ranking), written by `save_head`
(training: worker/eagle_train.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from mxserve.api.errors import ModelLoadError
from mxserve.kernels import cpu_linear
from mxserve.worker import draft_tree
from mxserve.worker.attention import AttentionBatch
from mxserve.worker.draft_spans import ChainEnd, Span
from mxserve.worker.model.checkpoint import set_default_permissions
from mxserve.worker.model.config import ModelConfig
from mxserve.worker.model.layers import RotaryEmbedding
from mxserve.worker.model.llama import LlamaDecoderLayer
from mxserve.worker.model.parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    can_pack_for_cpu,
)
from mxserve.worker.model.tp import TPGroup
from mxserve.worker.request import Request, RequestStatus
from mxserve.worker.spec_config import SpeculativeConfig

RANKING = "draft_vocab_ranking"  # its tensor's name in model.safetensors
# Draft trees while a verify stays within this many rows: the range where the CPU's int4 GEMMs
# (kernels/cpu_int4.py's AMX tiles) and attention take rows at little cost each; past it a
# tree's extra rows cost as much as the drafts they add (bench/results/spec_decode.trees.md).
TREE_VERIFY_ROWS = 16
HEAD_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
               "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
               "max_position_embeddings")
# The head shipped for the default model (SmolLM2-135M-Instruct), used when no model is given.
DEFAULT_HEAD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "heads",
                            "smollm2-135m-eagle")


class EagleHead(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                 embed: VocabParallelEmbedding | None = None,
                 lm_head: ParallelLMHead | None = None) -> None:
        super().__init__()
        self.config = cfg
        hidden = cfg.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=True, dtype=dtype, device=device)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                    cfg.rope_scaling, device)
        self.layer = LlamaDecoderLayer(cfg, TPGroup(), dtype, device, self.rope)
        # Not submodules: the target's (its weights are not the head's to save).
        self._embed, self._lm_head = embed, lm_head
        # the draft vocabulary: target ids ranked by frequency [num_ranked], and how many of
        # them drafts may be (0: the whole vocabulary)
        self.draft_vocab_ranking: torch.Tensor | None = None
        self.draft_vocab_size = 0
        self._draft_ids: torch.Tensor | None = None  # [N] the ranking's first N, on the device
        self._draft_weight: torch.Tensor | None = None  # [N, hidden]: their LM head rows
        self._draft_pairs: torch.Tensor | None = None  # the same for cpu_linear (pack_for_cpu)

    def attach(self, embed: VocabParallelEmbedding, lm_head: ParallelLMHead) -> bool:
        """Use the target's embedding and LM head; with a draft vocabulary, copy its rows of the
        LM head (a dense weight: False when the head holds none, packed or MX)."""
        self._embed, self._lm_head = embed, lm_head
        if not self.draft_vocab_size:
            return True
        weight = lm_head.embedding.weight if lm_head.tied else lm_head.weight
        if weight.dim() != 2 or weight.shape[0] < lm_head.num_local:
            return False
        ids = self.draft_vocab_ranking[:self.draft_vocab_size].to(weight.device)
        self._draft_ids, self._draft_weight = ids, weight[ids].clone()  # [N, hidden]
        return True

    def pack_for_cpu(self, int4: bool) -> None:
        """Inference on a CPU as the target's (runner.load_weights): the linears multiply from
        oneDNN's packed copies, `int4` adding 4-bit ones for a few rows, and the draft
        vocabulary's LM head rows from cpu_linear's float32-logit pairs when that kernel runs
        here. The head then drafts at a fraction of its dense cost; drafts may change (int4),
        outputs cannot (the verify decides). Once only: it replaces the trainable fc."""
        if not isinstance(self.fc, nn.Linear):
            return
        fc = ColumnParallelLinear(self.fc.in_features, [self.fc.out_features], True, TPGroup(),
                                  self.fc.weight.dtype, self.fc.weight.device)
        fc.weight.data.copy_(self.fc.weight.detach())
        fc.bias.data.copy_(self.fc.bias.detach())
        self.fc = fc
        for module in [fc, *self.layer.modules()]:
            if isinstance(module, ColumnParallelLinear | RowParallelLinear):
                module.pack_for_cpu(int4=int4)
        if self._draft_weight is not None and cpu_linear.available():
            self._draft_pairs = cpu_linear.pack_pairs(self._draft_weight)

    def draft_tokens(self, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """g [R, hidden] -> ([R] each row's draft: the target's id of the highest logit, over
        the draft vocabulary when the head has one; [R] the head's probability of it, its
        confidence)."""
        best = self._probs(g).max(-1)
        ids = best.indices if self._draft_ids is None else self._draft_ids[best.indices]
        return ids, best.values

    def draft_top(self, g: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """g [R, hidden] -> each row's k most likely drafts [R, k] (target ids) and their
        probabilities [R, k], most likely first (a draft tree's alternatives)."""
        best = self._probs(g).topk(k, -1)
        ids = best.indices if self._draft_ids is None else self._draft_ids[best.indices]
        return ids, best.values

    def _probs(self, g: torch.Tensor) -> torch.Tensor:
        if self._draft_weight is None:
            logits = self._lm_head(g, torch.float32)
        elif self._draft_pairs is not None:
            logits = cpu_linear.linear_f32(g, self._draft_pairs, self._draft_weight.shape[0])
        else:
            logits = F.linear(g.to(self._draft_weight.dtype), self._draft_weight)
        return logits.float().softmax(-1)

    def forward(self, token_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], attn, meta) -> torch.Tensor:
        # token_ids, positions [T]; features [T, hidden] -> the head's outputs g [T, hidden]
        self.rope.prepare(positions)
        x = self.fc(torch.cat([self._embed(token_ids), features.to(self._embed.weight.dtype)],
                              -1))
        h, residual = self.layer(x, None, positions, kv_cache, attn, meta)
        return h + residual


def head_config(target: ModelConfig, **overrides) -> ModelConfig:
    """The head's shape: the target's (one layer), with any HEAD_FIELDS overridden."""
    return dataclasses.replace(target, num_hidden_layers=1, **overrides)


def save_head(head: EagleHead, path: str, target_model_id: str = "",
              dtype: torch.dtype = torch.float32) -> None:
    """Write the head (its weights in `dtype`; loading casts them to the engine's) and its
    draft vocabulary, if any."""
    os.makedirs(path, exist_ok=True)
    cfg = {name: getattr(head.config, name) for name in HEAD_FIELDS}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"architecture": "EagleHead", "target_model_id": target_model_id, **cfg,
                   "draft_vocab_size": head.draft_vocab_size}, f, indent=1)
    state = {k: v.detach().to(dtype).contiguous().cpu() for k, v in head.state_dict().items()}
    if head.draft_vocab_ranking is not None:
        state[RANKING] = head.draft_vocab_ranking.to(torch.int64).contiguous().cpu()
    save_file(state, os.path.join(path, "model.safetensors"))
    set_default_permissions(os.path.join(path, "model.safetensors"))


def load_head(path: str, target: ModelConfig, dtype: torch.dtype,
              device: torch.device) -> EagleHead:
    """The head in `path`, for `target`; ModelLoadError naming the field that does not match."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ModelLoadError(f"speculative_config.model: {path} has no config.json "
                             "(an EAGLE head directory: mxserve train-draft writes one)")
    with open(config_path) as f:
        stored = json.load(f)
    for name in ("hidden_size", "vocab_size"):
        if stored.get(name) != getattr(target, name):
            raise ModelLoadError(f"speculative_config.model: the head's {name} "
                                 f"{stored.get(name)} does not match the target's "
                                 f"{getattr(target, name)}")
    head = EagleHead(head_config(target, **{k: stored[k] for k in HEAD_FIELDS if k in stored}),
                     dtype, device)
    state = load_file(os.path.join(path, "model.safetensors"), device=str(device))
    ranking = state.pop(RANKING, None)
    missing, unexpected = head.load_state_dict({k: v.to(dtype) for k, v in state.items()},
                                               strict=False)
    if missing or unexpected:
        raise ModelLoadError(f"speculative_config.model: {path}: missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}")
    size = stored.get("draft_vocab_size", 0)
    num_ranked = 0 if ranking is None else ranking.numel()
    if not isinstance(size, int) or not 0 <= size <= num_ranked:
        raise ModelLoadError(f"speculative_config.model: the head's draft_vocab_size {size!r} "
                             f"must be an integer in 0..{num_ranked} (the ids it ranks)")
    if ranking is not None and num_ranked and not (
            0 <= int(ranking.min()) and int(ranking.max()) < target.vocab_size):
        raise ModelLoadError(f"speculative_config.model: the head's {RANKING} holds ids "
                             f"outside the target's vocabulary (0..{target.vocab_size - 1})")
    head.draft_vocab_ranking, head.draft_vocab_size = ranking, size
    return head


class EagleDrafter:
    needs_hidden = True

    def __init__(self, config: SpeculativeConfig, runner, target: ModelConfig) -> None:
        path = config.model or DEFAULT_HEAD
        self.runner, self.k = runner, config.num_speculative_tokens
        self.min_confidence = config.min_draft_confidence
        self.num_lookahead_tokens = self.k
        self.tree = None  # (nodes' rank paths, parents): greedy requests draft this tree
        if config.tree is not None:
            if runner.device.type != "cpu" or runner.tp.size > 1:
                raise ValueError("speculative_config.tree runs on the CPU attention backends, "
                                 "one rank, for now")
            self.tree = draft_tree.from_paths(config.tree)
            self.num_lookahead_tokens = len(self.tree[0])
            from mxserve.worker.runner import context_limit

            self.max_model_len = context_limit(runner.config, target, runner.num_kv_blocks)
        self.head = load_head(path, target, runner.dtype, runner.device)
        model = runner.model
        # TP: the target's are split over the ranks: full copies on this rank. A draft
        # vocabulary's rows come from a dense LM head: read from the checkpoint when the
        # target's is packed or MX.
        if runner.tp.size > 1 or not self.head.attach(model.embed_tokens, model.lm_head):
            self.head.attach(*_full_embedding_and_head(runner, target))
        cfg = self.head.config
        shape = (runner.num_kv_blocks, runner.config.block_size,
                 cfg.num_key_value_heads, cfg.head_dim)
        self.kv_cache = (torch.zeros(shape, dtype=runner.dtype, device=runner.device),
                         torch.zeros(shape, dtype=runner.dtype, device=runner.device))
        runner.extra_kv_caches.append(self.kv_cache)  # KV eviction moves it with the target's
        pack_head_for_cpu(self.head, runner.config)
        self.attn = runner.attn
        # The round as CUDA graph replays wherever the target verifies in graphs.
        self.graphs = None
        if runner.verify_graphs is not None:
            from mxserve.worker.cuda_graphs import EagleGraphs

            self.graphs = EagleGraphs(self.head, self.kv_cache, runner,
                                      runner.verify_graphs.max_model_len, self.k)
            self.graphs.capture()

    def release(self, request: Request) -> None:
        pass  # the head's KV is in the request's own blocks

    def propose(self, plan, hidden: torch.Tensor, num_drafts: dict) -> None:
        kept = kept_spans(plan)
        if not kept:
            return
        offsets = kept_offsets(plan, kept)
        asked = [num_drafts.get(s.request, 0) for s, _ in kept]
        spans = [Span(s.start_position, n, s.block_table, s.position_offset) for s, n in kept]
        tokens = [t for s, n in kept for t in _next_tokens(
            s.request, s.start_position + s.position_offset, n)]
        if self.graphs is not None and self.graphs.fits_spans(spans):
            drafts, _ = self.graphs.draft(spans, tokens, hidden, offsets, asked,
                                          self.min_confidence,
                                          [s.table_version for s, _ in kept])
        else:
            if any(s.kept_draft_rows for s, _ in kept):
                rows = [r for (s, n), off in zip(kept, offsets) for r in kept_rows(s, n, off)]
                features = hidden[torch.tensor(rows, device=hidden.device)]
            else:
                features = torch.cat([hidden[off:off + n] for (_, n), off in zip(kept, offsets)])
            trees = None
            if self.tree is not None:
                trees = self._tree_spans(kept, asked, len(num_drafts))
            drafts, _ = draft_round(
                self.head, self.kv_cache, self.attn, self.runner.config.block_size, spans,
                tokens, features, asked, self.min_confidence, self.tree, trees)
        for (s, _), d in zip(kept, drafts):
            if s.request in num_drafts:
                if isinstance(d, tuple):  # a tree: (tokens, parents)
                    s.request.draft_token_ids, s.request.draft_parents = d
                else:
                    s.request.draft_token_ids = d

    def _tree_spans(self, kept: list, asked: list[int], num_drafting: int) -> list[bool]:
        """Which kept spans draft the tree: greedy requests asked for k drafts with room for
        every node, while the next verify stays within TREE_VERIFY_ROWS rows (each drafting
        request counted at a chain's k + 1 rows, a tree adding its extra nodes), so trees go
        to small batches, where extra rows cost least."""
        nodes = len(self.tree[0])
        extra = nodes - self.k
        rows = num_drafting * (self.k + 1)
        trees = []
        for (s, _), a in zip(kept, asked):
            grow = (a == self.k and s.request.sampling_params.greedy
                    and s.request.num_tokens + nodes <= self.max_model_len
                    and rows + extra <= TREE_VERIFY_ROWS)
            rows += extra if grow else 0
            trees.append(grow)
        return trees


def pack_head_for_cpu(head: EagleHead, config) -> None:
    """Pack the head as the engine (EngineConfig `config`) packs its target on a CPU; int4
    unless the engine was told not to: on SmolLM2's held-out chat prompts the head's 4-bit copy
    drafts as well as its bf16 one at less than half the cost (bench/results/spec_decode.md)."""
    if config.pack_cpu_weights and can_pack_for_cpu(config.torch_dtype, config.torch_device):
        head.pack_for_cpu(int4=config.cpu_int4 is not False)


def kept_spans(plan) -> list[tuple]:
    """(scheduled request, positions it kept) of each request of the finished plan that still
    runs and kept some: the positions start_position .. + kept - 1 the head catches up on (in
    the request's held tokens: KV eviction's compaction comes only before the next step)."""
    out = []
    for s in plan.scheduled:
        kept = s.request.num_computed_tokens - s.request.num_evicted - s.start_position
        if s.request.status is RequestStatus.RUNNING and kept > 0:
            out.append((s, kept))
    return out


def kept_offsets(plan, kept: list[tuple]) -> list[int]:
    """Each kept span's first row in the step's hidden states (plan order)."""
    offsets, at = {}, 0
    for s in plan.scheduled:
        offsets[id(s)] = at
        at += s.num_new_tokens
    return [offsets[id(s)] for s, _ in kept]


def kept_rows(s, kept: int, offset: int) -> list[int]:
    """The step's hidden-state rows of a request's `kept` positions, its first row at `offset`:
    consecutive, but for a draft tree's the kept nodes' rows after the root's."""
    if not s.kept_draft_rows:
        return list(range(offset, offset + kept))
    root = offset + s.num_new_tokens - s.num_draft_tokens - 1
    rows = list(range(offset, root + 1)) + [root + 1 + j for j in s.kept_draft_rows]
    return rows[:kept]


def _next_tokens(request: Request, start: int, length: int) -> list[int]:
    """The tokens after positions start .. start + length - 1: the head's token inputs."""
    return request.all_token_ids[start + 1:start + length + 1]


def draft_round(head: EagleHead, kv_cache: tuple[torch.Tensor, torch.Tensor], attn,
                block_size: int, spans: list[Span], tokens: list[int], features: torch.Tensor,
                num_drafts: list[int], min_confidence: float = 0.0,
                tree: tuple[list, list[int]] | None = None, trees: list[bool] | None = None
                ) -> tuple[list, list[ChainEnd | None]]:
    """One drafting round for a batch of requests (the local drafter's and the draft replica's,
    worker/draft_server.py): the catch-up pass over each span's positions (`tokens` and
    `features` flat in span order), then a chain of single positions from each span's last
    output, up to num_drafts[i] drafts for span i (0: catch up only). A span's chain ends
    before its first draft the head gives less than `min_confidence` (its softmax probability):
    such a draft is seldom accepted, and on a CPU each verified row costs (SpeculativeConfig).
    With `tree` (draft_tree.from_paths' nodes and parents), span i with trees[i] drafts that
    tree instead (`_grow`): its entry is (tokens, parents). Returns the drafts per span and
    where each chain ended (None: no drafts asked, or a tree)."""
    order = sorted(range(len(spans)), key=lambda i: spans[i].length != 1)  # decodes first
    rows, at = [], 0
    for sp in spans:
        rows.append(range(at, at + sp.length))
        at += sp.length
    flat = [r for i in order for r in rows[i]]
    device = features.device
    g = _run(head, kv_cache, attn, block_size, [spans[i] for i in order],
             [tokens[r] for r in flat], features[torch.tensor(flat, device=device)]
             if flat != list(range(len(flat))) else features)
    last, at = {}, -1
    for i in order:
        at += spans[i].length
        last[i] = at
    grown = [i for i in order if trees and trees[i] and num_drafts[i] > 0]
    chain = [i for i in order if num_drafts[i] > 0 and not (trees and trees[i])]
    drafts: list = [[] for _ in spans]
    ends: list[ChainEnd | None] = [None] * len(spans)
    if grown:
        roots = [Span(spans[i].start + spans[i].length, 1, spans[i].block_table,
                      spans[i].offset) for i in grown]
        for i, d in zip(grown, _grow(head, kv_cache, attn, block_size, g[[last[i] for i in grown]],
                                     roots, *tree, min_confidence)):
            drafts[i] = d
    if chain:
        g = g[[last[i] for i in chain]]  # each drafting request's last output
        out, chain_ends = _chain(head, kv_cache, attn, block_size, g,
                                 [Span(spans[i].start + spans[i].length, 1,
                                       spans[i].block_table, spans[i].offset) for i in chain],
                                 [num_drafts[i] for i in chain], min_confidence)
        for i, d, e in zip(chain, out, chain_ends):
            drafts[i], ends[i] = d, e
    return drafts, ends


def draft_ahead(head: EagleHead, kv_cache: tuple[torch.Tensor, torch.Tensor], attn,
                block_size: int, ends: list[ChainEnd], num_drafts: int,
                min_confidence: float = 0.0, stop: Callable[[], bool] | None = None
                ) -> tuple[list[int], list[list[int]], list[ChainEnd]] | None:
    """Run-ahead (the draft replica's, between a round's answer and the next round): for each
    chain end, the round after it as if the target kept every draft and added the head's guess
    at its next token. Returns the guesses, the next round's drafts (up to num_drafts, the
    confidence floor applying) and where those chains ended; None when `stop()` said to give
    up (checked before each pass of the head: a round waiting to be drafted goes first)."""
    if stop is not None and stop():
        return None
    last = [i for i, e in enumerate(ends) if not e.guess]
    starts = list(ends)
    if last:  # the head runs on the last draft first: its output guesses the target's token
        g = _run(head, kv_cache, attn, block_size,
                 [Span(ends[i].position, 1, ends[i].block_table, ends[i].offset) for i in last],
                 [ends[i].token for i in last], torch.stack([ends[i].feature for i in last]))
        ids, _ = head.draft_tokens(g)
        for n, (i, t) in enumerate(zip(last, ids.tolist())):
            e = ends[i]
            starts[i] = ChainEnd(e.position + 1, t, g[n], True, e.block_table, e.offset)
        if stop is not None and stop():
            return None
    g = _run(head, kv_cache, attn, block_size,
             [Span(e.position, 1, e.block_table, e.offset) for e in starts],
             [e.token for e in starts], torch.stack([e.feature for e in starts]))
    chained = _chain(head, kv_cache, attn, block_size, g,
                     [Span(e.position + 1, 1, e.block_table, e.offset) for e in starts],
                     [num_drafts] * len(starts), min_confidence, stop)
    return None if chained is None else ([e.token for e in starts], *chained)


def _chain(head: EagleHead, kv_cache, attn, block_size: int, g: torch.Tensor,
           at: list[Span], num_drafts: list[int], min_confidence: float,
           stop: Callable[[], bool] | None = None
           ) -> tuple[list[list[int]], list[ChainEnd]] | None:
    """Chains of drafts: g [R, hidden] the head's outputs that predict each chain's first
    draft; at[i].start where the head runs on chain i's first draft (its blocks, its RoPE
    offset). Up to num_drafts[i] drafts each (>= 1), a chain ending before a draft below
    min_confidence. None when `stop()` says so before a pass of the head."""
    chain = list(range(len(at)))
    positions = [a.start for a in at]
    drafts: list[list[int]] = [[] for _ in at]
    ends: list[ChainEnd | None] = [None] * len(at)
    for j in range(max(num_drafts)):
        ids, confidence = head.draft_tokens(g)
        ids, sure = ids.tolist(), (confidence >= min_confidence).tolist()
        keep = []
        for n, i in enumerate(chain):
            if sure[n]:
                drafts[i].append(ids[n])
            if not sure[n] or num_drafts[i] == j + 1:
                ends[i] = ChainEnd(positions[i] + j, ids[n], g[n], not sure[n],
                                   at[i].block_table, at[i].offset)
            else:
                keep.append(n)
        if not keep:
            break
        if stop is not None and stop():
            return None
        steps = [Span(positions[chain[n]] + j, 1, at[chain[n]].block_table,
                      at[chain[n]].offset) for n in keep]
        g = _run(head, kv_cache, attn, block_size, steps, [ids[n] for n in keep], g[keep])
        chain = [chain[n] for n in keep]
    return drafts, ends


def _grow(head: EagleHead, kv_cache, attn, block_size: int, g: torch.Tensor,
          roots: list[Span], nodes: list[tuple[int, ...]], parents: list[int],
          min_confidence: float) -> list[tuple[list[int], list[int]]]:
    """Draft trees, a depth at a time: g [R, hidden] the head's outputs that predict each
    request's first drafts, roots[i].start the position the head runs on those. Node j (rank
    path nodes[j]) is its parent's nodes[j][-1]-th most likely next token, left out (with its
    subtree) below min_confidence; the head then runs on each kept node that has children, at
    its depth's position, its KV at root + j, attending to its path (row_contexts): what a chain
    computes, on each branch. Returns each request's (tokens, parents) in tree order."""
    depth_of = draft_tree.depths(parents)
    children: dict[int, list[int]] = {}
    for j, p in enumerate(parents):
        children.setdefault(p, []).append(j)
    tokens: list[list[int | None]] = [[None] * len(nodes) for _ in roots]
    outputs = {-1: (list(range(len(roots))), g)}  # node -> (requests that have it, head out)
    for depth in range(1, max(depth_of) + 1):
        for p, (reqs, out) in outputs.items():
            if p not in children:
                continue
            ids, probs = head.draft_top(out, max(nodes[j][-1] for j in children[p]) + 1)
            ids, sure = ids.tolist(), (probs >= min_confidence).tolist()
            for n, i in enumerate(reqs):
                for j in children[p]:
                    if sure[n][nodes[j][-1]]:
                        tokens[i][j] = ids[n][nodes[j][-1]]
        grow = [(i, j) for j in range(len(nodes)) if depth_of[j] == depth and j in children
                for i in range(len(roots)) if tokens[i][j] is not None]
        if not grow:
            break
        inputs = {}  # each grown node's feature: its parent's head output row
        for p, (reqs, out) in outputs.items():
            for n, i in enumerate(reqs):
                inputs[(i, p)] = out[n]
        meta = attn.build_metadata(AttentionBatch(
            query_lens=[1] * len(grow),
            start_positions=[roots[i].start + j for i, j in grow],
            block_tables=[roots[i].block_table for i, _ in grow], num_decodes=len(grow),
            block_size=block_size, device=g.device, query_rows=[True] * len(grow),
            row_contexts=[[(roots[i].start, [roots[i].start + a
                                             for a in draft_tree.path(parents, j)])]
                          for i, j in grow]))
        positions = torch.tensor([roots[i].start + roots[i].offset + depth - 1 for i, _ in grow],
                                 dtype=torch.long, device=g.device)
        ids = torch.tensor([tokens[i][j] for i, j in grow], dtype=torch.long, device=g.device)
        features = torch.stack([inputs[(i, parents[j])] for i, j in grow])
        out = head(ids, features, positions, kv_cache, attn, meta)
        outputs = {}
        for n, (i, j) in enumerate(grow):
            reqs, rows = outputs.setdefault(j, ([], []))
            reqs.append(i)
            rows.append(n)
        outputs = {j: (reqs, out[rows]) for j, (reqs, rows) in outputs.items()}
    result = []
    for i in range(len(roots)):  # the kept nodes (their parents kept too), renumbered
        index, toks, pars = {}, [], []
        for j in range(len(nodes)):
            if tokens[i][j] is not None and (parents[j] < 0 or parents[j] in index):
                index[j] = len(toks)
                toks.append(tokens[i][j])
                pars.append(index[parents[j]] if parents[j] >= 0 else -1)
        result.append((toks, pars))
    return result


def _run(head: EagleHead, kv_cache, attn, block_size: int, spans: list[Span],
         tokens: list[int], features: torch.Tensor) -> torch.Tensor:
    """The head over the spans' positions (single positions first), `tokens` and `features`
    flat in span order; its KV goes to each span's blocks."""
    device = features.device
    meta = attn.build_metadata(AttentionBatch(
        query_lens=[sp.length for sp in spans], start_positions=[sp.start for sp in spans],
        block_tables=[sp.block_table for sp in spans],
        num_decodes=sum(sp.length == 1 for sp in spans), block_size=block_size, device=device,
        query_rows=[True] * len(spans)))  # drafts only: the cheaper path wherever there is one
    ids = torch.tensor(tokens, dtype=torch.long, device=device)
    positions = torch.tensor([p for sp in spans for p in range(sp.start + sp.offset,
                                                                 sp.start + sp.offset + sp.length)],
                             dtype=torch.long, device=device)
    return head(ids, features, positions, kv_cache, attn, meta)


def _full_embedding_and_head(runner, target: ModelConfig):
    """The target's whole embedding and LM head on this rank (its own are vocabulary slices)."""
    from mxserve.worker.runner import open_model

    return load_embedding_and_head(open_model(runner.config), target, runner.dtype,
                                   runner.device)


def load_embedding_and_head(checkpoint, target: ModelConfig, dtype: torch.dtype,
                            device: torch.device):
    """The checkpoint's whole embedding and LM head (tied: one weight), read from it alone."""
    tp1 = TPGroup()
    embed = VocabParallelEmbedding(target.vocab_size, target.hidden_size, tp1, dtype, device)
    head = ParallelLMHead(embed if target.tie_word_embeddings else None, target.vocab_size,
                          target.hidden_size, tp1, dtype, device)
    for name, tensor in checkpoint.weights(progress=False):
        if name == "model.embed_tokens.weight":
            embed.load(tensor.to(dtype))
        elif name == "lm_head.weight":
            head.load(tensor.to(dtype))
    return embed, head
