"""The EAGLE head served apart from its target (`speculative_config.draft_placement="replica"`):
one DraftServer drafts for the requests of many target workers, batching their rounds.

A target worker, after each step, sends for each request it kept positions of (a round):

    key         the request, unique across targets ("<target id>/<request id>")
    start       the first position the step computed
    tokens      the request's tokens at start .. start + kept (the last: the one just sampled)
    features    [kept, hidden]: the target's final hidden states at start .. start + kept - 1
    num_drafts  drafts wanted (0: catch up only)
    prefix      on a request's first round with start > 0 (a prefix-cache hit on the target):
                the hashes of its blocks before start

and gets back the drafts (worker/eagle.draft_round, the same computation as the local drafter).

The head's KV lives here, in a paged pool of its own with a prefix cache keyed by the target's
block hashes (recomputed here from the tokens, with the target's model id): what any target's
request computed serves the next request sharing that prefix, as the local drafter's share of
the target's pool does. Positions the head never saw (a prefix this pool lacks, or rounds lost
while the replica was unreachable) hold zeros: drafts get worse there, outputs do not change
(the target verifies every draft). A request's state goes when its target releases it, or,
least recently used first, when the pool is short.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from mxserve.api.block_hash import extend_block_hashes
from mxserve.kernels import cpu_attention
from mxserve.worker.attention_backends import get_attention_backend
from mxserve.worker.config import EngineConfig
from mxserve.worker.draft_spans import ChainEnd, Span
from mxserve.worker.eagle import (
    DEFAULT_HEAD,
    draft_ahead,
    draft_round,
    load_embedding_and_head,
    load_head,
    pack_head_for_cpu,
)
from mxserve.worker.kv_cache import KVCacheManager
from mxserve.worker.runner import open_model


@dataclass
class DraftRound:
    key: str
    start: int
    tokens: list[int]  # positions start .. start + kept: kept + 1 tokens
    num_drafts: int
    prefix: list[int] | None = None  # block hashes before start, on a first round

    @property
    def kept(self) -> int:
        return len(self.tokens) - 1


@dataclass
class _State:
    """A request's record here: its tokens so far (-1 where unknown), their block hashes, and
    how far the head's KV is valid."""

    tokens: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    end: int = 0
    model_id: str = ""  # the target's, salting the hashes
    hashable: bool = True  # False once some earlier tokens are unknown here
    chain: ChainEnd | None = None  # where the last round's chain of drafts stopped
    next_start: int = 0  # the next round's start (the position after the last kept one)
    drafts: list[int] = field(default_factory=list)  # the last round's answer
    ahead: _Ahead | None = None  # run-ahead's drafts for the next round
    # Its last round kept every draft of the answer before it (or that answer had none):
    # run-ahead drafts only for such requests (`run_ahead`).
    kept_all: bool = True


@dataclass
class _Ahead:
    """Drafts prepared for a request's next round, should its target keep every draft of the
    last one and add the token the head guessed."""

    tokens: list[int]  # that round's new tokens: the last drafts, then the guess
    drafts: list[int]
    end: ChainEnd  # where their chain stopped


