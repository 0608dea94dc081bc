"""kernels/gemv.py under the Triton interpreter: the few-row dense linear against an fp32
reference (different summation order: within one rounding of the output dtype), on odd shapes
(K not a power of 2, N not a multiple of the program's rows, M past GemvOptions.max_rows, the
largest K), with bias, fp16, strided and 3-D x; decode_projection's steps against layer_ops'
references: the add + RMSNorm prologue (the new residual exact, the old one untouched), the
SiLU-and-mul and RoPE epilogues, and the K/V write into paged caches (padding slots skipped);
and the errors."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

from mxserve.kernels import gemv as gemv_mod  # noqa: E402
from mxserve.kernels.gemv import MAX_K, KVWrite, Norm, Rope, decode_projection, gemv  # noqa: E402
from mxserve.kernels.layer_ops import (  # noqa: E402
    add_rms_norm_torch_,
    apply_rotary_torch_,
    rms_norm_torch,
    silu_and_mul_torch,
)
from mxserve.kernels.mx import dequantize_mx, quantize_mx  # noqa: E402
from mxserve.kernels.mx_layout import prepare_mx_weight  # noqa: E402
from mxserve.kernels.mx_linear import mx_linear_torch  # noqa: E402


def _reference(x, w, bias):
    y = x.float() @ w.float().T
    return y + bias.float() if bias is not None else y


def _check(got, x, w, bias):
    ref = _reference(x, w, bias)
    assert got.dtype == x.dtype and got.shape == ref.shape
    # one rounding of the output dtype (bf16: 2^-8 relative), plus fp32 sums in another order
    ulp = 2.0**-8 if x.dtype == torch.bfloat16 else 2.0**-11
    err = (got.float() - ref).abs()
    assert (err <= ref.abs() * ulp + 1e-4).all(), err.max()


@pytest.mark.parametrize("m,n,k", [(1, 37, 576), (3, 64, 1536), (5, 9, 2048), (2, 3, MAX_K),
                                   (1, 300, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_matches_the_fp32_reference(m, n, k, dtype):
    gen = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    _check(gemv(x, w, backend="triton"), x, w, None)


def test_gemv_adds_the_bias_and_keeps_leading_dims():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 576, generator=gen).to(torch.bfloat16)
    w = (torch.randn(40, 576, generator=gen) * 0.05).to(torch.bfloat16)
    bias = torch.randn(40, generator=gen).to(torch.bfloat16)
    got = gemv(x, w, bias, backend="triton")
    assert got.shape == (2, 3, 40)
    _check(got.view(6, 40), x.view(6, 576), w, bias)


def test_gemv_reads_strided_rows_of_x():
    gen = torch.Generator().manual_seed(2)
    big = torch.randn(3, 2 * 256, generator=gen).to(torch.bfloat16)
    x = big[:, :256]  # row stride 512
    w = (torch.randn(24, 256, generator=gen) * 0.05).to(torch.bfloat16)
    _check(gemv(x, w, backend="triton"), x.contiguous(), w, None)


def test_gemv_every_program_configuration_gives_the_same_rows():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 200, generator=gen).to(torch.bfloat16)
    w = (torch.randn(33, 200, generator=gen) * 0.05).to(torch.bfloat16)
    outs = [gemv(x, w, backend="triton", config=(bn, 4)) for bn in (1, 2, 8, 32)]
    for out in outs:
        _check(out, x, w, None)


def test_rows_taken_a_few_at_once_equal_each_row_alone():
    """Rows of x reduced together (several a pass, a partial last pass) give each row's bits
    computed alone: a verify's rows are what decode steps compute, in every epilogue."""
    gen = torch.Generator().manual_seed(11)
    m, heads, kv_heads, d, k, page = 7, 4, 2, 16, 64, 4
    x, residual, norm_w, w, b, rope = _rope_case(m, heads, kv_heads, d, k, gen)
    norm = Norm(residual, norm_w, 1e-6)
    slots = torch.randperm(6 * page, generator=gen)[:m]

    def caches():
        return (torch.zeros(6, page, kv_heads, d, dtype=torch.bfloat16),
                torch.zeros(6, page, kv_heads, d, dtype=torch.bfloat16))

    def rows(i):
        return slice(i, i + 1)

    kc, vc = caches()
    got, res = decode_projection(x, w, b, norm=norm, rope=rope, kv=KVWrite(kc, vc, slots),
                                 backend="triton")
    kc1, vc1 = caches()
    for i in range(m):
        one = Rope(rope.positions[rows(i)], rope.cos, rope.sin, heads, kv_heads, d)
        alone, res1 = decode_projection(x[rows(i)], w, b, norm=Norm(residual[rows(i)], norm_w,
                                                                      1e-6),
                                        rope=one, kv=KVWrite(kc1, vc1, slots[rows(i)]),
                                        backend="triton")
        assert torch.equal(alone, got[rows(i)]) and torch.equal(res1, res[rows(i)])
    assert torch.equal(kc1, kc) and torch.equal(vc1, vc) and kc.abs().sum() > 0
    gate_up = (torch.randn(2 * 40, k, generator=gen) * 0.05).to(torch.bfloat16)
    both, _ = decode_projection(x, gate_up, norm=norm, silu_and_mul=True, backend="triton")
    plain = gemv(x, w, b, backend="triton")
    for i in range(m):
        alone, _ = decode_projection(x[rows(i)], gate_up, norm=Norm(residual[rows(i)], norm_w,
                                                                     1e-6),
                                     silu_and_mul=True, backend="triton")
        assert torch.equal(alone, both[rows(i)])
        assert torch.equal(gemv(x[rows(i)], w, b, backend="triton"), plain[rows(i)])


