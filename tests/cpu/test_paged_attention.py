"""Paged attention (kernels/paged_attention.py) under the Triton interpreter: the kernels against
their torch references, the references against an independent dense float64 computation on the
per-request contiguous K/V the caches were filled from, and the Triton attention backend
(worker/attention_triton.py) against the torch one.

Caches are filled through shuffled, non-contiguous blocks; every slot no request owns (block tails,
a spare block the table padding points at) holds NaN, and outputs are poisoned with NaN, so a read
past a context or a missed write shows.

Tolerances (the documented contract), with p the exact probabilities and mag = p @ |v|:
  out: |out - want| <= RTOL[dtype] * mag + 1e-6 for kernel vs reference and reference vs dense;
       fp32: summation order; 16-bit: p rounded to the cache dtype before p @ v (as on the GPU)
       plus one rounding of each output, <= 3 half-ulps of mag.
  mass: |mass - want| <= 1e-5 + 1e-4 * want; each request's mass sums to Hq * its query count.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import json  # noqa: E402
import math  # noqa: E402
import zlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from mxserve.kernels import paged_attention  # noqa: E402
from mxserve.kernels.paged_attention import (  # noqa: E402
    paged_decode_attention,
    paged_decode_attention_torch,
    paged_prefill_attention,
    paged_prefill_attention_torch,
    write_kv_cache,
    write_kv_cache_torch,
)
from mxserve.worker.attention import (  # noqa: E402
    AttentionBatch,
    CPUAttention,
    TorchAttention,
    group_by_length,
)
from mxserve.worker.attention_backends import get_attention_backend  # noqa: E402
from mxserve.worker.attention_triton import TritonAttention  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
RTOL = {torch.float32: 1e-5, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-9}
# (Hq, Hkv, head_dim, block_size): GQA ratios 1, 2, 4; both head dims and block sizes
SHAPES = [(2, 2, 32, 4), (4, 2, 16, 16), (8, 2, 32, 16), (8, 2, 16, 4)]


def seeded(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def make_paged(seq_lens, num_kv_heads, head_dim, block_size, dtype, gen):
    """Per-request contiguous K/V [L, Hkv, D] scattered block by block into shuffled cache blocks.
    Returns (k_cache, v_cache, block_tables int32, [(k, v) per request])."""
    counts = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(counts) + 3
    ids = torch.randperm(num_blocks, generator=gen)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [torch.full(shape, math.nan, dtype=dtype) for _ in range(2)]
    tables = torch.full((len(seq_lens), max(counts) + 1), int(ids[-1]), dtype=torch.int32)
    truth, used = [], 0
    for i, (n, count) in enumerate(zip(seq_lens, counts)):
        kv = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2)]
        blocks = ids[used:used + count]
        used += count
        tables[i, :count] = blocks
        for cache, t in zip(caches, kv):
            padded = torch.full((count * block_size, num_kv_heads, head_dim), math.nan, dtype=dtype)
            padded[:n] = t
            cache[blocks] = padded.view(count, block_size, num_kv_heads, head_dim)
        truth.append(kv)
    return caches[0], caches[1], tables, truth


def dense(q, k, v, q_pos):
    """float64 attention of q [n, Hq, D] at positions q_pos over k, v [L, Hkv, D]: out, p, mag."""
    num_heads, length = q.shape[1], k.shape[0]
    head_map = torch.arange(num_heads) // (num_heads // k.shape[1])
    kh, vh = k.double()[:, head_map], v.double()[:, head_map]  # [L, Hq, D]
    s = (q.double()[:, :, None, :] * kh.transpose(0, 1)[None]).sum(-1) / math.sqrt(q.shape[-1])
    s[torch.arange(length)[None, None, :].expand_as(s) > q_pos[:, None, None]] = -math.inf
    e = torch.exp(s - s.max(-1, keepdim=True).values)
    p = e / e.sum(-1, keepdim=True)  # [n, Hq, L]
    out = (p[..., None] * vh.transpose(0, 1)[None]).sum(2)
    mag = (p[..., None] * vh.abs().transpose(0, 1)[None]).sum(2)
    return out, p, mag


def check_out(out, ref, want, mag, dtype):
    assert out.dtype == dtype and not out.isnan().any()
    tol = RTOL[dtype] * mag + 1e-6
    assert ((ref.double() - want).abs() <= tol).all(), "reference vs dense"
    err = (out.double() - ref.double()).abs()
    assert (err <= tol).all(), f"kernel vs reference: max err {err.max():.3g}"


def check_mass(mass, ref, want, num_queries):
    torch.testing.assert_close(ref.double(), want, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(mass.double(), ref.double(), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(mass.sum(1).double(), num_queries.double(), atol=0, rtol=1e-4)


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode(dtype, num_heads, num_kv_heads, head_dim, block_size, num_splits):
    gen = seeded("decode", dtype, num_heads, num_kv_heads, head_dim, block_size, num_splits)
    seq_lens = [1, 7, 29, 45]
    k_cache, v_cache, tables, truth = make_paged(seq_lens, num_kv_heads, head_dim, block_size,
                                                 dtype, gen)
    q = (2 * torch.randn(len(seq_lens), num_heads, head_dim, generator=gen)).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = torch.full_like(q, math.nan)
    got, mass = paged_decode_attention(q, k_cache, v_cache, tables, lens, num_splits=num_splits,
                                       return_attn_mass=True, out=out, backend="triton")
    assert got.data_ptr() == out.data_ptr() and mass.shape == (4, tables.shape[1] * block_size)
    ref, ref_mass = paged_decode_attention_torch(q, k_cache, v_cache, tables, lens,
                                                 return_attn_mass=True)
    want_mass = torch.zeros_like(ref_mass, dtype=torch.float64)
    for i, (n, (k, v)) in enumerate(zip(seq_lens, truth)):
        want, p, mag = dense(q[i:i + 1], k, v, torch.tensor([n - 1]))
        check_out(got[i:i + 1], ref[i:i + 1], want, mag, dtype)
        want_mass[i, :n] = p.sum((0, 1))
    check_mass(mass, ref_mass, want_mass, torch.full((4,), num_heads))
    assert paged_decode_attention(q, k_cache, v_cache, tables, lens, num_splits=num_splits,
                                  backend="triton").equal(got)  # without the mass: same output


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_mass_from_half_precision_scores(dtype, num_splits, monkeypatch):
    """The folded mass with its stored p in float16 (paged_attention.SCORES_DTYPE): each term
    within fp16's rounding (2^-11 relative, subnormals ~3e-8 absolute) of the float32 path's,
    the output untouched; splits exercise the tile maxima of several splits."""
    gen = seeded("half_scores", dtype, num_splits)
    seq_lens, heads, kv_heads, dim, bs = [3, 70, 129, 200], 8, 2, 32, 16
    k_cache, v_cache, tables, _ = make_paged(seq_lens, kv_heads, dim, bs, dtype, gen)
    q = (3 * torch.randn(len(seq_lens), heads, dim, generator=gen)).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)

    def run(scores_dtype):
        monkeypatch.setattr(paged_attention, "SCORES_DTYPE", scores_dtype)
        return paged_decode_attention(q, k_cache, v_cache, tables, lens, num_splits=num_splits,
                                      return_attn_mass=True, backend="triton")

    (out32, mass32), (out16, mass16) = run(torch.float32), run(torch.float16)
    assert out16.equal(out32)
    assert not mass16.equal(mass32)  # the half path was taken
    torch.testing.assert_close(mass16, mass32, rtol=2.0**-10, atol=heads * 6e-8)
    torch.testing.assert_close(mass16.sum(1), lens.new_full((4,), heads).float(), rtol=1e-3,
                               atol=0)


EVICT_COMPILE = r"""
from mxserve.kernels import paged_attention as pa

