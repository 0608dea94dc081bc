"""kernels/gemv.py on CUDA at the decode shapes of the 1B and 8B models, M = 1..8, against an
fp32 reference (within one bf16 rounding), with a bias; the model's dense linears take it for a
few rows and cuBLAS past GemvOptions.max_rows; decode_projection's fused steps at the 1B shapes
against their torch references; and a bf16 engine decodes the same tokens with the fused projections
as without them."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from mxserve import LLM, SamplingParams  # noqa: E402
from mxserve.kernels import gemv as gemv_mod  # noqa: E402
from mxserve.worker.model.parallel import ColumnParallelLinear  # noqa: E402
from mxserve.worker.model.tp import TPGroup  # noqa: E402

SHAPES = [(3072, 2048), (2048, 8192), (128256, 2048), (6144, 4096), (4096, 14336), (37, 576)]


def _within_one_rounding(got, ref):
    err = (got.float() - ref).abs()
    assert (err <= ref.abs() * 2.0**-8 + 1e-3).all(), err.max()


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 3, 8])
def test_gemv_matches_fp32_at_real_shapes(n, k, m):
    gen = torch.Generator(device="cuda").manual_seed(n + k + m)
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    bias = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16)
    _within_one_rounding(gemv_mod.gemv(x, w), x.float() @ w.float().T)
    _within_one_rounding(gemv_mod.gemv(x, w, bias), x.float() @ w.float().T + bias.float())


def test_model_linear_uses_gemv_for_a_few_rows_and_cublas_past_them(monkeypatch):
    lin = ColumnParallelLinear(2048, [1024, 512], True, TPGroup(), torch.bfloat16, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    lin.weight.data.copy_(torch.randn(1536, 2048, device="cuda", generator=gen) * 0.02)
    lin.bias.data.copy_(torch.randn(1536, device="cuda", generator=gen))
    calls = []
    real = gemv_mod.gemv
    monkeypatch.setattr(gemv_mod, "gemv", lambda *a, **kw: calls.append(a[0].shape[0])
                        or real(*a, **kw))
    max_rows = lin.gemv_options.max_rows
    for m in (1, max_rows, max_rows + 1, 64):
        x = torch.randn(m, 2048, device="cuda", generator=gen).to(torch.bfloat16)
        ref = x.float() @ lin.weight.float().T + lin.bias.float()
        _within_one_rounding(lin(x), ref)
    assert calls == [1, max_rows]


def test_decode_projection_at_the_1b_shapes():
    """q/k/v with norm, RoPE and the K/V write; gate/up with norm and SiLU-and-mul: against the
    CPU references of the same steps (within two bf16 roundings), caches written exactly."""
    gen = torch.Generator(device="cuda").manual_seed(2)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(torch.bfloat16)

    x, residual, norm_w = rnd(1, 2048), rnd(1, 2048, scale=4), 1 + rnd(2048, scale=0.1)
    norm = gemv_mod.Norm(residual, norm_w, 1e-5)
    wqkv, wgu = rnd(3072, 2048, scale=0.02), rnd(16384, 2048, scale=0.02)
    angles = torch.outer(torch.arange(4096.0, device="cuda"),
                         1.0 / 500000 ** (torch.arange(0, 64, 2, device="cuda") / 64))
    rope = gemv_mod.Rope(torch.tensor([1234], device="cuda"), angles.cos().contiguous(),
                         angles.sin().contiguous(), 32, 8, 64)
    caches = [torch.zeros(40, 16, 8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    slots = torch.tensor([333], device="cuda")
    got, new_res = gemv_mod.decode_projection(
        x, wqkv, norm=norm, rope=rope, kv=gemv_mod.KVWrite(caches[0], caches[1], slots))
    ref, ref_res = gemv_mod.decode_projection(
        x, wqkv, norm=norm, rope=rope, kv=gemv_mod.KVWrite(caches[2], caches[3], slots),
        backend="torch")
    assert torch.equal(new_res, ref_res)
    _within_two_roundings(got, ref)
    assert torch.equal(caches[0][333 // 16, 333 % 16], got[0, 2048:2560].view(8, 64))
    assert torch.equal(caches[1][333 // 16, 333 % 16], got[0, 2560:].view(8, 64))
    _within_two_roundings(caches[0], caches[2].float())
    act, _ = gemv_mod.decode_projection(x, wgu, norm=norm, silu_and_mul=True)
    act_ref, _ = gemv_mod.decode_projection(x, wgu, norm=norm, silu_and_mul=True,
                                            backend="torch")
    _within_two_roundings(act, act_ref.float())


@pytest.mark.parametrize("fmt", ["e2m1", "e2m3"])
def test_mx_decode_projection_matches_its_dequantized_weight(fmt):
    """MX weights in the same kernel at the 1B q/k/v shape: as the dense dequantized weight."""
    from mxserve.kernels.mx import dequantize_mx, quantize_mx
    from mxserve.kernels.mx_layout import prepare_mx_weight

    gen = torch.Generator(device="cuda").manual_seed(4)
    wf = torch.randn(3072, 2048, device="cuda", generator=gen) * 0.02
    mxw = prepare_mx_weight(quantize_mx(wf, fmt))
    dense = dequantize_mx(quantize_mx(wf, fmt), torch.float32).to(torch.bfloat16)
    x = torch.randn(1, 2048, device="cuda", generator=gen).to(torch.bfloat16)
    residual = (torch.randn(1, 2048, device="cuda", generator=gen) * 4).to(torch.bfloat16)
    norm = gemv_mod.Norm(residual, torch.ones(2048, device="cuda", dtype=torch.bfloat16), 1e-5)
    angles = torch.outer(torch.arange(64.0, device="cuda"),
                         1.0 / 10000 ** (torch.arange(0, 64, 2, device="cuda") / 64))
    rope = gemv_mod.Rope(torch.tensor([9], device="cuda"), angles.cos().contiguous(),
                         angles.sin().contiguous(), 32, 8, 64)
    got, _ = gemv_mod.decode_projection(x, mxw, norm=norm, rope=rope)
    want, _ = gemv_mod.decode_projection(x, dense, norm=norm, rope=rope)
    _within_two_roundings(got, want.float())


def _within_two_roundings(got, ref):
    err = (got.float() - ref.float()).abs()
    assert (err <= ref.float().abs() * 2.0**-7 + 2e-3).all(), err.max()


@pytest.mark.parametrize("quantization", [None, "mxfp4"])
def test_bf16_engine_decodes_the_same_with_and_without_the_fused_projections(tiny_checkpoint,
                                                                            quantization):
    """Batch-1 decode (CUDA graphs and eager) with the fused kernels vs all of them apart
    (gemv max_rows 0: cuBLAS or mx_linear, layer_ops, write_kv_cache): the same greedy
    tokens, and logprobs within bf16 noise; bf16 and MXFP4 weights."""
    path = str(tiny_checkpoint("llama", hidden_size=256, intermediate_size=512,
                               num_attention_heads=4, num_key_value_heads=2,
                               num_hidden_layers=3))
    prompt = torch.randint(3, 256, (37,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    runs = {}
    for fused in (True, False):
        for eager in (False, True):
            llm = LLM(model=path, device="cuda", dtype="bfloat16", load_progress=False,
                      enforce_eager=eager, quantization=quantization,
                      gemv={"max_rows": 1 if fused else 0})
            out = llm.generate([prompt], params)[0]
            logprobs = [d[t] for t, d in zip(out.token_ids, out.logprobs)]
            runs[fused, eager] = (out.token_ids, logprobs)
            del llm
    for eager in (False, True):
        assert runs[True, eager][0] == runs[False, eager][0]
        diff = [abs(a - b) for a, b in zip(runs[True, eager][1], runs[False, eager][1])]
        assert max(diff) < 0.05, diff