def test_gemv_on_cpu_by_default_is_f_linear():
    x = torch.randn(2, 64).to(torch.bfloat16)
    w = torch.randn(8, 64).to(torch.bfloat16)
    assert torch.equal(gemv(x, w), torch.nn.functional.linear(x, w))


def test_gemv_rejects_what_it_cannot_multiply():
    w = torch.zeros(8, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="16-bit"):
        gemv(torch.zeros(1, 64), w.float(), backend="triton")
    with pytest.raises(ValueError, match="x.s dtype"):
        gemv(torch.zeros(1, 64, dtype=torch.float16), w, backend="triton")
    with pytest.raises(ValueError, match="K <="):
        gemv(torch.zeros(1, 63, dtype=torch.bfloat16), w, backend="triton")
    with pytest.raises(ValueError, match="contiguous rows"):
        gemv(torch.zeros(1, 8, dtype=torch.bfloat16), w.t(), backend="triton")
    wide = torch.zeros(2, MAX_K + 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="K <="):
        gemv(torch.zeros(1, MAX_K + 32, dtype=torch.bfloat16), wide, backend="triton")
    with pytest.raises(ValueError, match="bias"):
        gemv(torch.zeros(1, 64, dtype=torch.bfloat16), w, torch.zeros(7, dtype=torch.bfloat16),
             backend="triton")
    assert not gemv_mod.supported(torch.zeros(1, 64), w)


def _norm_inputs(m, k, dtype, gen):
    x = torch.randn(m, k, generator=gen).to(dtype)
    residual = (torch.randn(m, k, generator=gen) * 4).to(dtype)
    norm_w = (1 + torch.randn(k, generator=gen) * 0.1).to(dtype)
    return x, residual, norm_w


def _close(got, want, ulps=2):
    """Within `ulps` roundings of the output dtype: the products' sums run in another order,
    and one rounding before an activation can move its result by one more."""
    ulp = 2.0**-8 if got.dtype == torch.bfloat16 else 2.0**-11
    err = (got.float() - want.float()).abs()
    assert (err <= want.float().abs() * ulps * ulp + 1e-3).all(), err.max()


