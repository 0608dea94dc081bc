"""CUDA graph bookkeeping that needs no GPU (the replays themselves: tests/gpu)."""

from __future__ import annotations

from mxserve import LLM
from mxserve.worker.cuda_graphs import capture_sizes


def test_capture_sizes_cover_every_batch_with_bounded_padding():
    assert capture_sizes(1) == [1]
    assert capture_sizes(13) == [1, 2, 4, 8, 13]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    sizes = capture_sizes(512)
    assert sizes[-1] == 512 and sizes == sorted(set(sizes))
    for batch in range(1, 513):
        padded = next(s for s in sizes if s >= batch)
        assert padded <= max(2 * batch, 16) and (batch <= 16 or padded <= batch * 1.5)


def test_cpu_engine_captures_no_graphs(tiny_checkpoint):
    llm = LLM(model=str(tiny_checkpoint("llama")), device="cpu", load_progress=False)
    assert llm.engine.runner.graphs is None


def test_graph_inputs_are_the_plans_tokens_positions_slots_and_tables(tiny_checkpoint):
    """DecodeGraphs._copy_inputs (its buffers are CPU tensors here; the replays: tests/gpu):
    each row's id (or the previous step's sample, for a token in flight), position, slot,
    length and block table; padding rows write no KV and attend to nothing."""
    import torch

    from mxserve import SamplingParams
    from mxserve.worker.cuda_graphs import DecodeGraphs

    llm = LLM(model=str(tiny_checkpoint("llama")), device="cpu", load_progress=False,
              max_num_seqs=8, async_scheduling=True)
    engine = llm.engine
    for n in (3, 17, 40, 33, 5):
        engine.add_request(list(range(3, 3 + n)), SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(4):
        engine.step()
    plan = engine.scheduler.schedule()
    engine._run_model(plan, engine._inflight)  # sets the rows' in-flight samples
    graphs = DecodeGraphs(engine.runner, engine.max_model_len)
    for _ in range(2):  # both staging sets
        graphs._copy_inputs(plan, 8)
        sched, bs = plan.scheduled, engine.kv.block_size
        assert plan.num_decodes == len(sched) == 5 and plan.inflight_tokens is not None
        for i, s in enumerate(sched):
            p = s.start_position
            want_id = int(plan.inflight_tokens[s.inflight_row]) if s.inflight_row >= 0 \
                else s.token_ids[0]
            assert graphs.tokens(8)[:, i].tolist() == [want_id, p,
                                                       s.block_table[p // bs] * bs + p % bs]
            assert int(graphs.seq_lens[i]) == p + 1
            assert graphs.block_tables[i, :len(s.block_table)].tolist() == s.block_table
        assert graphs.tokens(8)[:, 5:8].tolist() == [[0] * 3, [0] * 3, [-1] * 3]
        assert graphs.seq_lens[5:8].tolist() == [0] * 3
        assert torch.equal(graphs.tokens(8)[0, :5][torch.tensor([s.inflight_row >= 0
                                                                 for s in sched])],
                           plan.inflight_tokens[[s.inflight_row for s in sched
                                                 if s.inflight_row >= 0]])


def test_kept_block_table_rows_follow_growth_new_tables_trims_and_reordering(tiny_checkpoint):
    """Rows of the graphs' block tables are kept across steps and only what changed is written:
    check them against each plan, with tables from a real KVCacheManager through growth, a
    request freed and allocated anew (preemption), rows changing hands, and a trim followed by
    new blocks (speculation's rollback)."""
    from mxserve import SamplingParams
    from mxserve.worker.cuda_graphs import DecodeGraphs
    from mxserve.worker.kv_cache import KVCacheManager
    from mxserve.worker.request import Request
    from mxserve.worker.scheduler import ScheduledRequest, StepPlan

    llm = LLM(model=str(tiny_checkpoint("llama")), device="cpu", load_progress=False,
              max_num_seqs=4)
    graphs = DecodeGraphs(llm.engine.runner, llm.engine.max_model_len)
    kv = KVCacheManager(64, 16)
    a, b = (Request(rid, [1, 2, 3], SamplingParams()) for rid in "ab")

    def step(*requests_and_tokens):
        rows = []
        for r, num_tokens in requests_and_tokens:
            assert kv.allocate(r.request_id, num_tokens)
            rows.append(ScheduledRequest(r, 1, num_tokens - 1, [4],
                                         kv.get_block_ids(r.request_id),
                                         kv.table_version(r.request_id), True))
        graphs._copy_inputs(StepPlan(rows, num_decodes=len(rows)), 4)
        for i, s in enumerate(rows):
            assert graphs.block_tables[i, :len(s.block_table)].tolist() == s.block_table, i

    step((a, 20), (b, 5))
    step((a, 40), (b, 5))  # a grew
    kv.free(b.request_id)
    kv.allocate("c", 40)  # b's old blocks go elsewhere
    step((a, 40), (b, 30))  # b preempted and readmitted: a new table
    step((b, 30), (a, 40))  # rows changed hands
    kv.trim(a.request_id, 17)
    kv.allocate("d", 16)  # a's released block goes elsewhere
    step((b, 30), (a, 40))  # a trimmed and grown back: other blocks at its end
    kv.check_integrity()


def test_verify_graph_inputs_give_the_eager_verify_step(tiny_checkpoint):
    """VerifyGraphs' layout, run eagerly on the CPU (Triton interpreter; the captured replays:
    tests/gpu): its static inputs and forward (the prefill kernel over fixed runs of k + 1
    query rows, split contexts, padded rows and padding requests) give the eager runner's
    logits and hidden states for every token of verify plans with k, fewer and no drafts."""
    import dataclasses
    import os

    import torch

    from mxserve import SamplingParams
    from mxserve.worker.cuda_graphs import VerifyGraphs
    from mxserve.worker.scheduler import StepPlan

    os.environ.setdefault("TRITON_INTERPRET", "1")
    llm = LLM(model=str(tiny_checkpoint("llama")), device="cpu", load_progress=False,
              max_num_seqs=4, attention_backend="triton",
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    engine = llm.engine

    class Drafts:  # a random model: prompt lookup would find nothing to draft
        needs_hidden, num_lookahead_tokens = False, 0

        def release(self, request):
            pass

        def propose(self, plan, hidden, num_drafts):
            for r, n in num_drafts.items():
                r.draft_token_ids = [(r.num_tokens * 7 + i) % 200 + 3 for i in range(n)]

    engine.drafter = Drafts()
    for n in (20, 37, 9):
        engine.add_request(list(range(3, 3 + n)), SamplingParams(max_tokens=40,
                                                                 ignore_eos=True))
    plan = None
    for _ in range(12):
        engine.step()
        if all(len(r.draft_token_ids) == 3 for r in engine.scheduler.running):
            plan = engine.scheduler.schedule()
            break
    assert plan is not None and len(plan.scheduled) == 3
    assert all(s.num_draft_tokens == 3 for s in plan.scheduled)
    graphs = VerifyGraphs(engine.runner, engine.max_model_len, 4)
    assert graphs.sizes == [1, 2, 4]

    def fewer(s, d):  # the same request verifying only its first d drafts
        return dataclasses.replace(s, num_new_tokens=1 + d, token_ids=s.token_ids[:1 + d],
                                   num_draft_tokens=d)

    a, b, c = plan.scheduled
    plans = [plan, StepPlan([fewer(c, 0), fewer(a, 1), b], num_decodes=1),  # decodes lead
             StepPlan([fewer(b, 2)], num_decodes=0)]
    for p in plans:
        assert graphs.fits(p)
        eager = engine.runner._execute(dataclasses.replace(p, keep_hidden=True))
        size = next(s for s in graphs.sizes if s >= len(p.scheduled))
        graphs._copy_inputs(p, size)
        hidden, logits = graphs._forward(size)
        got_logits, got_hidden = graphs.real_rows(p, logits, hidden)
        torch.testing.assert_close(got_logits, eager.logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got_hidden, eager.hidden_states, rtol=1e-4, atol=1e-4)
        tokens = graphs.tokens(size)
        assert tokens[2, len(p.scheduled) * 4:].eq(-1).all()  # padding requests write nothing
        assert graphs.seq_lens[len(p.scheduled):size].eq(0).all()
    # a prefill chunk or a plan without drafts is not a verify graph's
    assert not graphs.fits(StepPlan([fewer(a, 0)], num_decodes=1))
    assert not graphs.can_run(plan)  # nothing captured on a CPU


def test_decode_graph_inputs_under_h2o_give_the_eager_step_and_its_mass(tiny_checkpoint):
    """An H2O engine's decode graphs, their forward run eagerly on the CPU (Triton interpreter;
    the captured replays: tests/gpu): after compactions, each row's RoPE position counts the
    evicted tokens while its slot and length count the held ones, and the forward gives the
    eager step's logits and its attention mass (zeroed first, summed over layers; the padding
    row and the positions past each context hold none)."""
    import os

    import torch

    from mxserve import SamplingParams
    from mxserve.worker.cuda_graphs import DecodeGraphs

    os.environ.setdefault("TRITON_INTERPRET", "1")
    llm = LLM(model=str(tiny_checkpoint("llama")), device="cpu", load_progress=False,
              dtype="float32", max_num_seqs=4, attention_backend="triton", max_model_len=128,
              kv_eviction="h2o", kv_budget=24, async_scheduling=False)
    engine = llm.engine
    for n in (30, 45, 9):
        engine.add_request(list(range(3, 3 + n)), SamplingParams(max_tokens=60,
                                                                 ignore_eos=True))
    graphs = DecodeGraphs(engine.runner, engine.max_model_len, with_mass=True)
    seen = {}
    execute = engine.runner.execute

    def execute_and_forward(plan):  # the eager step, then the graph's forward on its inputs
        result = execute(plan)
        if not seen and plan.num_decodes == len(plan.scheduled) == 3 and plan.kv_moves \
                and any(s.position_offset for s in plan.scheduled):
            assert not graphs.can_run(plan)  # nothing captured on a CPU
            graphs.mass.fill_(float("nan"))  # the forward zeroes it
            graphs._copy_inputs(plan, 4)
            seen.update(plan=plan, eager=result, out=graphs._forward(4))
        return result

    engine.runner.execute = execute_and_forward
    for _ in range(60):
        engine.step()
    assert seen, "no all-decode step with compactions"
    plan, eager, (_, logits) = seen["plan"], seen["eager"], seen["out"]
    torch.testing.assert_close(logits[:3], eager.logits, rtol=1e-4, atol=1e-4)
    width = eager.attn_mass.shape[1]
    torch.testing.assert_close(graphs.mass[:3, :width], eager.attn_mass, rtol=1e-4, atol=1e-5)
    assert graphs.mass[:3, width:].eq(0).all() and graphs.mass[3].eq(0).all()
    for i, s in enumerate(plan.scheduled):
        p, bs = s.start_position, engine.kv.block_size
        assert graphs.tokens(4)[:, i].tolist() == [s.token_ids[0], p + s.position_offset,
                                                   s.block_table[p // bs] * bs + p % bs]
        assert int(graphs.seq_lens[i]) == p + 1
        units = engine.model_config.num_hidden_layers * engine.model_config.num_attention_heads
        assert abs(graphs.mass[i, :p + 1].sum().item() - units) <= 1e-4 * units


def test_eagle_graph_inputs_give_the_eager_drafting_round(tiny_checkpoint, random_eagle_head):
    """EagleGraphs' forward run eagerly on the CPU (Triton interpreter; the captured replays:
    tests/gpu): after every step whose kept spans it fits, the catch-up laid out as a verify
    (q = k + 1 rows a request, padding requests), the last kept row's output gathered on the
    device and the chain's slots and lengths computed there give eagle.draft_round's drafts,
    cut on the host to each request's ask and at the first draft below the floor. Spans longer
    than k + 1 (a prompt's last chunk) are the eager round's."""
    import os

    import torch

    from mxserve import SamplingParams
    from mxserve.worker import eagle
    from mxserve.worker.cuda_graphs import EagleGraphs, _DraftGraph

    os.environ.setdefault("TRITON_INTERPRET", "1")
    ckpt = str(tiny_checkpoint("llama"))
    floor = 0.99  # this head is sure of most drafts: cut some chains
    llm = LLM(model=ckpt, device="cpu", load_progress=False, dtype="float32", max_num_seqs=4,
              attention_backend="triton", max_model_len=128, max_num_batched_tokens=32,
              speculative_config={"method": "eagle", "num_speculative_tokens": 3,
                                  "model": random_eagle_head(ckpt, seed=3, std=0.5),
                                  "min_draft_confidence": floor, "lookup_first": False})
    engine, drafter = llm.engine, llm.engine.drafter
    assert drafter.graphs is None  # nothing captured on a CPU
    graphs = EagleGraphs(drafter.head, drafter.kv_cache, engine.runner, engine.max_model_len, 3)
    assert graphs.sizes == [1, 2, 4] and graphs.q == 4
    ahead = EagleGraphs(drafter.head, drafter.kv_cache, engine.runner, engine.max_model_len, 4,
                        rows=1)
    assert ahead.q == 1 and ahead.k == 4
    catch_up = EagleGraphs(drafter.head, drafter.kv_cache, engine.runner, engine.max_model_len,
                           1, rows=4)

    def forward_as_replay(spans, tokens, features, first_rows, versions=None):
        size = next(s for s in ahead.sizes if s >= len(spans))
        ahead.copy_spans(spans, tokens, features, first_rows, size, versions)
        return _DraftGraph(None, *ahead._forward(size))

    ahead.replay = forward_as_replay
    seen = {"rounds": 0, "partial": 0, "cut": 0, "eager_only": 0, "ahead": 0, "ahead_guess": 0}
    propose = drafter.propose

    def propose_both(plan, hidden, num_drafts):
        kept = eagle.kept_spans(plan)
        propose(plan, hidden, num_drafts)  # the eager round: drafts set, head KV written
        if not kept:
            return
        if not all(n <= graphs.q for _, n in kept):
            seen["eager_only"] += 1
            return
        spans = [eagle.Span(s.start_position, n, s.block_table, s.position_offset)
                 for s, n in kept]
        tokens = [t for s, n in kept
                  for t in s.request.all_token_ids[s.start_position + 1:][:n]]
        graphs.graphs = {4: None}  # fits_spans asks for captured graphs
        assert graphs.fits_spans(spans)
        size = next(s for s in graphs.sizes if s >= len(kept))
        versions = [s.table_version for s, _ in kept] if seen["rounds"] % 2 else None
        graphs.copy_spans(spans, tokens, hidden, eagle.kept_offsets(plan, kept), size, versions)
        drafts, confidence, features = graphs._forward(size)
        asked = [num_drafts.get(s.request, 0) for s, _ in kept]
        got = graphs.cut(drafts[:len(kept)], confidence[:len(kept)], asked, floor)
        want = [s.request.draft_token_ids if s.request in num_drafts else [] for s, _ in kept]
        assert got == want
        # the replica's catch-up-only graphs (k = 1: no chain pass): the same first drafts
        catch_up.copy_spans(spans, tokens, hidden, eagle.kept_offsets(plan, kept), size)
        first, _, _ = catch_up._forward(size)
        assert first.shape == (size, 1) and first[:len(kept), 0].tolist() == \
            drafts[:len(kept), 0].tolist()
        # the chain ends run-ahead starts from, as draft_round gives them (its KV rewritten
        # with the same values)
        _, ends = eagle.draft_round(drafter.head, drafter.kv_cache, drafter.attn,
                                    engine.kv.block_size, spans, tokens, hidden[torch.cat([
                                        torch.arange(o, o + n) for (_, n), o in zip(
                                            kept, eagle.kept_offsets(plan, kept))])],
                                    asked, floor)
        mine = graphs.chain_ends(spans, got, asked, drafts[:len(kept)].tolist(), features)
        for a, b in zip(ends, mine):
            assert (a is None) == (b is None)
            if a is not None:
                assert (a.position, a.token, a.guess, a.block_table, a.offset) == \
                    (b.position, b.token, b.guess, b.block_table, b.offset)
                # the CPU head's int4 rows round their inputs: an element may move a step
                assert (a.feature - b.feature).norm() <= 1e-2 * a.feature.norm()
        # run-ahead from those ends (the replica's, here over the engine's head KV): its graphs
        # catch up one position a chain and give k + 1 outputs
        bs = engine.kv.block_size
        starts = [e for e in mine if e is not None and e.position + 5 <= len(e.block_table) * bs]
        if starts:
            want = eagle.draft_ahead(drafter.head, drafter.kv_cache, drafter.attn, bs, starts,
                                     3, floor)
            got = ahead.ahead(starts, 3, floor)
            assert got[:2] == want[:2]
            assert [(e.position, e.token, e.guess) for e in got[2]] == \
                [(e.position, e.token, e.guess) for e in want[2]]
            seen["ahead"] += 1
            seen["ahead_guess"] += any(e.guess for e in starts)
        seen["rounds"] += 1
        seen["partial"] += any(1 < n < graphs.q for _, n in kept)
        seen["cut"] += any(0 < len(d) < a for d, a in zip(got, asked))

    drafter.propose = propose_both
    prompts = [[5, 6, 7, 8] * 5, list(range(3, 40)), [9, 10] * 4]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert seen["rounds"] >= 10 and seen["partial"] and seen["cut"] and seen["eager_only"], seen
    assert seen["ahead"] >= 5 and seen["ahead_guess"], seen
    assert all(len(o.token_ids) == 24 for o in outs)
