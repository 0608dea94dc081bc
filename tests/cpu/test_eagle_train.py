"""`mxserve train-draft` end to end on a tiny model: data, training, a head the engine loads,
the report, and a resumed run (worker/eagle_train.py)."""

from __future__ import annotations

import json
import shutil

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
