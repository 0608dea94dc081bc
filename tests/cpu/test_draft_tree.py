"""Draft trees (worker/draft_tree.py) in the engine: a verify step computes a tree of drafts
(each node attends to the context, the root, its ancestors and itself), greedy acceptance walks
the tree, and the kept nodes' KV moves to a chain's positions. Whatever the tree, greedy output
equals plain decoding's token for token, on the C kernel's rows and on torch's masked chunks,
with the KV pool consistent after every step."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_speculative import _check_pool, _prompts

from mxserve import LLM, SamplingParams
from mxserve.worker import draft_tree
from mxserve.worker.spec_config import SpeculativeConfig

ENGINE = dict(dtype="float32", num_kv_blocks=24, max_num_batched_tokens=32, max_num_seqs=8,
              load_progress=False, num_threads=1)
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
SPEC = {"method": "ngram", "num_speculative_tokens": 4}  # the drafter is replaced below


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def reference(ckpt):
    with LLM(ckpt, **ENGINE) as llm:
        return [o.token_ids for o in llm.generate(_prompts(), GREEDY)]


class TreeOracle:
    """Drafts a random tree of up to `size` nodes and depth <= n whose nodes are wrong tokens,
    except one random root-to-leaf path that spells the true continuation (with probability
    1 - wrong per node): kept nodes are often off the tree's first branch."""

    needs_hidden, num_lookahead_tokens = False, 0

    def __init__(self, reference: dict[tuple, list[int]], size: int, wrong: float = 0.0,
                 seed: int = 0):
        self.reference, self.size, self.wrong = reference, size, wrong
        self.rng = random.Random(seed)
        self.trees = 0

    def release(self, request):
        pass

    def propose(self, plan, hidden, num_drafts) -> None:
        for r, n in num_drafts.items():
            truth = self.reference[tuple(r.prompt_token_ids)][r.num_output_tokens:][:n]
            if not truth:
                continue
            parents = [-1]
            while len(parents) < self.size:  # random shape, depth <= len(truth)
                p = self.rng.randrange(-1, len(parents))
                if draft_tree.depths(parents + [p])[-1] <= len(truth):
                    parents.append(p)
            tokens = [self.rng.randrange(3, 256) for _ in parents]
            leaf = self.rng.randrange(len(parents))
            for depth, j in enumerate(draft_tree.path(parents, leaf)):
                if self.rng.random() >= self.wrong:
                    tokens[j] = truth[depth]
            r.draft_token_ids, r.draft_parents = tokens, parents
            self.trees += not draft_tree.is_chain(parents)


def test_tree_helpers():
    nodes, parents = draft_tree.from_paths([(0,), (0, 0), (0, 0, 0), (0, 1), (1,), (1, 0),
                                            (2,)])
    assert nodes == [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
    assert parents == [-1, -1, -1, 0, 0, 1, 3]
    assert draft_tree.depths(parents) == [1, 1, 1, 2, 2, 2, 3]
    assert draft_tree.path(parents, 6) == [0, 3, 6]
    # top: the root's argmax is drafts[1]; node 1's argmax drafts[5]; node 5's is new (99)
    drafts = [10, 11, 12, 13, 14, 15, 16]
    top = [11, 0, 15, 0, 0, 0, 99, 0]
    assert draft_tree.accept(top, drafts, parents) == ([11, 15, 99], [1, 5])
    assert draft_tree.moves(40, [1, 5]) == [(42, 41), (46, 42)]
    assert draft_tree.accept([7] + [0] * 7, drafts, parents) == ([7], [])
    assert draft_tree.contexts(40, 1, [-1, -1, 1]) == [
        (40, []), (41, []), (41, [41]), (41, [42]), (41, [42, 43])]
    with pytest.raises(ValueError, match="parent"):
        draft_tree.from_paths([(0, 1)])


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("size", [3, 7])
def test_tree_drafts_keep_greedy_output_and_the_pool(ckpt, reference, backend, size):
    prompts = _prompts()
    with LLM(ckpt, attention_backend=backend, speculative_config=SPEC, **ENGINE) as llm:
        oracle = TreeOracle({tuple(p): r for p, r in zip(prompts, reference)}, size)
        llm.engine.drafter = oracle
        moved, move_kv = [], llm.engine.runner.move_kv
        llm.engine.runner.move_kv = lambda src, dst, **kw: (moved.append(len(src)),
                                                            move_kv(src, dst, **kw))
        got = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in got] == reference
        assert oracle.trees > 10
        done = list(llm.engine.finished_requests)
        # the true path is in every tree: kept, and often off the first branch (KV moved)
        assert sum(r.num_accepted_tokens for r in done) > 1.5 * sum(r.num_drafts for r in done)
        assert len(moved) > 5
        _check_pool(llm)


