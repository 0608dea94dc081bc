"""Decode steps replayed from CUDA graphs give the eager engine's greedy tokens.

Tiny random Llama in float32 (so eager and graph differ only by summation order, far below the
logit gaps), batches that need padding (3, 5, 7, 11 running requests with graphs of 1, 2, 4, 8, 13
rows), chunked prefill (mixed steps stay eager) and MX weights.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from mxserve import LLM, SamplingParams  # noqa: E402

SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=3)


def _prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(n)
    return [torch.randint(3, 256, (int(k),), generator=gen).tolist()
            for k in torch.randint(2, 90, (n,), generator=gen)]


def _params(n: int) -> list[SamplingParams]:  # different lengths: the batch shrinks as they end
    return [SamplingParams(temperature=0, max_tokens=20 + 3 * i, ignore_eos=True)
            for i in range(n)]


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return str(tiny_checkpoint("llama", **SHAPE))


@pytest.mark.parametrize("options", [
    dict(),
    dict(max_num_batched_tokens=9),  # chunked prefill: mixed steps eager, pure decodes replayed
    dict(quantization="mxfp4"),
], ids=["plain", "chunked", "mxfp4"])
@pytest.mark.parametrize("num_prompts", [3, 5, 7, 11])
def test_graph_decode_matches_eager_greedy_tokens(path, options, num_prompts):
    prompts, params = _prompts(num_prompts), _params(num_prompts)
    common = dict(model=path, device="cuda", dtype="float32", load_progress=False,
                  max_num_seqs=13, **options)
    eager = LLM(enforce_eager=True, **common)
    assert eager.engine.runner.graphs is None
    expected = [o.token_ids for o in eager.generate(prompts, params)]
    llm = LLM(**common)
    graphs = llm.engine.runner.graphs
    assert graphs.sizes == [1, 2, 4, 8, 13]
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert graphs.num_replays > 0
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected  # prefix hits
    kv = llm.engine.kv
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks


def test_graphs_in_bfloat16_give_eager_logits(path):
    """bf16: the same step's logits, eager vs replayed, agree to bf16 rounding."""
    prompts = _prompts(6)
    steps = {}
    for eager in (True, False):
        llm = LLM(model=path, device="cuda", dtype="bfloat16", load_progress=False,
                  enforce_eager=eager, max_num_seqs=8, async_scheduling=False)
        engine = llm.engine
        for p in prompts:
            engine.add_request(p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        engine.step()  # the prefill
        plan = engine.scheduler.schedule()  # the first all-decode step
        assert plan.num_decodes == len(plan.scheduled) == 6
        steps[eager] = engine.runner.execute(plan).logits.clone()
    err = (steps[False] - steps[True]).norm() / steps[True].norm()
    assert err < 5e-2, err


@pytest.mark.parametrize("options", [dict(), dict(max_num_batched_tokens=9)],
                         ids=["graphs", "chunked"])
def test_async_scheduling_gives_the_synchronous_tokens(path, options):
    """Async scheduling (the CUDA default) feeds each step the previous step's tokens on the
    device; a stop token ends a request one step after it was computed (that extra token is
    dropped). Same tokens, finish reasons and logprobs as the synchronous engine; every block
    freed."""
    prompts = _prompts(9)
    free_run = LLM(model=path, device="cuda", dtype="float32", load_progress=False,
                   async_scheduling=False).generate(prompts[:1], _params(1))[0].token_ids
    params = _params(9)
    params[0] = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                               stop_token_ids=[free_run[5]])
    params[1] = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    params[2] = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    params[3] = SamplingParams(temperature=0.8, top_k=20, seed=9, max_tokens=16, ignore_eos=True)
    outs = {}
    for mode in (False, True):
        llm = LLM(model=path, device="cuda", dtype="float32", load_progress=False,
                  max_num_seqs=13, async_scheduling=mode, **options)
        assert llm.engine.async_scheduling is mode
        outs[mode] = [(o.token_ids, o.finish_reason, o.logprobs)
                      for o in llm.generate(prompts, params)]
        kv = llm.engine.kv
        kv.check_integrity()
        assert kv.num_free_blocks == kv.num_blocks
    # Tokens and reasons exactly; logprobs to float32 rounding (a dropped row can change a
    # step's batch, and cuBLAS's kernel choice with it).
    assert [o[:2] for o in outs[True]] == [o[:2] for o in outs[False]]
    for (_, _, got), (_, _, want) in zip(outs[True], outs[False]):
        assert (got is None) == (want is None)
        for g, w in zip(got or [], want or [], strict=True):
            assert g.keys() == w.keys() and all(abs(g[k] - w[k]) < 1e-4 for k in g)
    assert outs[True][0][1] == "stop" and outs[True][0][0] == free_run[:free_run.index(
        free_run[5]) + 1]