@pytest.mark.parametrize("m,n,k", [(1, 37, 576), (2, 20, 2048), (1, 5, 100)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_norm_prologue_is_add_rms_norm_then_the_linear(m, n, k, dtype):
    gen = torch.Generator().manual_seed(m + n + k)
    x, residual, norm_w = _norm_inputs(m, k, dtype, gen)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    kept = residual.clone()
    y, new_res = decode_projection(x, w, bias, norm=Norm(residual, norm_w, 1e-5),
                                   backend="triton")
    assert torch.equal(residual, kept)  # not in place: the other programs read it
    want_res = residual.clone()
    normed = add_rms_norm_torch_(x, want_res, norm_w, 1e-5)
    assert torch.equal(new_res, want_res)  # x + residual, rounded once
    _check(y, normed, w, bias)
    y_cpu, res_cpu = decode_projection(x, w, bias, norm=Norm(residual, norm_w, 1e-5))
    assert torch.equal(res_cpu, want_res) and torch.equal(residual, kept)
    _check(y_cpu, normed, w, bias)


@pytest.mark.parametrize("m,inter,k", [(1, 48, 576), (3, 100, 256), (1, 8, 4096)])
def test_silu_and_mul_epilogue(m, inter, k):
    gen = torch.Generator().manual_seed(m + inter + k)
    x, residual, norm_w = _norm_inputs(m, k, torch.bfloat16, gen)
    w = (torch.randn(2 * inter, k, generator=gen) * 0.05).to(torch.bfloat16)
    for norm in (None, Norm(residual, norm_w, 1e-6)):
        got, _ = decode_projection(x, w, norm=norm, silu_and_mul=True, backend="triton")
        src = x if norm is None else add_rms_norm_torch_(x, residual.clone(), norm_w, 1e-6)
        gate_up = (src.float() @ w.float().T).to(torch.bfloat16)
        assert got.shape == (m, inter)
        _close(got, silu_and_mul_torch(gate_up))


def _rope_case(m, heads, kv_heads, d, k, gen, bias=True):
    x, residual, norm_w = _norm_inputs(m, k, torch.bfloat16, gen)
    n = (heads + 2 * kv_heads) * d
    w = (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    angles = torch.outer(torch.arange(64.0), 1.0 / 10000 ** (torch.arange(0, d, 2) / d))
    rope = Rope(torch.randint(0, 64, (m,), generator=gen), angles.cos().contiguous(),
                angles.sin().contiguous(), heads, kv_heads, d)
    return x, residual, norm_w, w, b, rope


def _rope_reference(x, w, b, rope, norm=None):
    src = x if norm is None else add_rms_norm_torch_(x, norm.residual.clone(), norm.weight,
                                                     norm.eps)
    y = (src.float() @ w.float().T + (b.float() if b is not None else 0)).to(x.dtype)
    rot = (rope.num_heads + rope.num_kv_heads) * rope.head_dim
    apply_rotary_torch_(y[:, :rot].view(y.shape[0], -1, rope.head_dim), rope.positions,
                        rope.cos, rope.sin)
    return y


@pytest.mark.parametrize("m,heads,kv_heads,d,k", [(1, 4, 2, 16, 64), (2, 6, 2, 32, 200),
                                                  (1, 8, 8, 64, 576)])
def test_rope_epilogue_rotates_q_and_k_only(m, heads, kv_heads, d, k):
    gen = torch.Generator().manual_seed(heads * d + k)
    x, residual, norm_w, w, b, rope = _rope_case(m, heads, kv_heads, d, k, gen)
    for norm in (None, Norm(residual, norm_w, 1e-5)):
        got, _ = decode_projection(x, w, b, norm=norm, rope=rope, backend="triton")
        _close(got, _rope_reference(x, w, b, rope, norm))
        cpu, _ = decode_projection(x, w, b, norm=norm, rope=rope)
        _close(cpu, _rope_reference(x, w, b, rope, norm))


def test_rope_epilogue_writes_k_and_v_to_their_slots_and_skips_padding():
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, d, page = 4, 2, 16, 4
    x, residual, norm_w, w, b, rope = _rope_case(3, heads, kv_heads, d, 64, gen, bias=False)
    slots = torch.tensor([6, -1, 13])  # the middle row is padding
    k_cache = torch.full((5, page, kv_heads, d), 7.0).to(torch.bfloat16)
    v_cache = torch.full((5, page, kv_heads, d), 9.0).to(torch.bfloat16)
    norm = Norm(residual, norm_w, 1e-6)
    got, new_res = decode_projection(x, w, norm=norm, rope=rope,
                                     kv=KVWrite(k_cache, v_cache, slots), backend="triton")
    q_cols, rot = heads * d, (heads + kv_heads) * d
    k_new = got[:, q_cols:rot].view(3, kv_heads, d)
    v_new = got[:, rot:].view(3, kv_heads, d)
    for row, slot in ((0, 6), (2, 13)):
        assert torch.equal(k_cache[slot // page, slot % page], k_new[row])
        assert torch.equal(v_cache[slot // page, slot % page], v_new[row])
    written = torch.zeros(5 * page, dtype=torch.bool)
    written[[6, 13]] = True
    assert (k_cache.view(5 * page, -1)[~written] == 7).all()
    assert (v_cache.view(5 * page, -1)[~written] == 9).all()
    # the CPU default writes the same caches
    k2 = torch.full_like(k_cache, 7.0)
    v2 = torch.full_like(v_cache, 9.0)
    cpu, _ = decode_projection(x, w, norm=norm, rope=rope, kv=KVWrite(k2, v2, slots))
    _close(cpu, got)
    _close(k2, k_cache)
    _close(v2, v_cache)


def test_decode_projection_rejects_what_it_cannot_fuse():
    gen = torch.Generator().manual_seed(0)
    x, residual, norm_w, w, b, rope = _rope_case(1, 4, 2, 16, 64, gen)
    with pytest.raises(ValueError, match="norm"):
        decode_projection(x, w, norm=Norm(residual[:, :8], norm_w, 1e-6), backend="triton")
    with pytest.raises(ValueError, match="silu_and_mul"):
        decode_projection(x, w[:7], silu_and_mul=True, backend="triton")
    with pytest.raises(ValueError, match="silu_and_mul"):
        decode_projection(x, w, silu_and_mul=True, rope=rope, backend="triton")
    with pytest.raises(ValueError, match="rope"):
        decode_projection(x, w[:-16], rope=rope, backend="triton")
    cache = torch.zeros(2, 4, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="kv needs rope"):
        decode_projection(x, w, kv=KVWrite(cache, cache.clone(), torch.zeros(1)),
                          backend="triton")
    with pytest.raises(ValueError, match="kv needs rope"):
        decode_projection(x, w, rope=rope, kv=KVWrite(cache.float(), cache.float(),
                                                      torch.zeros(1)), backend="triton")
    with pytest.raises(ValueError, match="M, K"):
        decode_projection(x.view(1, 1, 64), w, backend="triton")


def test_float32_out_holds_the_rounded_values():
    """The LM head's logits: fp32 out equal to the 16-bit result cast up (no cast kernel)."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(1, 300, generator=gen).to(torch.bfloat16)
    w = (torch.randn(70, 300, generator=gen) * 0.05).to(torch.bfloat16)
    got = gemv(x, w, out_dtype=torch.float32, backend="triton")
    assert got.dtype == torch.float32
    assert torch.equal(got, gemv(x, w, backend="triton").float())
    assert gemv(x, w, out_dtype=torch.float32).dtype == torch.float32  # CPU default
    with pytest.raises(ValueError, match="out_dtype"):
        gemv(x, w, out_dtype=torch.float16, backend="triton")


def test_norm_without_a_residual_normalizes_x_and_returns_it_as_the_stream():
    """The first layer: the stream is the embedding itself (no add, nothing written)."""
    gen = torch.Generator().manual_seed(10)
    x, _, norm_w = _norm_inputs(1, 576, torch.bfloat16, gen)
    w = (torch.randn(30, 576, generator=gen) * 0.05).to(torch.bfloat16)
    for backend in ("triton", "auto"):
        y, stream = decode_projection(x, w, norm=Norm(None, norm_w, 1e-6), backend=backend)
        assert stream is x
        _check(y, rms_norm_torch(x, norm_w, 1e-6), w, None)


@pytest.mark.parametrize("fmt", ["e2m1", "e2m3", "e3m2", "e4m3"])
def test_mx_weights_decode_exactly_in_every_step(fmt):
    """MX weights (mx_linear's layout) in the same kernel: the plain product against mx_linear's
    reference, and the fused q/k/v (norm, RoPE, K/V write) and gate/up (SiLU) steps against the
    torch path on the dequantized weight."""
    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, d, k = 4, 2, 16, 256
    n = (heads + 2 * kv_heads) * d
    wf = torch.randn(n, k, generator=gen) * 0.05
    mxw = prepare_mx_weight(quantize_mx(wf, fmt))
    dense = dequantize_mx(quantize_mx(wf, fmt), torch.float32).to(torch.bfloat16)  # exact
    x, residual, norm_w = _norm_inputs(1, k, torch.bfloat16, gen)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    got = gemv(x, mxw, bias, backend="triton")
    want = mx_linear_torch(x, mxw, bias)
    _close(got, want, ulps=1)
    _close(got, gemv(x, dense, bias, backend="triton"), ulps=1)
    _, _, _, _, _, rope = _rope_case(1, heads, kv_heads, d, k, gen)
    norm = Norm(residual, norm_w, 1e-6)
    caches = [torch.zeros(3, 4, kv_heads, d, dtype=torch.bfloat16) for _ in range(4)]
    slots = torch.tensor([5])
    y_mx, res_mx = decode_projection(x, mxw, bias, norm=norm, rope=rope,
                                     kv=KVWrite(caches[0], caches[1], slots), backend="triton")
    y_d, res_d = decode_projection(x, dense, bias, norm=norm, rope=rope,
                                   kv=KVWrite(caches[2], caches[3], slots), backend="triton")
    assert torch.equal(res_mx, res_d)
    _close(y_mx, y_d, ulps=1)
    _close(caches[0], caches[2], ulps=1)
    _close(caches[1], caches[3], ulps=1)
    act_mx, _ = decode_projection(x, mxw, norm=norm, silu_and_mul=True, backend="triton")
    act_d, _ = decode_projection(x, dense, norm=norm, silu_and_mul=True, backend="triton")
    _close(act_mx, act_d, ulps=2)
    cpu, _ = decode_projection(x, mxw, bias, norm=norm, rope=rope)  # the CPU default: reference
    _close(cpu, y_d, ulps=2)


@pytest.mark.parametrize("fmt", ["e2m1", "e2m3", "e3m2"])
@pytest.mark.parametrize("n, k, fold", [(24, 384, True), (24, 768, False), (7, 4096, True),
                                        (24, 96, True)])
def test_mx_pair_path_edges(fmt, n, k, fold):
    """MX rows in spread groups of 16 decode pair by pair (bf16x2, one multiply for the scale):
    K not a power of 2 (words past K masked: 384 = 3 groups of FP4, 768 = 3 of FP6), several
    scale words a row, N not a multiple of the rows a program holds, scale bytes above
    127 + bias (no fold) and byte 0, and a NaN scale. Rows without groups of 16 (K = 96, FP6 at
    384) decode element by element. Against mx_linear's reference and the dense kernel on the
    exact weight."""
    gen = torch.Generator().manual_seed(k + n)
    w = quantize_mx(torch.randn(n, k, generator=gen) * 0.05, fmt)
    if not fold:
        w.scales.copy_(torch.randint(100, 140, w.scales.shape, generator=gen, dtype=torch.uint8))
        w.scales[0, 0] = 0
        w.scales[1, :] = 150
    p = prepare_mx_weight(w)
    e = 8 if fmt == "e2m1" else 16  # elements a word group
    assert p.fold == fold and not p.nan_scales and (p.group == 16) == (k % (16 * e) == 0)
    x = torch.randn(1, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    got = gemv(x, p, bias, backend="triton")
    _close(got, mx_linear_torch(x, p, bias), ulps=1)
    dense = dequantize_mx(w, torch.float32).to(torch.bfloat16)
    assert torch.equal(dense.float(), dequantize_mx(w, torch.float32))  # exact in bf16
    _close(got, gemv(x, dense, bias, backend="triton"), ulps=1)
    w.scales[5, 1] = 255
    p = prepare_mx_weight(w)
    assert p.nan_scales
    y = gemv(x, p, bias, backend="triton")
    assert y[:, 5].isnan().all() and not y[:, :5].isnan().any() and not y[:, 6:].isnan().any()


# Compiled in a subprocess (tests/cpu run kernels in the interpreter, which also takes code the
# compiler refuses): the MX pair decode builds for sm_90, FP4 and FP6, plain and gate/up pairs.
COMPILE = r"""
from mxserve.kernels import gemv

fn = gemv._gemv_kernel
types = {"pos_ptr": "*i64", "slot_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
         "scales_ptr": "*u8", "w_ptr": "*i32"}
for e, epilogue in ((8, 0), (16, 1)):
    const = dict(BLOCK_M=1, BLOCK_N=2, BLOCK_K=2048, HAS_BIAS=False, NORM=True, ADD=True,
                 EPILOGUE=epilogue, KV=False, HEAD_DIM=2, ROT_ROWS=0, Q_ROWS=0, PAGE_SIZE=1,
                 MX=True, EBITS=2, MBITS=1 if e == 8 else 3, NAN_CODE=-1, E=e,
                 P=1 if e == 8 else 3, S=16, FOLD=True, TILE=64, NAN_SCALES=True, LAUNCH_PDL=True,
                 INTERP_BF16=False)
    kernel, _ = compile_for(fn, const, types)
    assert kernel.asm.get("cubin")
print("sass")
"""


def test_mx_pair_decode_compiles_for_the_gpu(compile_outside_interpreter):
    assert compile_outside_interpreter(COMPILE) == "sass"