def test_logprobs_and_penalties_follow_the_kept_path(ckpt, reference):
    prompts = _prompts()[:3]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2,
                            repetition_penalty=1.3)
    with LLM(ckpt, **ENGINE) as plain:
        want = plain.generate(prompts, params)
    with LLM(ckpt, speculative_config=SPEC, **ENGINE) as llm:
        truth = {tuple(p): w.token_ids for p, w in zip(prompts, want)}
        llm.engine.drafter = TreeOracle(truth, 6, seed=3)
        got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, e in zip(got, want):
        assert [list(d) for d in g.logprobs] == [list(d) for d in e.logprobs]
        assert [v for d in g.logprobs for v in d.values()] == pytest.approx(
            [v for d in e.logprobs for v in d.values()], abs=1e-5)


@settings(max_examples=10, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(wrong=st.floats(0.0, 1.0), size=st.integers(1, 12), budget=st.integers(14, 40),
       blocks=st.integers(12, 30), seed=st.integers(0, 1000))
def test_tree_verify_loop_keeps_output_and_pool(ckpt, reference, wrong, size, budget, blocks,
                                                seed):
    """Random trees, token budgets (a tree cut by the budget is still a tree) and pool sizes
    (preemption): step by step, the pool consistent after each, plain decoding's tokens."""
    prompts = _prompts()
    with LLM(ckpt, **{**ENGINE, "num_kv_blocks": blocks, "max_num_batched_tokens": budget},
             speculative_config={"method": "ngram", "num_speculative_tokens": 4}) as llm:
        llm.engine.drafter = TreeOracle({tuple(p): r for p, r in zip(prompts, reference)},
                                        size, wrong, seed)
        engine = llm.engine
        ids = [engine.add_request(p, GREEDY) for p in prompts]
        while engine.has_unfinished_requests():
            engine.step()
            engine.kv.check_integrity()
        done = {r.request_id: r.output_token_ids for r in engine.finished_requests}
        assert [done[i] for i in ids] == reference
        _check_pool(llm)


T7 = [[0], [0, 0], [0, 0, 0], [0, 1], [1], [1, 0], [2]]


@pytest.fixture(scope="module")
def random_head(ckpt, random_eagle_head):
    return random_eagle_head(ckpt, seed=1)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_eagle_trees_equal_plain_decoding(ckpt, reference, random_head, backend):
    """The head drafts the static tree (every node: no confidence floor), a depth at a time,
    each branch attending to its own path; mixed with a sampled request (which drafts chains:
    verify refuses a sampled tree)."""
    spec = {"method": "eagle", "model": random_head, "num_speculative_tokens": 3, "tree": T7,
            "min_draft_confidence": 0.0}
    sampled = SamplingParams(temperature=0.8, seed=5, max_tokens=20, ignore_eos=True)
    with LLM(ckpt, attention_backend=backend, speculative_config=spec, **ENGINE) as llm:
        prompts = _prompts()  # two at a time: two trees of 7 fit a verify's 16 rows
        outs = [o for i in range(0, len(prompts), 2)
                for o in llm.generate(prompts[i:i + 2], GREEDY)]
        assert [o.token_ids for o in outs] == reference
        done = list(llm.engine.finished_requests)
        drafts = sum(r.num_draft_tokens for r in done)
        assert drafts > 4 * sum(r.num_drafts for r in done)  # trees, not chains of 3
        _check_pool(llm)
        # a sampled request among greedy ones drafts chains (a sampled tree would be refused)
        outs = llm.generate(_prompts()[:3] + [_prompts()[0]], [GREEDY] * 3 + [sampled])
        assert [o.token_ids for o in outs[:3]] == reference[:3]
        assert len(outs[3].token_ids) == 20 and outs[3].num_drafts > 0
        _check_pool(llm)


def test_trees_only_while_a_verify_stays_within_16_rows(ckpt, reference, random_head):
    """Five greedy requests at once: a tree of 7 costs 8 rows, chains of 3 cost 4, so a step
    drafts trees for at most 2 requests of 2, 1 of 3, none of 4 or more; output unchanged."""
    spec = {"method": "eagle", "model": random_head, "num_speculative_tokens": 3, "tree": T7,
            "min_draft_confidence": 0.0}
    with LLM(ckpt, speculative_config=spec, **ENGINE) as llm:
        drafter, steps = llm.engine.drafter, []
        propose = drafter.propose

        def counting(plan, hidden, num_drafts):
            propose(plan, hidden, num_drafts)
            trees = sum(r.draft_parents is not None for r in num_drafts)
            steps.append((len(num_drafts), trees,
                          sum(len(r.draft_token_ids) + 1 for r in num_drafts)))

        drafter.propose = counting
        outs = llm.generate(_prompts(), GREEDY)
        assert [o.token_ids for o in outs] == reference
        _check_pool(llm)
    most = {1: 1, 2: 2, 3: 1}
    assert all(trees <= most.get(n, 0) and rows <= 16 for n, trees, rows in steps if trees)
    assert any(n >= 4 for n, _, _ in steps)  # the batch was large for a while ...
    assert any(trees for _, trees, _ in steps)  # ... and trees came as it shrank
    assert all(trees == 0 for n, trees, _ in steps if n >= 4)


def test_the_shipped_head_drafts_trees_on_smollm2_with_plain_decodings_output():
    """bf16, the default CPU engine: tree rows are row-exact (the AMX int4 GEMMs, the decode
    kernel's rows, the float32 LM head), so greedy output does not drift; the tree keeps more
    drafts a verify than the chain."""
    questions = [[{"role": "user", "content": q}] for q in
                 ("Name three uses of copper.", "Why is the sky blue?")]
    params = SamplingParams(temperature=0, max_tokens=48)
    spec = {"method": "eagle", "num_speculative_tokens": 3, "lookup_first": False}
    with LLM(load_progress=False, num_threads=2) as plain:
        want = [plain.chat([q], params)[0].token_ids for q in questions]
    with LLM(load_progress=False, num_threads=2, speculative_config=spec) as chain, \
            LLM(load_progress=False, num_threads=2,
                speculative_config={**spec, "tree": T7}) as tree:
        kept = {}
        for name, llm in (("chain", chain), ("tree", tree)):
            outs = [llm.chat([q], params)[0] for q in questions]
            assert [o.token_ids for o in outs] == want
            kept[name] = sum(o.num_accepted_tokens for o in outs) / sum(o.num_drafts
                                                                      for o in outs)
            _check_pool(llm)
        assert kept["tree"] > kept["chain"]


def test_eagle_defaults_lookup_first_and_chains(ckpt, reference, random_head):
    """EAGLE's defaults: lookup_first on (off for ngram, which drafts by lookup alone), no tree
    (chains: a tree gained nothing with lookup on SmolLM2's chat prompts and lost on KJV
    passages, bench/results/spec_decode.auto_tree.md)."""
    eagle, ngram = SpeculativeConfig("eagle"), SpeculativeConfig("ngram")
    assert eagle.lookup_first and eagle.tree is None and not ngram.lookup_first
    spec = {"method": "eagle", "model": random_head, "num_speculative_tokens": 3}
    with LLM(ckpt, speculative_config=spec, **ENGINE) as llm:
        drafter = llm.engine.drafter
        assert drafter.tree is None and drafter.num_lookup_drafts == 0
        outs = llm.generate(_prompts(), GREEDY)  # repetitive prompts: lookup drafts
        assert [o.token_ids for o in outs] == reference
        assert drafter.num_lookup_drafts > 0
        _check_pool(llm)


def test_bad_trees_fail_at_start_up_naming_the_field(ckpt, random_head):
    eagle = {"method": "eagle", "model": random_head, "num_speculative_tokens": 3}
    for spec, message in (({**eagle, "tree": [[0], [1, 0]]}, "parent"),
                          ({**eagle, "tree": [[0], [0, 0]]}, "depth"),
                          ({**eagle, "tree": [[0], [-1]]}, "rank paths"),
                          ({**eagle, "tree": [[r] for r in range(16)],
                            "num_speculative_tokens": 1}, "at most 15"),
                          ({"method": "ngram", "tree": [[0]], "num_speculative_tokens": 1},
                           "needs method 'eagle'"),
                          ({**eagle, "tree": 3}, "rank paths")):
        with pytest.raises(ValueError, match=f"speculative_config.tree.*{message}"):
            LLM(ckpt, speculative_config=spec, **ENGINE)
    with pytest.raises(ValueError, match="speculative_config.tree.*kv_eviction"):
        LLM(ckpt, speculative_config={**eagle, "tree": T7}, kv_eviction="streaming",
            kv_budget=64, **ENGINE)