class DraftServer:
    """The head for `config.model`'s target (config: the target's EngineConfig; its
    speculative_config names the head and k), its own KV pool of `num_blocks` blocks."""

    def __init__(self, config: EngineConfig, num_blocks: int = 4096) -> None:
        spec = config.speculative_config
        if spec is None or spec.method != "eagle":
            raise ValueError("a draft server needs speculative_config with method 'eagle'")
        self.k, self.min_confidence = spec.num_speculative_tokens, spec.min_draft_confidence
        self.run_ahead_enabled = spec.run_ahead
        self.device, self.dtype = config.torch_device, config.torch_dtype
        self.block_size = config.block_size
        checkpoint = open_model(config)
        target = checkpoint.config
        self.head = load_head(spec.model or DEFAULT_HEAD, target, self.dtype, self.device)
        embed, lm_head = load_embedding_and_head(checkpoint, target, self.dtype, self.device)
        self.head.attach(embed, lm_head)
        pack_head_for_cpu(self.head, config)
        cfg = self.head.config
        shape = (num_blocks, self.block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_cache = (torch.zeros(shape, dtype=self.dtype, device=self.device),
                         torch.zeros(shape, dtype=self.dtype, device=self.device))
        self.kv = KVCacheManager(num_blocks, self.block_size)
        self.attn = get_attention_backend(_attention_name(self.device, self.dtype, cfg,
                                                          self.block_size))
        self.hidden_size = target.hidden_size
        # On a GPU a round is one CUDA graph replay (cuda_graphs.EagleGraphs, as the local
        # drafter's); the graphs read only a runner's config, device, dtype and attention.
        self.graphs = self.ahead_graphs = self.catch_up_graphs = None
        if self.device.type == "cuda" and not config.enforce_eager:
            from mxserve.worker.cuda_graphs import EagleGraphs

            runner = SimpleNamespace(config=config, device=self.device, dtype=self.dtype,
                                     attn=self.attn)
            max_len = min(config.max_model_len or target.max_position_embeddings,
                          num_blocks * self.block_size)
            self.graphs = EagleGraphs(self.head, self.kv_cache, runner, max_len, self.k)
            self.graphs.capture()
            if self.run_ahead_enabled:  # run-ahead: chains from one position, k + 1 long;
                # and rounds answered from them only catch up (no chain)
                self.ahead_graphs = EagleGraphs(self.head, self.kv_cache, runner, max_len,
                                                self.k + 1, rows=1)
                self.ahead_graphs.capture()
                self.catch_up_graphs = EagleGraphs(self.head, self.kv_cache, runner, max_len,
                                                   1, rows=self.k + 1)
                self.catch_up_graphs.capture()
        self._states: OrderedDict[str, _State] = OrderedDict()  # least recently used first
        self.num_rounds = 0  # requests drafted for (a round each)
        self.num_batches = 0
        self.num_evicted = 0
        self.num_prefix_hit_blocks = 0  # blocks a first round found computed by another
        self.targets: set[str] = set()  # the target ids keys have named ("<target>/<request>")
        self.num_ahead = 0  # rounds run-ahead prepared drafts for
        self.num_ahead_hits = 0  # rounds answered with them
        self._last_keys: list[str] = []  # the last draft call's rounds, for run_ahead

    @property
    def num_requests(self) -> int:
        return len(self._states)

    def stats(self) -> dict:
        return {"num_targets": len(self.targets), "num_requests": self.num_requests,
                "num_rounds": self.num_rounds, "num_batches": self.num_batches,
                "num_evicted": self.num_evicted,
                "num_prefix_hit_blocks": self.num_prefix_hit_blocks,
                "num_ahead": self.num_ahead, "num_ahead_hits": self.num_ahead_hits}

    @torch.inference_mode()
    def draft(self, rounds: list[DraftRound], features: torch.Tensor, model_id: str = ""
              ) -> list[list[int]]:
        """Drafts for each round (features: [sum of kept, hidden], round after round). A round
        the pool cannot hold gets none."""
        if features.shape != (sum(r.kept for r in rounds), self.hidden_size):
            raise ValueError(f"draft: features must be [{sum(r.kept for r in rounds)}, "
                             f"{self.hidden_size}], got {tuple(features.shape)}")
        vocab = self.head.config.vocab_size
        for r in rounds:
            if r.kept < 1 or r.start < 0 or r.num_drafts < 0 or \
                    not all(0 <= t < vocab for t in r.tokens):
                raise ValueError(f"draft: round {r.key!r} needs start >= 0, tokens (ids below "
                                 f"{vocab}) for at least one kept position and num_drafts >= 0")
        features = features.to(self.device, self.dtype)
        busy = {r.key for r in rounds}
        spans, tokens, rows, firsts, nums, placed = [], [], [], [], [], []
        at = 0
        for i, r in enumerate(rounds):
            table = self._place(r, busy, model_id)
            if table is not None:
                spans.append(Span(r.start, r.kept, table))
                tokens += r.tokens[1:]
                rows += range(at, at + r.kept)
                firsts.append(at)
                nums.append(min(r.num_drafts, self.k))
                placed.append(i)
            at += r.kept
        drafts: list[list[int]] = [[] for _ in rounds]
        hits = {i: self._prepared(rounds[i]) for i in placed}
        if spans:
            # a round run-ahead prepared for only catches up (its KV, from true features)
            asked = [0 if hits[i] is not None else n for i, n in zip(placed, nums)]
            graphs = self.catch_up_graphs if not any(asked) else self.graphs
            if graphs is not None and graphs.fits_spans(spans):
                out, ends = graphs.draft(
                    spans, tokens, features, firsts, asked, self.min_confidence,
                    [self.kv.table_version(rounds[i].key) for i in placed], ends=True)
            else:
                feats = features if len(rows) == features.shape[0] else features[rows]
                out, ends = draft_round(self.head, self.kv_cache, self.attn, self.block_size,
                                        spans, tokens, feats, asked, self.min_confidence)
            for i, n, d, end in zip(placed, nums, out, ends):
                r, ahead = rounds[i], hits[i]
                self._computed(r, model_id)
                state = self._states[r.key]
                state.kept_all = not state.drafts or (
                    r.start == state.next_start and r.kept == len(state.drafts) + 1)
                if ahead is not None:
                    self.num_ahead_hits += 1
                    d, end = ahead.drafts[:n], ahead.end if len(ahead.drafts) <= n else None
                drafts[i] = d
                state.chain, state.drafts, state.ahead = end, d, None
                state.next_start = r.start + r.kept
        self._last_keys = [rounds[i].key for i in placed]
        self.num_rounds += len(rounds)
        self.num_batches += 1
        return drafts

    def prepared(self, rounds: list[DraftRound]) -> list[list[int]] | None:
        """The drafts run-ahead prepared for every one of these rounds, or None if some round
        has none ready (its target did not keep all the last drafts, or added another token):
        a message answered from them waits for no drafting. `draft` must still see the rounds
        (it catches the head up on them)."""
        out = []
        for r in rounds:
            ahead = self._prepared(r)
            if ahead is None:
                return None
            out.append(ahead.drafts[:min(r.num_drafts, self.k)])
        return out

    def _prepared(self, r: DraftRound) -> _Ahead | None:
        state = self._states.get(r.key)
        if state is None or state.ahead is None or r.num_drafts < 1 or \
                r.start != state.next_start or r.tokens[1:] != state.ahead.tokens:
            return None
        return state.ahead

    @torch.inference_mode()
    def run_ahead(self, stop: Callable[[], bool] | None = None) -> None:
        """Run-ahead drafting (speculative_config.run_ahead), between rounds: for each request
        of the last draft call that got drafts, the next round's drafts as if its target keeps
        them all and adds the token the head expects; the next round is answered from them at
        once when that comes true (`prepared`), else drafted as usual. The target verifies
        every draft, so a wrong guess costs only this idle-time work; it is done only for
        requests whose target kept every draft of their last round (acceptance comes in runs:
        the others' guesses come true less often than their cost repays). `stop()`, asked
        before each pass of the head, gives up (a message waits: it goes first)."""
        if not self.run_ahead_enabled:
            return
        keys, ends = [], []
        for key in self._last_keys:
            state = self._states.get(key)
            if state is None or state.chain is None or state.ahead is not None or \
                    not state.kept_all:
                continue
            need = state.chain.position + self.k + 2  # the guess's position, then k drafts
            if not self.kv.allocate(key, need):
                continue  # no room: no run-ahead for it (no request's state goes for this)
            keys.append(key)
            ends.append(dataclasses.replace(state.chain,
                                            block_table=self.kv.get_block_ids(key)))
        if not keys:
            return
        graphs = self.ahead_graphs
        if graphs is not None and graphs.fits_spans([Span(e.position, 1, e.block_table)
                                                     for e in ends]):
            ahead = None if stop is not None and stop() else \
                graphs.ahead(ends, self.k, self.min_confidence)
        else:
            ahead = draft_ahead(self.head, self.kv_cache, self.attn, self.block_size, ends,
                                self.k, self.min_confidence, stop)
        if ahead is None:
            return
        self._last_keys = []
        guesses, drafts, chain_ends = ahead
        for key, guess, d, end in zip(keys, guesses, drafts, chain_ends):
            state = self._states[key]
            state.ahead = _Ahead(state.drafts + [guess], d, end)
        self.num_ahead += len(keys)

    def release(self, keys: list[str]) -> None:
        """Forget these requests (ended, aborted or moved on their target)."""
        for key in keys:
            if self._states.pop(key, None) is not None:
                self.kv.free(key)

    def _place(self, r: DraftRound, busy: set[str], model_id: str) -> list[int] | None:
        """The request's block table covering its round and chain (allocating, with a prefix
        hit on its first round); None when the pool cannot hold it."""
        state = self._states.get(r.key)
        hits: list[int] = []
        if state is None:
            state = _State(model_id=model_id)
            self.targets.add(r.key.split("/", 1)[0])
            if r.start:
                if r.prefix is None or r.start % self.block_size or \
                        len(r.prefix) < r.start // self.block_size:
                    state.hashable = False  # its earlier blocks' hashes are unknown here
                else:
                    state.hashes = list(r.prefix[:r.start // self.block_size])
                    hits = self.kv.lookup_prefix(state.hashes)
                    self.num_prefix_hit_blocks += len(hits)
            state.end = len(hits) * self.block_size
            state.tokens = [-1] * r.start
        need = r.start + len(r.tokens) - 1 + max(r.num_drafts, 1)
        while not self.kv.allocate(r.key, need, hits if r.key not in self._states else ()):
            victim = next((k for k in self._states if k not in busy), None)
            if victim is None:
                return None
            self.release([victim])
            self.num_evicted += 1
        self._states[r.key] = state
        self._states.move_to_end(r.key)
        table = self.kv.get_block_ids(r.key)
        if state.end < r.start:  # positions this pool never computed: zeros, not stale KV
            self._zero(table, state.end, r.start)
        return table

    def _computed(self, r: DraftRound, model_id: str) -> None:
        """Record the round's tokens and valid KV; register its full blocks for reuse."""
        state = self._states[r.key]
        if len(state.tokens) < r.start:  # rounds it never got: those tokens are unknown
            state.tokens += [-1] * (r.start - len(state.tokens))
            state.hashable = False
        state.tokens[r.start:] = r.tokens
        state.end = r.start + r.kept
        del state.hashes[r.start // self.block_size:]
        if state.hashable and model_id == state.model_id:
            extend_block_hashes(state.hashes, state.tokens[:state.end], self.block_size,
                                model_id)
            self.kv.cache_blocks(r.key, state.hashes, state.end)

    def _zero(self, table: list[int], lo: int, hi: int) -> None:
        bs = self.block_size
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(lo, hi)],
                             dtype=torch.long, device=self.device)
        for cache in self.kv_cache:
            cache.view(-1, *cache.shape[2:]).index_fill_(0, slots, 0)


def _attention_name(device: torch.device, dtype: torch.dtype, cfg, block_size: int) -> str:
    if device.type == "cuda":
        return "triton"
    shape = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, block_size)
    return "cpu" if cpu_attention.available(dtype, *shape) else "torch"