fn, out = pa._paged_attention_kernel, {}
for splits in (1, 4):  # the 1B shape's decode tile, folded mass
    const = dict(GROUP=4, HEAD_DIM=64, PAGE_SIZE=16, NUM_SPLITS=splits, IS_DECODE=True, BLOCK_Q=1,
                 BLOCK_G=4, BLOCK_M=16, BLOCK_N=64, BLOCK_D=64, STORE_LSE=True, STORE_SCORES=True,
                 INTERP_BF16=False)
    types = {"bt_ptr": "*i32", "qsl_ptr": "*i32", "ctx_lens_ptr": "*i32", "seq_lens_ptr": "*i32",
             "lse_ptr": "*fp32", "scores_ptr": "*fp32", "tile_max_ptr": "*fp32"}
    kernel, _ = compile_for(fn, const, types)
    out[f"attention_{splits}"] = "evict_last" in kernel.asm["ptx"]
for evict in ("evict_first", ""):
    const = dict(NUM_HEADS=32, TILE_N=64, BLOCK_H=8, BLOCK_P=512, TRIGGER=False, EVICT=evict)
    kernel, _ = compile_for(pa._decode_mass_kernel, const, pointer="*fp32",
                            types={"seq_lens_ptr": "*i32"})
    out[f"mass_{evict or 'none'}"] = "evict_first" in kernel.asm["ptx"]
