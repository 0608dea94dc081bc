"""`mxserve train-draft` end to end on a tiny model: data, training, a head the engine loads,
the report, and a resumed run (worker/eagle_train.py)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from mxserve.api.sampling_params import SamplingParams
from mxserve.worker.eagle import load_head
from mxserve.worker.eagle_train import TrainConfig, train_draft
from mxserve.worker.llm import LLM
from mxserve.worker.model.loader import open_checkpoint

ENGINE = dict(num_threads=1, max_num_seqs=8)


def test_train_draft_makes_a_head_with_a_draft_vocabulary_and_resumes(tiny_checkpoint,
                                                                      tmp_path):
    ckpt = tmp_path / "model"
    shutil.copytree(tiny_checkpoint("llama"), ckpt)
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    (ckpt / "tokenizer_config.json").write_text(json.dumps(config))
    out, logs = tmp_path / "work", []
    args = dict(num_prompts=8, max_tokens=6, num_heldout=2, k=2, text_tokens=300,
                draft_vocab_size=3, log=logs.append, **ENGINE)

    report = train_draft(str(ckpt), str(out), train=TrainConfig(epochs=1, batch_tokens=64),
                         **args)
    assert report["num_samples"] >= 8 and report["answer_tokens"] > 0
    assert report["heldout"]["verify_steps"] > 0
    assert 0 < report["heldout"]["drafted"] <= 2 * report["heldout"]["verify_steps"]
    assert 0 <= report["heldout_teacher_forced_top1"]["first_draft"] <= 1
    assert report["draft_vocab_size"] == 3
    assert json.loads((out / "report.json").read_text())["head"] == report["head"]

    target = open_checkpoint(str(ckpt)).config
    head = load_head(report["head"], target, torch.float32, torch.device("cpu"))
    assert head.draft_vocab_size == 3
    assert head.draft_vocab_ranking.numel() > 3  # every distinct token the target wrote
    assert all(torch.isfinite(p).all() for p in head.parameters())
    assert len(set(head.draft_vocab_ranking.tolist())) == head.draft_vocab_ranking.numel()

    # the head drafts from its 3 tokens only, and the output is the target's
    spec = {"method": "eagle", "model": report["head"], "num_speculative_tokens": 3}
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    with LLM(str(ckpt), load_progress=False, dtype="float32", **ENGINE) as plain:
        want = [o.token_ids for o in plain.generate(prompts, params)]
    with LLM(str(ckpt), load_progress=False, dtype="float32", speculative_config=spec,
             **ENGINE) as llm:
        drafted: list[int] = []
        propose = llm.engine.drafter.propose

        def recording(plan, hidden, num_drafts):
            propose(plan, hidden, num_drafts)
            for r in num_drafts:
                drafted.extend(r.draft_token_ids)

        llm.engine.drafter.propose = recording
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
    allowed = set(head.draft_vocab_ranking[:3].tolist())
    assert drafted and set(drafted) <= allowed

    # resumed: the cached answers, then training from the saved epoch
    logs.clear()
    train_draft(str(ckpt), str(out), train=TrainConfig(epochs=2, batch_tokens=64), **args)
    assert any("cached samples" in line for line in logs), logs
    assert any("resuming after epoch 1" in line for line in logs), logs

    # more training from the saved head on other data (--init-head, --seed): a negligible step
    # size leaves the start's weights, which a random start does not have
    more = train_draft(str(ckpt), str(tmp_path / "more"), init_head_dir=report["head"],
                       train=TrainConfig(epochs=1, batch_tokens=64, lr=1e-12, seed=1), **args)
    assert any("starting from" in line for line in logs), logs
    with pytest.raises(ValueError, match="head_intermediate_size"):  # a head keeps its shape
        train_draft(str(ckpt), str(tmp_path / "more"), init_head_dir=report["head"],
                    head_intermediate_size=8, train=TrainConfig(epochs=1, batch_tokens=64),
                    **args)

    # a wider head (--head-intermediate-size): saved with its width, loaded by the engine,
    # drafting without changing the output
    width = 2 * target.intermediate_size
    wide = train_draft(str(ckpt), str(tmp_path / "wide"), head_intermediate_size=width,
                       train=TrainConfig(epochs=1, batch_tokens=64), **args)
    assert json.loads((tmp_path / "wide" / "head" / "config.json").read_text())[
        "intermediate_size"] == width
    assert load_head(wide["head"], target, torch.float32, torch.device("cpu")
                     ).layer.mlp.down_proj.weight.shape == (target.hidden_size, width)
    assert wide["heldout"]["verify_steps"] > 0
    with LLM(str(ckpt), load_progress=False, dtype="float32", **ENGINE, speculative_config={
            **spec, "model": wide["head"]}) as llm:
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == want
        assert sum(o.num_draft_tokens for o in outs) > 0
    start = load_head(report["head"], target, torch.float32, torch.device("cpu"))  # 2 epochs
    again = load_head(more["head"], target, torch.float32, torch.device("cpu"))
    for (name, p), q in zip(start.named_parameters(), again.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=1e-3, msg=name)  # bf16-stored both


def test_each_trained_drafting_step_computes_what_the_drafter_computes_there(tiny_checkpoint):
    """head_forward_steps (training, all positions at once) against the drafter's own passes
    over a paged KV cache (worker/eagle.py): step 1 at p is the catch-up over positions <= p;
    step s at p is the chain's (s - 1)-th pass after a catch-up ending at p - s + 1, fed the
    true next tokens. fp32, equal within rounding; the unrolled steps see exactly the KV the
    chain has (the catch-up's for earlier positions, the chain's own for its positions)."""
    from torch import nn

    from mxserve.worker.attention_backends import get_attention_backend
    from mxserve.worker.eagle import Span, _run
    from mxserve.worker.eagle_train import head_forward_steps, init_head

    target = open_checkpoint(str(tiny_checkpoint("llama"))).config
    head = init_head(target, seed=5, std=0.2)
    gen = torch.Generator().manual_seed(0)
    embed = torch.randn(target.vocab_size, target.hidden_size, generator=gen)
    head._embed = nn.Embedding.from_pretrained(embed)
    length, steps, block_size = 21, 3, 4
    ids = torch.randint(3, target.vocab_size, (length + 1,), generator=gen)
    feats = torch.randn(length, target.hidden_size, generator=gen)
    with torch.no_grad():
        outs = head_forward_steps(head, embed, ids[None, 1:], feats[None], steps)
    attn, table = get_attention_backend("torch"), list(range(8))
    cfg = head.config
    for s in range(1, steps + 1):
        for p in (s - 1, s + 3, length - 1):
            kv = tuple(torch.zeros(8, block_size, cfg.num_key_value_heads, cfg.head_dim)
                       for _ in range(2))
            start = p - s + 1  # the catch-up's last position
            g = _run(head, kv, attn, block_size, [Span(0, start + 1, table)],
                     ids[1:start + 2].tolist(), feats[:start + 1])[-1:]
            for t in range(start + 1, p + 1):  # the chain, fed the true next tokens
                g = _run(head, kv, attn, block_size, [Span(t, 1, table)], [int(ids[t + 1])], g)
            torch.testing.assert_close(g[0], outs[s - 1][0, p], rtol=1e-4, atol=1e-4)


def test_the_loss_weighs_regression_and_cross_entropy_as_configured():
    """feature_weight 0 leaves the cross-entropy alone (EAGLE-3's loss); the default adds the
    smooth L1 regression at weight 1 beside cls_weight times the cross-entropy."""
    from mxserve.worker.eagle_train import _losses

    torch.manual_seed(0)
    g, want, embed = torch.randn(6, 8), torch.randn(6, 8), torch.randn(11, 8)
    mask = torch.ones(6, dtype=torch.bool)
    ce = -((want @ embed.T).softmax(-1) * (g @ embed.T).log_softmax(-1)).sum(-1).mean()
    reg = torch.nn.functional.smooth_l1_loss(g, want)
    only_ce, _ = _losses(g, want, mask, embed, TrainConfig(cls_fraction=1.0, cls_weight=2.0,
                                                            feature_weight=0.0))
    both, _ = _losses(g, want, mask, embed, TrainConfig(cls_fraction=1.0))
    torch.testing.assert_close(only_ce, 2.0 * ce)
    torch.testing.assert_close(both, reg + 0.1 * ce)


def test_the_training_and_held_out_prompts_share_no_question_verse_or_subject():
    """The held-out chat prompts (bench/spec_decode.py's) are the 8 held-out questions and New
    Testament verses; the training split's general questions (hundreds, made from topics and
    tasks) repeat none of them, nor name a held-out question's subject."""
    from mxserve.worker.eagle_train import TEMPLATES, chat_prompts, general_questions

    train, heldout = general_questions("train"), general_questions("heldout")
    assert len(heldout) == 8 and len(set(train)) == len(train) > 1000
    subjects = ("gravity", "photosynthesis", "bee", "volcano", "exercise", "moon", "mountain",
                "email")
    assert not [q for q in train if any(s in q.lower() for s in subjects)]
    train_chat = {c[0]["content"] for c in chat_prompts(2000, "train")}
    heldout_chat = {c[0]["content"] for c in chat_prompts(200, "heldout")}
    assert not train_chat & heldout_chat
    assert len({q for q in train_chat if q in set(train)}) > 300  # the quarter: questions
    verse_prompts = tuple(t.split("{")[0] for t in TEMPLATES)
    assert {q for q in heldout_chat if not q.startswith(verse_prompts)} <= set(heldout)