def test_the_last_steps_graph_replays_that_step(path):
    """DecodeGraphs.last_size names the graph the latest step replayed (None after an eager
    step). Replayed again as it is, it recomputes that step's logits: its inputs are in the token
    buffer in its own layout. (Graphs of other sizes read that buffer in theirs: engine_gpu's
    sweep replayed the graph of the batch it started with after requests had ended, read slots
    as positions and faulted with an illegal address.)"""
    llm = LLM(model=path, device="cuda", dtype="float32", load_progress=False, max_num_seqs=13,
              async_scheduling=False)
    engine, graphs = llm.engine, llm.engine.runner.graphs
    for p, sp in zip(_prompts(7), _params(7)):  # 20, 23, ... tokens: the batch shrinks
        engine.add_request(p, sp)
    engine.step()  # the prefill: eager
    assert graphs.last_size is None
    seen = set()
    while engine.has_unfinished_requests():
        plan = engine.scheduler.schedule()
        if plan.is_empty:
            break
        result = engine._run_model(plan, None)
        engine._complete(engine._sample(plan, result))
        size = graphs.last_size
        assert size == next(s for s in graphs.sizes if s >= len(plan.scheduled))
        logits = result.logits.clone()
        graphs.graphs[size].graph.replay()
        torch.cuda.synchronize()
        again = graphs.graphs[size].logits[:len(plan.scheduled)]
        assert torch.equal(again, logits)
        seen.add(size)
    assert len(seen) >= 3  # 8 (7 rows), 4, 2, 1 as requests end


@pytest.mark.parametrize("num_prompts", [3, 11])
def test_sampling_graph_draws_the_eager_samplers_tokens(path, num_prompts):
    """Decode steps sampled by the sampler's own graph (temperature, top_p, the fused race)
    give the tokens the same sampler draws launching the kernels one by one: every row the
    same Philox draws (the race's seed is a graph input), padding rows unread. Some requests
    are greedy, one has a seed: those steps take the eager path. All-greedy batches take the
    argmax graph, with the eager argmax's tokens."""
    prompts = _prompts(num_prompts)
    params = [SamplingParams(temperature=0.6 + 0.1 * (i % 5), top_p=0.8 if i % 2 else 1.0,
                             max_tokens=12 + 2 * i, ignore_eos=True) for i in range(num_prompts)]
    mixed = params[:-2] + [SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
                           SamplingParams(temperature=0.9, seed=4, max_tokens=7,
                                          ignore_eos=True)]
    greedy = [SamplingParams(temperature=0, max_tokens=10 + i, ignore_eos=True)
              for i in range(num_prompts)]
    tokens = {}
    for on in (True, False):
        llm = LLM(model=path, device="cuda", dtype="float32", load_progress=False,
                  max_num_seqs=13, seed=3, sample_graphs=on)
        tokens[on] = [[o.token_ids for o in llm.generate(prompts, p)] for p in (params, mixed)]
        served = llm.engine.sampler.num_graph_samples
        assert (served > 0) == on
        tokens[on].append([o.token_ids for o in llm.generate(prompts, greedy)])
        # every greedy decode step but a batch's first (its prefill) replays the argmax graph
        assert (llm.engine.sampler.num_graph_samples - served >= 9) == on
    assert tokens[True] == tokens[False]
    assert len({tuple(t) for t in tokens[True][0]}) > 1


class _Corrupted:
    """Drafts each request's reference tokens with every third one wrong (so verifies keep
    all, some or none of them, and requests near their end draft fewer than k)."""

    needs_hidden, num_lookahead_tokens = False, 0

    def release(self, request):
        pass

    def __init__(self, reference: dict[str, list[int]]) -> None:
        self.reference = reference

    def propose(self, plan, hidden, num_drafts) -> None:
        for r, n in num_drafts.items():
            at = r.num_output_tokens
            ref = self.reference[r.request_id][at:at + n]
            r.draft_token_ids = [t if (at + i) % 3 else (t + 1) % 200 + 3
                                 for i, t in enumerate(ref)]


