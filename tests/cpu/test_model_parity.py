"""Logits and greedy tokens match Hugging Face transformers on tiny random checkpoints.

Each case runs a batch of prompts of different lengths through our engine with chunked prefill at
an odd chunk size (7 tokens per step), records the logits of every step, and checks them against
transformers' forward pass over the same sequences, plus 32 greedy tokens against `generate`.
"""

from __future__ import annotations

import pytest
import torch

from mxserve import LLM, SamplingParams

CASES = {
    "llama3-rope-untied": ("llama", dict(rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}, rope_theta=500000.0)),
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "mistral": ("mistral", dict(head_dim=16)),
    "qwen2-bias-tied": ("qwen2", dict(tie_word_embeddings=True)),
}
PROMPT_LENS = [3, 16, 23, 41]
NUM_STEPS = 32


def _hf_model(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: never stop, never mask EOS
    return model


def _record_logits(llm: LLM) -> list[tuple[str, int, torch.Tensor]]:
    """Wrap the runner so every sampled row is kept as (request id, position, logits)."""
    records = []
    runner = llm.engine.runner
    execute = runner.execute

    def recording(plan):
        result = execute(plan)
        rows = [s for s in plan.scheduled if s.samples]
        for s, logits in zip(rows, result.logits):
            records.append((s.request.request_id, s.start_position + s.num_new_tokens - 1,
                            logits.clone()))
        return result

    runner.execute = recording
    return records


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_greedy_tokens_match_transformers(tiny_checkpoint, case):
    arch, overrides = CASES[case]
    path = tiny_checkpoint(arch, **overrides)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in PROMPT_LENS]

    llm = LLM(model=str(path), dtype="float32", max_num_batched_tokens=7, num_kv_blocks=64,
              load_progress=False)
    records = _record_logits(llm)
    params = SamplingParams(temperature=0, max_tokens=NUM_STEPS, ignore_eos=True)
    outputs = llm.generate(prompts, params)

    hf = _hf_model(path)
    id_to_seq = {}
    for prompt, out in zip(prompts, outputs):
        assert len(out.token_ids) == NUM_STEPS
        assert out.finish_reason == "length"
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=NUM_STEPS,
                               do_sample=False)[0, len(prompt):]
        assert out.token_ids == expected.tolist(), f"greedy tokens differ for prompt {len(prompt)}"
        id_to_seq[out.request_id] = prompt + out.token_ids

    assert len(records) == len(prompts) * NUM_STEPS
    with torch.no_grad():
        hf_logits = {rid: hf(torch.tensor([seq])).logits[0] for rid, seq in id_to_seq.items()}
    worst = max((logits - hf_logits[rid][pos]).abs().max().item() for rid, pos, logits in records)
    assert worst < 1e-4, f"max |logit difference| {worst:.2e}"
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