print(json.dumps(out))
"""


def test_unsplit_decode_keeps_p_in_l2_for_the_mass_kernel(compile_outside_interpreter):
    """sm_90: an unsplit decode stores p evict_last and the mass kernel reads it evict_first
    (bench/results/h2o_l2_probe.md); split decode (p small, in L2 anyway) carries no hint."""
    got = json.loads(compile_outside_interpreter(EVICT_COMPILE))
    assert got == {"attention_1": True, "attention_4": False, "mass_evict_first": True,
                   "mass_none": False}


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill(dtype, num_heads, num_kv_heads, head_dim, block_size):
    gen = seeded("prefill", dtype, num_heads, num_kv_heads, head_dim, block_size)
    chunks = [(0, 5), (9, 1), (13, 20), (3, 17)]  # (cached context, new queries) per request
    seq_lens = [c + n for c, n in chunks]
    k_cache, v_cache, tables, truth = make_paged(seq_lens, num_kv_heads, head_dim, block_size,
                                                 dtype, gen)
    query_lens = torch.tensor([n for _, n in chunks])
    qsl = torch.cat([torch.zeros(1), query_lens.cumsum(0)]).to(torch.int32)
    ctx = torch.tensor([c for c, _ in chunks], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q = (2 * torch.randn(int(qsl[-1]), num_heads, head_dim, generator=gen)).to(dtype)
    out = torch.full_like(q, math.nan)
    got, mass = paged_prefill_attention(q, k_cache, v_cache, tables, qsl, lens, ctx,
                                        return_attn_mass=True, out=out, max_query_len=20,
                                        backend="triton")
    ref, ref_mass = paged_prefill_attention_torch(q, k_cache, v_cache, tables, qsl, lens, ctx,
                                                  return_attn_mass=True)
    want_mass = torch.zeros_like(ref_mass, dtype=torch.float64)
    for i, ((c, n), (k, v)) in enumerate(zip(chunks, truth)):
        a, b = int(qsl[i]), int(qsl[i + 1])
        want, p, mag = dense(q[a:b], k, v, c + torch.arange(n))
        check_out(got[a:b], ref[a:b], want, mag, dtype)
        want_mass[i, :c + n] = p.sum((0, 1))
    check_mass(mass, ref_mass, want_mass, query_lens * num_heads)
    assert paged_prefill_attention(q, k_cache, v_cache, tables, qsl, lens, ctx,
                                   backend="triton").equal(got)  # default max_query_len: total
    # the context split over programs (a verify graph's launch), merged as decode's
    split = paged_prefill_attention(q, k_cache, v_cache, tables, qsl, lens, ctx, num_splits=3,
                                    max_query_len=20, backend="triton")
    for i, ((c, n), (k, v)) in enumerate(zip(chunks, truth)):
        a, b = int(qsl[i]), int(qsl[i + 1])
        want, p, mag = dense(q[a:b], k, v, c + torch.arange(n))
        check_out(split[a:b], ref[a:b], want, mag, dtype)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_prefill_fixed_query_runs_with_padding_rows(num_splits):
    """A verify graph's layout: every request q query rows (query_start_loc = q * i), a request
    with fewer real queries padded past its seq_len, padding requests with seq_len 0. Real
    queries match the reference; padding requests give zeros, never NaN."""
    gen = seeded("verify-layout", num_splits)
    num_heads, num_kv_heads, head_dim, block_size, q_len = 4, 2, 16, 4, 4
    real = [(9, 4), (20, 2), (0, 0), (0, 0)]  # (cached context, real queries); 0, 0: padding
    seq_lens = [c + n for c, n in real]
    k_cache, v_cache, tables, truth = make_paged([max(n, 1) for n in seq_lens], num_kv_heads,
                                                 head_dim, block_size, torch.float32, gen)
    qsl = torch.arange(len(real) + 1, dtype=torch.int32) * q_len
    ctx = torch.tensor([c for c, _ in real], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn(len(real) * q_len, num_heads, head_dim, generator=gen)
    got = paged_prefill_attention(q, k_cache, v_cache, tables, qsl, lens, ctx,
                                  num_splits=num_splits, max_query_len=q_len, max_seq_len=32,
                                  backend="triton")
    assert not got.isnan().any()
    for i, ((c, n), (k, v)) in enumerate(zip(real, truth)):
        rows = got[i * q_len:i * q_len + n]
        if n:
            want, p, mag = dense(q[i * q_len:i * q_len + n], k, v, c + torch.arange(n))
            assert (rows.double() - want).abs().le(RTOL[torch.float32] * mag + 1e-6).all()
        else:
            assert got[i * q_len:(i + 1) * q_len].eq(0).all()


@pytest.mark.parametrize("num_splits", [1, 3])
def test_mass_adds_into_the_callers_buffer(num_splits):
    """mass=buf: decode (scores stored by the attention kernel, normalised after the split
    merge) and prefill (second pass) add their mass into buf[:, :max_seq_len], a strided
    slice of a wider buffer holding earlier sums, and leave every other element as it was;
    a padding request (seq_len 0) adds nothing."""
    gen = seeded("accumulate", num_splits)
    seq_lens = [37, 0, 12, 50]
    k_cache, v_cache, tables, _ = make_paged([max(n, 1) for n in seq_lens], 2, 16, 8,
                                             torch.float32, gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn(4, 8, 16, generator=gen)
    width = 56
    wide = torch.rand(4, width + 9, generator=gen)
    before = wide.clone()
    buf = wide[:, 3:]  # row stride width + 9, columns 3 .. width + 8
    _, got = paged_decode_attention(q, k_cache, v_cache, tables, lens, num_splits=num_splits,
                                    return_attn_mass=True, mass=buf, max_seq_len=width,
                                    backend="triton")
    assert got.data_ptr() == buf.data_ptr()
    _, ref = paged_decode_attention_torch(q, k_cache, v_cache, tables, lens,
                                          return_attn_mass=True, max_seq_len=width)
    want = before.clone()
    want[:, 3:3 + width] += ref
    torch.testing.assert_close(wide, want, atol=1e-5, rtol=1e-4)
    assert wide[1].equal(before[1]) and wide[:, :3].equal(before[:, :3])
    assert wide[:, 3 + width:].equal(before[:, 3 + width:])
    qsl = torch.tensor([0, 3, 3, 5, 9], dtype=torch.int32)  # 3, 0, 2, 4 queries
    ctx = (lens - torch.tensor([3, 0, 2, 4])).to(torch.int32)
    qp = torch.randn(9, 8, 16, generator=gen)
    before = wide.clone()
    paged_prefill_attention(qp, k_cache, v_cache, tables, qsl, lens, ctx, return_attn_mass=True,
                            mass=buf, max_seq_len=width, max_query_len=4, backend="triton")
    _, ref = paged_prefill_attention_torch(qp, k_cache, v_cache, tables, qsl, lens, ctx,
                                           return_attn_mass=True, max_seq_len=width)
    want = before.clone()
    want[:, 3:3 + width] += ref
    torch.testing.assert_close(wide, want, atol=1e-5, rtol=1e-4)
    assert wide[:, 3 + width:].equal(before[:, 3 + width:])
    with pytest.raises(ValueError, match="mass"):
        paged_decode_attention(q, k_cache, v_cache, tables, lens, mass=buf, backend="triton")


@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_empty_context_gives_zeros(num_splits):
    """seq_len 0 (e.g. padding rows of a captured batch): zeros, never NaN."""
    k_cache, v_cache, tables, _ = make_paged([5, 3], 2, 16, 4, torch.float32, seeded("empty"))
    q, lens = torch.randn(2, 4, 16), torch.tensor([5, 0], dtype=torch.int32)
    for backend in ("triton", "torch"):
        out, mass = paged_decode_attention(q, k_cache, v_cache, tables, lens, backend=backend,
                                           num_splits=num_splits, return_attn_mass=True)
        assert not out[0].isnan().any() and (out[1] == 0).all() and (mass[1] == 0).all()


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_cache_bit_exact(dtype, slot_dtype):
    gen = seeded("write", dtype, slot_dtype)
    caches = [torch.randn(6, 4, 2, 32, generator=gen).to(dtype) for _ in range(2)]
    kv = torch.randn(5, 2 + 2 + 4, 32, generator=gen).to(dtype)  # a fused [T, k|v|q, D] buffer
    k, v = kv[:, :2], kv[:, 2:4]  # non-contiguous views, as the model hands them over
    slots = torch.tensor([3, -1, 17, 23, 0], dtype=slot_dtype)  # -1: a padding token
    want = [c.clone() for c in caches]
    write_kv_cache_torch(k, v, *want, slots)
    write_kv_cache(k, v, *caches, slots, backend="triton")
    assert all(torch.equal(a, b) for a, b in zip(caches, want))
    assert torch.equal(want[0][5, 3], k[3]) and torch.equal(want[1][0, 0], v[4])


def attention_batch(gen, block_size=4, num_blocks=48, consecutive=False):
    # three decodes, then chunks: CPUAttention runs those marked as query rows (verifies) in the
    # decode kernel, SDPA the 20 between them
    query_lens, starts = [1, 1, 1, 6, 20, 3], [6, 17, 0, 0, 5, 11]
    ids = (list(range(num_blocks)) if consecutive
           else torch.randperm(num_blocks, generator=gen).tolist())
    tables = []
    for n, s in zip(query_lens, starts):
        count = math.ceil((n + s) / block_size)
        tables.append(ids[:count])
        ids = ids[count:]
    return AttentionBatch(query_lens=query_lens, start_positions=starts, block_tables=tables,
                          num_decodes=3, block_size=block_size, device=torch.device("cpu"),
                          query_rows=[False, False, False, True, False, True])


def test_decodes_are_grouped_by_length_where_padding_costs_more_than_a_call():
    assert group_by_length([7, 500, 9, 480, 8], group_cost=100) == [[0, 4, 2], [3, 1]]
    assert group_by_length([7, 500, 9, 480, 8], group_cost=10**6) == [[0, 4, 2, 3, 1]]
    assert group_by_length([5, 5, 300], group_cost=0) == [[0, 1], [2]]
    assert group_by_length([], group_cost=0) == []


# group_cost: default (one group here) or 0 (one group per length); consecutive block ids let a
# one-request group read its context as a view of the cache instead of a gather
@pytest.mark.parametrize("group_cost, consecutive", [(None, False), (0, False), (0, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_and_cpu_backends_match_torch_backend(dtype, group_cost, consecutive):
    torch_backend = TorchAttention() if group_cost is None else TorchAttention(group_cost)
    gen = seeded("backend", dtype)
    batch = attention_batch(gen, consecutive=consecutive)
    groups = torch_backend.build_metadata(batch).decode_groups
    if consecutive:  # (random ids may happen to be consecutive too)
        assert any(g.first_block is not None and g.blocks.shape[1] > 1 for g in groups)
    num_heads, num_kv_heads, head_dim, tokens = 4, 2, 16, sum(batch.query_lens)
    caches = [torch.randn(48, 4, num_kv_heads, head_dim, generator=gen).to(dtype)
              for _ in range(2)]
    qkv = torch.randn(tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
    q, k, v = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)  # strided views
    results = []
    backends = [torch_backend, get_attention_backend("triton"), get_attention_backend("cpu")]
    for backend in backends:
        k_cache, v_cache = (c.clone() for c in caches)
        meta = backend.build_metadata(batch)
        backend.write_kv(k, v, k_cache, v_cache, meta)
        out = backend.forward(q, k_cache, v_cache, meta)
        results.append((out, k_cache, v_cache))
    (want, *want_caches), *others = results
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for got, *got_caches in others:  # Triton, then the C decode kernel (CPUAttention)
        assert got.shape == (tokens, num_heads * head_dim) and got.dtype == dtype
        torch.testing.assert_close(got, want, **tol)
        assert all(torch.equal(a, b) for a, b in zip(got_caches, want_caches))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backend_gives_a_short_chunk_the_bits_of_one_decode_at_a_time(dtype):
    # A speculative verify (k + 1 queries) must compute what k + 1 decode steps would, bit for
    # bit, or greedy outputs with speculation drift from those without in bf16
    gen = seeded("verify rows", dtype)
    backend, block_size, start, qlen = get_attention_backend("cpu"), 4, 13, 4
    table = torch.randperm(12, generator=gen).tolist()[:5]
    k_cache, v_cache = (torch.randn(12, block_size, 3, 64, generator=gen).to(dtype)
                        for _ in range(2))
    q = torch.randn(qlen, 9, 64, generator=gen).to(dtype)
    chunk = AttentionBatch(query_lens=[qlen], start_positions=[start], block_tables=[table],
                           num_decodes=0, block_size=block_size, device=torch.device("cpu"),
                           query_rows=[True])
    together = backend.forward(q, k_cache, v_cache, backend.build_metadata(chunk))
    for i in range(qlen):
        one = AttentionBatch(query_lens=[1], start_positions=[start + i], block_tables=[table],
                             num_decodes=1, block_size=block_size, device=torch.device("cpu"))
        alone = backend.forward(q[i:i + 1], k_cache, v_cache, backend.build_metadata(one))
        assert torch.equal(together[i], alone[0])


def test_backends_by_name():
    assert type(get_attention_backend("triton")) is TritonAttention
    assert type(get_attention_backend("cpu")) is CPUAttention
    assert type(get_attention_backend("torch")) is TorchAttention
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        get_attention_backend("flash")


def test_rejects_bad_inputs():
    k_cache, v_cache, tables, _ = make_paged([5, 9], 2, 16, 4, torch.float32, seeded("bad"))
    q, lens = torch.randn(2, 4, 16), torch.tensor([5, 9], dtype=torch.int32)
    bad = [
        (dict(q=q.half()), "dtype"),
        (dict(q=torch.randn(2, 3, 16)), "multiple of Hkv"),
        (dict(q=torch.randn(2, 4, 32)), "head_dim"),
        (dict(block_tables=tables.long()), "block_tables must be int32"),
        (dict(seq_lens=lens[:1]), "seq_lens must be int32"),
        (dict(v_cache=v_cache[:, :2]), "one shape"),
        (dict(q=torch.randn(2, 16, 4).transpose(1, 2)), "contiguous along head_dim"),
        (dict(out=torch.empty(2, 4, 16, dtype=torch.float16)), "out must be"),
        (dict(num_splits=0), "num_splits"),
    ]
    args = dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=tables, seq_lens=lens)
    for backend in ("triton", "torch"):
        for change, match in bad:
            with pytest.raises(ValueError, match=match):
                paged_decode_attention(**{**args, **change}, backend=backend)
    qsl = torch.tensor([0, 2, 4])
    with pytest.raises(ValueError, match="query_start_loc must be int32"):
        paged_prefill_attention(torch.randn(4, 4, 16), k_cache, v_cache, tables, qsl, lens,
                                lens - 2, backend="triton")
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv_cache(torch.randn(2, 2, 16), torch.randn(2, 2, 16), k_cache, v_cache,
                       torch.tensor([1.0, 2.0]), backend="triton")
