"""Speculative decoding options, as vLLM users pass them: `speculative_config={"method": "eagle"
| "ngram", "model": PATH, "num_speculative_tokens": k}` (EngineConfig, LLM, `mxserve serve
--speculative-config JSON`). Torch-free, so configs validate anywhere."""

from __future__ import annotations

from dataclasses import dataclass, fields

from mxserve.worker import draft_tree

METHODS = ("eagle", "ngram")
PLACEMENTS = ("local", "replica")
MAX_SPECULATIVE_TOKENS = 16
MAX_TREE_NODES = 15  # with the root, a verify of at most 16 rows a request


@dataclass(frozen=True)
class SpeculativeConfig:
    """method: "eagle" (a draft head on the target's hidden states, worker/eagle.py) or "ngram"
    (prompt lookup, no model: the longest recent n-gram that occurred before proposes what
    followed it). model: the EAGLE head's directory (None: the one shipped for the default
    model). num_speculative_tokens: drafts a step, 1..16. prompt_lookup_min/max: the n-gram
    lengths ngram tries, longest first.

    draft_placement (eagle): "local", the head in the worker's process on its device; or
    "replica", the head in a draft replica of its own (worker/draft_server.py) that the
    worker reaches over worker/draft_channel.py: served, the cluster deploys it and tells the
    workers where; offline, `draft_address` ("host:port") names a running one.
    draft_timeout_s: a round's deadline; past it (or with the replica down) the step decodes
    without drafts. run_ahead (replica): between rounds the replica drafts each request's next
    round as if its target keeps every draft and adds the token the head expects; when that
    comes true the next round is answered without drafting (worker/draft_server.py).

    min_draft_confidence (eagle): a request's chain of drafts ends before the first one the
    head gives a probability below this (0: always k drafts). A draft the head is unsure of is
    seldom accepted, and verifying it costs: on a CPU each verified row adds to the step (the
    target's int4 GEMMs are compute bound from 2 rows on), and every draft costs a head pass.
    The default was chosen on SmolLM2's held-out chat prompts (bench/results/spec_decode.md:
    0.15 was best of 0 .. 0.5).

    lookup_first (eagle; None: on for eagle): a request whose latest prompt_lookup_min..max
    tokens occurred earlier in its prompt or output drafts what followed them (ngram's
    proposal) instead of the head's chain; the head still catches up on the step, so it drafts
    again as soon as no n-gram matches. Text that repeats its context (a rewrite, a quotation,
    a list) is drafted by lookup, which accepts more there than a small head
    (bench/results/spec_decode.md).

    disable_by_batch_size (as vLLM's): while more requests than this are in the engine
    (running and waiting), steps carry no drafts: a large batch already fills the device (on a
    CPU a verify of several rows a request costs nearly that many decodes), and speculation
    then only adds work. EAGLE's head still catches up on every step, so drafting resumes as
    soon as the batch shrinks. None: never.

    tree (eagle, local): a static draft tree as rank paths ([[0], [0, 0], [1]]: the head's
    first choice, its first choice after that, and its second choice at the first position;
    worker/draft_tree.py), for greedy requests (sampled ones draft the first-choice chain). Its
    depth (the longest path) is num_speculative_tokens; at most MAX_TREE_NODES nodes. A node
    the head gives less than min_draft_confidence is left out with its subtree. A tree verifies
    more rows than a chain for more kept drafts a step: worth it where extra rows cost little,
    so a step drafts trees only while its verify stays within 16 rows (small batches; larger
    ones draft chains). CPU attention backends, one rank, no KV eviction, for now. None (the
    default): chains; with lookup_first a 12-node tree gained nothing on SmolLM2's chat
    prompts and lost on KJV passages (bench/results/spec_decode.auto_tree.md)."""

    method: str
    num_speculative_tokens: int = 3
    model: str | None = None
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    draft_placement: str = "local"
    draft_address: str | None = None
    draft_timeout_s: float = 0.5
    min_draft_confidence: float = 0.15
    run_ahead: bool = True
    lookup_first: bool | None = None
    disable_by_batch_size: int | None = None
    tree: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, "
                             f"got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("speculative_config: need 1 <= prompt_lookup_min <= "
                             "prompt_lookup_max")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("speculative_config.model: ngram drafts without a model")
        if self.draft_placement not in PLACEMENTS:
            raise ValueError(f"speculative_config.draft_placement must be one of {PLACEMENTS}, "
                             f"got {self.draft_placement!r}")
        if self.draft_placement == "replica" and self.method != "eagle":
            raise ValueError("speculative_config.draft_placement 'replica' needs method "
                             "'eagle' (ngram drafts in the worker, without a model)")
        if self.draft_address is not None and (
                not isinstance(self.draft_address, str) or ":" not in self.draft_address):
            raise ValueError(f"speculative_config.draft_address must be 'host:port', got "
                             f"{self.draft_address!r}")
        if not (isinstance(self.draft_timeout_s, int | float) and self.draft_timeout_s > 0):
            raise ValueError(f"speculative_config.draft_timeout_s must be > 0, got "
                             f"{self.draft_timeout_s!r}")
        if self.disable_by_batch_size is not None and not (
                isinstance(self.disable_by_batch_size, int)
                and not isinstance(self.disable_by_batch_size, bool)
                and self.disable_by_batch_size >= 1):
            raise ValueError(f"speculative_config.disable_by_batch_size must be an integer >= 1 "
                             f"or None, got {self.disable_by_batch_size!r}")
        if not (isinstance(self.min_draft_confidence, int | float)
                and 0 <= self.min_draft_confidence < 1):
            raise ValueError(f"speculative_config.min_draft_confidence must be in [0, 1), got "
                             f"{self.min_draft_confidence!r}")
        if self.lookup_first is None:
            object.__setattr__(self, "lookup_first", self.method == "eagle")
        if not isinstance(self.lookup_first, bool):
            raise ValueError(f"speculative_config.lookup_first must be true or false, got "
                             f"{self.lookup_first!r}")
        if self.lookup_first and self.method != "eagle":
            raise ValueError("speculative_config.lookup_first needs method 'eagle' (ngram "
                             "drafts by lookup alone)")
        if self.tree is not None:
            self._check_tree()
        if not isinstance(self.run_ahead, bool):
            raise ValueError(f"speculative_config.run_ahead must be true or false, got "
                             f"{self.run_ahead!r}")

    def _check_tree(self) -> None:
        if self.method != "eagle" or self.draft_placement != "local":
            raise ValueError("speculative_config.tree needs method 'eagle' with draft_placement "
                             "'local'")
        try:
            paths = tuple(tuple(int(r) for r in p) for p in self.tree)
            draft_tree.from_paths(paths)
        except (TypeError, ValueError) as e:
            raise ValueError(f"speculative_config.tree must be a list of rank paths (lists of "
                             f"ints >= 0, each with its parent path): {e}") from None
        if len(paths) > MAX_TREE_NODES:
            raise ValueError(f"speculative_config.tree: at most {MAX_TREE_NODES} nodes, got "
                             f"{len(paths)}")
        depth = max(len(p) for p in paths)
        if depth != self.num_speculative_tokens:
            raise ValueError(f"speculative_config.tree: its depth ({depth}, the longest path) "
                             f"must equal num_speculative_tokens "
                             f"({self.num_speculative_tokens})")
        object.__setattr__(self, "tree", paths)

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | None) -> SpeculativeConfig | None:
        """A SpeculativeConfig from a mapping (unknown keys are a ValueError naming them)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a mapping, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key {unknown[0]!r} "
                             f"(keys: {sorted(known)})")
        if "method" not in value:
            raise ValueError("speculative_config.method is required ('eagle' or 'ngram')")
        return cls(**value)
