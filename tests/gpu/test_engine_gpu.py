"""The engine on CUDA (Triton paged attention) gives the CPU reference's greedy tokens.

Tiny random Llama, float32 on both sides, a batch of prompts of different lengths; chunked prefill
at an odd chunk size, prefix-cache hits on a second pass, and preemption under a tiny KV pool;
and MX-quantized, against the CPU MX engine whose numerics bench/results/mx_quality.scale_modes.md
measured.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from mxserve import LLM, SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=3)


@pytest.fixture(scope="module")
def setup(tiny_checkpoint):
    path = str(tiny_checkpoint("llama", **SHAPE))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (3, 17, 40, 75, 130)]
    cpu = LLM(model=path, device="cpu", dtype="float32", load_progress=False)
    return path, prompts, [o.token_ids for o in cpu.generate(prompts, GREEDY)]


@pytest.mark.parametrize("options", [
    dict(),
    dict(max_num_batched_tokens=7),  # chunked prefill at an odd chunk size
    dict(num_kv_blocks=14, max_num_batched_tokens=64),  # preemption
], ids=["plain", "chunked", "preempting"])
def test_gpu_engine_matches_cpu_greedy_tokens(setup, options):
    path, prompts, expected = setup
    llm = LLM(model=path, device="cuda", dtype="float32", load_progress=False, **options)
    assert type(llm.engine.runner.attn).__name__ == "TritonAttention"
    first = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in first] == expected
    again = llm.generate(prompts, GREEDY)  # prefix-cache hits
    assert [o.token_ids for o in again] == expected
    if "num_kv_blocks" not in options:
        assert sum(o.num_cached_tokens for o in again) > 0
    kv = llm.engine.kv
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks


@pytest.mark.parametrize("head", [False, True], ids=["", "lm_head"])
@pytest.mark.parametrize("quantization", ["mxfp4", "mxfp6"])
def test_gpu_mx_engine_matches_the_measured_mx_reference(setup, quantization, head):
    """The quality bound of MX weights (bench/results/mx_quality.scale_modes.md) was measured
    with the weights quantized and dequantized in torch, which is what the CPU engine computes
    with. The GPU engine (packed weights, Triton mx_linear kernels, decode graphs) must compute
    the same function: the CPU MX engine's greedy tokens, token for token; with
    `quantize_lm_head` too."""
    path, prompts, _ = setup
    cpu = LLM(model=path, device="cpu", dtype="float32", load_progress=False,
              quantization=quantization, quantize_lm_head=head)
    expected = [o.token_ids for o in cpu.generate(prompts, GREEDY)]
    gpu = LLM(model=path, device="cuda", dtype="float32", load_progress=False,
              quantization=quantization, quantize_lm_head=head)
    assert gpu.engine.runner.model.layers[0].mlp.down_proj.weight.packed
    assert (gpu.engine.runner.model.lm_head.mx is not None) == head
    assert [o.token_ids for o in gpu.generate(prompts, GREEDY)] == expected



def test_h2o_engine_with_decode_graphs_gives_the_eager_tokens_and_mass(setup):
    """kv_eviction="h2o" with a small budget: the engine replaying decode graphs (mass from the
    decode kernel's stored scores, position offsets in the graph's inputs, KV moves made before
    the replay) gives the greedy tokens and keeps the tokens that the same engine run eagerly
    does; each replayed step's mass equals the torch backend's on that step's inputs."""
    import dataclasses

    from mxserve.worker.attention import TorchAttention

    path, prompts, _ = setup
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    runs = {}
    for eager in (True, False):
        llm = LLM(model=path, device="cuda", dtype="float32", load_progress=False,
                  enforce_eager=eager, kv_eviction="h2o", kv_budget=40, max_num_seqs=8)
        engine, kept, checked = llm.engine, [], []
        compact = engine.kv.compact
        engine.kv.compact = lambda rid, keep, compact=compact, kept=kept: (
            kept.append(list(keep)), compact(rid, keep))[1]
        runner, execute = engine.runner, engine.runner.execute

        def check_mass(plan, runner=runner, execute=execute, checked=checked):
            result = execute(plan)
            graphs = runner.graphs
            if graphs is not None and graphs.last_size is not None and len(checked) < 6:
                got = result.attn_mass.clone()
                runner.graphs, attn = None, runner.attn
                runner.attn = TorchAttention()  # the reference, on this step's inputs
                try:
                    want = execute(dataclasses.replace(plan, kv_moves=[])).attn_mass
                finally:
                    runner.graphs, runner.attn = graphs, attn
                torch.testing.assert_close(got[:, :want.shape[1]], want, atol=1e-5, rtol=1e-4)
                assert got[:, want.shape[1]:].eq(0).all()
                checked.append(len(plan.scheduled))
            return result

        runner.execute = check_mass
        tokens = [o.token_ids for o in llm.generate(prompts, params)]
        graphs = engine.runner.graphs
        assert (graphs is None) == eager
        if not eager:
            assert graphs.num_replays > 0 and len(checked) == 6
        assert engine.evictor.num_evicted_tokens > 0
        engine.kv.check_integrity()
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
        runs[eager] = tokens, kept
    assert runs[False] == runs[True]
