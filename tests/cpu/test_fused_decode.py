"""The model's fused decode branch, wired end to end on CPU.

On CUDA a one-row decode step runs each block's first projection as one kernel
(kernels/gemv.py's decode_projection: add + RMSNorm, the projection, then RoPE and the K/V
write, or SiLU-and-mul), the stream starts as the embedding (no zeros), and the layer does not
call the backend's `write_kv` (the kernel wrote K/V at `kv_slots`). The branch is chosen by
ColumnParallelLinear.can_fuse_decode, which says no off CUDA; here it is made to say yes, so the
same branch runs with decode_projection's CPU path (the torch references of its steps) and the
Triton backend in the interpreter. Its greedy tokens and logprobs must be the unfused branch's,
with the model writing K/V itself in the decode steps (tests/gpu/test_gemv_gpu.py runs the
kernels)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

from mxserve import LLM, SamplingParams  # noqa: E402
from mxserve.kernels import gemv  # noqa: E402
from mxserve.worker.attention_triton import TritonAttention  # noqa: E402
from mxserve.worker.model.parallel import ColumnParallelLinear  # noqa: E402


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v with a bias
def test_fused_decode_branch_gives_the_unfused_tokens(tiny_checkpoint, monkeypatch, arch):
    path = str(tiny_checkpoint(arch))
    prompt = torch.randint(3, 200, (21,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    backend_writes = []
    write_kv = TritonAttention.write_kv

    def spy(self, k, *args):
        backend_writes.append(k.shape[0])
        return write_kv(self, k, *args)

    monkeypatch.setattr(TritonAttention, "write_kv", spy)
    runs = {}
    for fused in (False, True):
        if fused:
            monkeypatch.setattr(ColumnParallelLinear, "can_fuse_decode", lambda self, x: (
                x.dim() == 2 and x.shape[0] == 1 and self.decode_weight() is not None
                and gemv.supported(x, self.decode_weight())))
        backend_writes.clear()
        llm = LLM(model=path, device="cpu", dtype="bfloat16", attention_backend="triton",
                  pack_cpu_weights=False, load_progress=False)
        out = llm.generate([prompt], params)[0]
        runs[fused] = (out.token_ids, [d[t] for t, d in zip(out.token_ids, out.logprobs)],
                       list(backend_writes))
    layers, steps = 2, params.max_tokens  # tiny_checkpoint: 2 layers; 1 prefill + 11 decodes
    assert runs[False][2] == [len(prompt)] * layers + [1] * layers * (steps - 1)
    assert runs[True][2] == [len(prompt)] * layers  # fused: the kernel wrote every decode's
    assert runs[True][0] == runs[False][0]
    diff = max(abs(a - b) for a, b in zip(runs[True][1], runs[False][1]))
    assert diff < 0.05, diff