@pytest.mark.parametrize("num_prompts", [1, 5, 11])
def test_verify_graphs_give_the_plain_greedy_tokens(path, num_prompts):
    """Speculative verify steps replay VerifyGraphs (k + 1 rows a request, fewer drafts padded,
    padding requests): the greedy tokens equal plain decoding's, the eager verify's logits
    agree, and every block is freed."""
    prompts, params = _prompts(num_prompts), _params(num_prompts)
    common = dict(model=path, device="cuda", dtype="float32", load_progress=False,
                  max_num_seqs=13)
    plain = LLM(**common)
    outs = plain.generate(prompts, params)
    expected = [o.token_ids for o in outs]
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    runs = {}
    for eager in (True, False):
        llm = LLM(enforce_eager=eager, speculative_config=spec, **common)
        engine = llm.engine
        assert (engine.runner.verify_graphs is None) == eager
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        engine.drafter = _Corrupted(dict(zip(ids, expected)))
        got = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
        runs[eager] = [got[i] for i in ids]
        if not eager:
            assert engine.runner.verify_graphs.num_replays > 0
        kv = engine.kv
        kv.check_integrity()
        assert kv.num_free_blocks == kv.num_blocks
    assert runs[False] == expected and runs[True] == expected


def test_a_verify_graph_gives_the_eager_verify_logits(path):
    """One verify step's logits, replayed vs eager, on bf16 weights: equal to bf16 rounding."""
    prompts = _prompts(6)
    steps = {}
    for eager in (True, False):
        llm = LLM(model=path, device="cuda", dtype="bfloat16", load_progress=False,
                  enforce_eager=eager, max_num_seqs=8,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3})
        engine = llm.engine
        for p in prompts:
            engine.add_request(p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        engine.step()  # the prefill
        for i, r in enumerate(engine.scheduler.running):
            r.draft_token_ids = [5 + i, 6, 7][:1 + i % 3]  # 1 to 3 drafts
        plan = engine.scheduler.schedule()
        assert sum(s.num_draft_tokens for s in plan.scheduled) == 12
        if not eager:
            assert engine.runner.verify_graphs.can_run(plan)
        steps[eager] = engine.runner.execute(plan).logits.clone()
    assert steps[True].shape == steps[False].shape == (18, steps[True].shape[1])
    err = (steps[False] - steps[True]).norm() / steps[True].norm()
    assert err < 5e-2, err


@pytest.mark.parametrize("chunk", [2048, 7, 1], ids=["whole", "chunked", "one-token-chunks"])
def test_prompt_logprobs_with_graphs_and_async_scheduling_match_eager(path, chunk):
    """A prefill step with prompt logprobs runs eagerly, also when its chunk is one token (which
    the decode graphs would otherwise take); the requests beside it still decode from graphs."""
    prompts = _prompts(5)
    plp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=4)
    params = [plp, *_params(2), plp, plp]
    common = dict(model=path, device="cuda", dtype="float32", load_progress=False,
                  max_num_batched_tokens=chunk)
    expected = LLM(enforce_eager=True, **common).generate(prompts, params)
    llm = LLM(**common)
    assert llm.engine.async_scheduling
    got = llm.generate(prompts, params)
    assert llm.engine.runner.graphs.num_replays > 0
    for g, e in zip(got, expected):
        assert g.token_ids == e.token_ids
        if e.prompt_logprobs is None:
            assert g.prompt_logprobs is None
            continue
        assert len(g.prompt_logprobs) == len(g.prompt_token_ids) and g.prompt_logprobs[0] is None
        assert [list(d) for d in g.prompt_logprobs[1:]] == [list(d) for d in e.prompt_logprobs[1:]]
        assert [v for d in g.prompt_logprobs[1:] for v in d.values()] == pytest.approx(
            [v for d in e.prompt_logprobs[1:] for v in d.values()], abs=1e-4)


@pytest.mark.parametrize("num_prompts", [1, 5, 11])
def test_eagle_graphs_draft_as_the_eager_round(path, tmp_path, num_prompts):
    """An EAGLE engine on CUDA drafts from EagleGraphs (one replay a round): each round's
    drafts equal the eager round's on the same inputs (run first, float32), the greedy tokens
    equal plain decoding's, and every block is freed."""
    from mxserve.worker.eagle import save_head
    from mxserve.worker.eagle_train import init_head
    from mxserve.worker.model.loader import open_checkpoint

    config = open_checkpoint(path).config
    save_head(init_head(config, seed=2, std=0.5), str(tmp_path), config.model_id)
    prompts, params = _prompts(num_prompts), _params(num_prompts)
    common = dict(model=path, device="cuda", dtype="float32", load_progress=False,
                  max_num_seqs=13)
    expected = [o.token_ids for o in LLM(**common).generate(prompts, params)]
    llm = LLM(speculative_config={"method": "eagle", "num_speculative_tokens": 3,
                                  "model": str(tmp_path), "lookup_first": False}, **common)
    drafter = llm.engine.drafter
    graphs = drafter.graphs
    assert graphs is not None and graphs.graphs
    propose, rounds = drafter.propose, []

    def eager_then_graph(plan, hidden, num_drafts):
        drafter.graphs = None
        propose(plan, hidden, num_drafts)
        eager = {r: list(r.draft_token_ids) for r in num_drafts}
        drafter.graphs = graphs
        replays = graphs.num_replays
        propose(plan, hidden, num_drafts)
        if graphs.num_replays > replays:
            got = {r: r.draft_token_ids for r in num_drafts}
            rounds.append((eager == got, any(got.values())))

    drafter.propose = eager_then_graph
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected
    assert len(rounds) > 5 and all(same for same, _ in rounds), rounds
    assert any(drafted for _, drafted in rounds)
    kv = llm.engine.kv
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks


