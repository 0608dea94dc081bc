"""`mxserve quantize` on CUDA: GPTQ there writes the CPU's bytes, and the GPU engine serves them
as the CPU engine does."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from safetensors.torch import load_file  # noqa: E402

from mxserve import LLM, SamplingParams  # noqa: E402
from mxserve.worker.model.quantize import quantize_checkpoint  # noqa: E402

SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=3)


def test_gptq_on_cuda_writes_the_cpu_bytes_and_serves(tiny_checkpoint, tmp_path):
    src = str(tiny_checkpoint("llama", **SHAPE))
    text = tmp_path / "calibration.txt"
    gen = torch.Generator().manual_seed(0)
    text.write_text(" ".join(f"w{i}" for i in torch.randint(3, 256, (2000,), generator=gen)))
    out = {dev: quantize_checkpoint(src, "mxfp4", str(tmp_path / dev), device=dev,
                                    method="gptq", calibration=str(text), progress=False,
                                    window=256)
           for dev in ("cuda", "cpu")}
    a, b = (load_file(f"{out[dev]}/model.safetensors") for dev in ("cuda", "cpu"))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [[5, 17, 42, 9], list(range(3, 40))]
    tokens = {dev: [o.token_ids for o in LLM(model=out["cuda"], device=dev, dtype="float32",
                                             load_progress=False).generate(prompts, params)]
              for dev in ("cuda", "cpu")}
    assert tokens["cuda"] == tokens["cpu"]