def test_eagle_defaults_on_cuda_lookup_first_and_chains(path, tmp_path):
    """EAGLE as configured by default on CUDA: lookup_first on (repeating prompts draft by
    lookup, the rest from EagleGraphs' replays), chains; greedy tokens equal plain decoding's,
    every block freed."""
    from mxserve.worker.eagle import save_head
    from mxserve.worker.eagle_train import init_head
    from mxserve.worker.model.loader import open_checkpoint

    config = open_checkpoint(path).config
    save_head(init_head(config, seed=2, std=0.5), str(tmp_path), config.model_id)
    prompts = _prompts(5)
    prompts[1] = prompts[1][:6] * 8  # repeats: lookup drafts
    prompts[3] = prompts[3][:4] * 12
    params = _params(5)
    common = dict(model=path, device="cuda", dtype="float32", load_progress=False,
                  max_num_seqs=13)
    expected = [o.token_ids for o in LLM(**common).generate(prompts, params)]
    llm = LLM(speculative_config={"method": "eagle", "num_speculative_tokens": 3,
                                  "model": str(tmp_path)}, **common)
    drafter = llm.engine.drafter
    assert drafter.tree is None and drafter.graphs is not None
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected
    assert drafter.num_lookup_drafts > 0 and drafter.graphs.num_replays > 0
    kv = llm.engine.kv
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks


def test_a_draft_server_on_cuda_drafts_from_graphs_as_eagerly(path, tmp_path):
    """A DraftServer on CUDA drafts rounds of at most k + 1 kept positions from EagleGraphs: the
    same drafts as an eager server's (enforce_eager) over rounds of several requests, fewer
    drafts asked and catch-up only; run-ahead from the graph's chain ends prepares the same."""
    from mxserve.worker.config import EngineConfig
    from mxserve.worker.draft_server import DraftRound, DraftServer
    from mxserve.worker.eagle import save_head
    from mxserve.worker.eagle_train import init_head
    from mxserve.worker.model.loader import open_checkpoint

    config = open_checkpoint(path).config
    save_head(init_head(config, seed=4, std=0.5), str(tmp_path), config.model_id)
    spec = {"method": "eagle", "num_speculative_tokens": 3, "model": str(tmp_path),
            "draft_placement": "replica", "run_ahead": True}
    servers = {eager: DraftServer(EngineConfig(model=path, device="cuda", dtype="float32",
                                               enforce_eager=eager, speculative_config=spec),
                                  256) for eager in (True, False)}
    assert servers[True].graphs is None and servers[False].graphs.graphs
    gen = torch.Generator().manual_seed(0)
    hidden = config.hidden_size
    starts = {f"t/{i}": 0 for i in range(3)}
    for step in range(8):
        rounds, n = [], 0
        for i, key in enumerate(starts):
            kept = 17 + 5 * i if step == 0 else 1 + (step + i) % 4
            tokens = torch.randint(3, 256, (kept + 1,), generator=gen).tolist()
            rounds.append(DraftRound(key, starts[key], tokens, (0, 2, 3)[(step + i) % 3]))
            starts[key] += kept
            n += kept
        features = torch.randn(n, hidden, generator=gen)
        got = {eager: s.draft(rounds, features, "m") for eager, s in servers.items()}
        assert got[True] == got[False]
        for s in servers.values():
            s.run_ahead()
        ahead = {eager: [(s._states[k].ahead.drafts if s._states[k].ahead else None)
                         for k in starts] for eager, s in servers.items()}
        assert ahead[True] == ahead[False]
    assert servers[False].graphs.num_replays == 7  # the first round's spans are too long
