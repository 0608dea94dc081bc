"""Paged attention on a GPU at real shapes (Llama-3-8B-like: 32 query / 8 KV heads, head_dim 128,
block 16): compiled Triton against the torch references, and the two decode targets against SDPA
on the same K/V held contiguously.

The references are checked against an independent dense computation in
tests/cpu/test_paged_attention.py. Tolerance, as there: |out - ref| <= RTOL[dtype] * mag + 1e-6
with mag = p @ |v| (the reference run on |v|); attention mass within 1e-5 + 1e-4 * mass, each
request's mass summing to Hq * its query count.
"""

from __future__ import annotations

import math

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import torch.nn.functional as F  # noqa: E402
import triton.testing  # noqa: E402

from mxserve.kernels.paged_attention import (  # noqa: E402
    paged_decode_attention,
    paged_decode_attention_torch,
    paged_prefill_attention,
    paged_prefill_attention_torch,
    write_kv_cache,
    write_kv_cache_torch,
)
from mxserve.worker.attention import AttentionBatch, TorchAttention  # noqa: E402
from mxserve.worker.attention_triton import TritonAttention  # noqa: E402

DEV = "cuda"
RTOL = {torch.float32: 1e-5, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-9}
HQ, HKV, D, BS = 32, 8, 128, 16


def make_cache(seq_lens, dtype, gen, num_kv_heads=HKV, head_dim=D, block_size=BS):
    """Random caches over shuffled blocks; unowned slots hold NaN. Returns caches, int32 tables."""
    counts = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(counts) + 1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    ids = torch.randperm(num_blocks, generator=gen, device=DEV).to(torch.int32)
    tables = torch.full((len(seq_lens), max(counts)), int(ids[-1]), dtype=torch.int32, device=DEV)
    caches = [torch.full(shape, math.nan, dtype=dtype, device=DEV) for _ in range(2)]
    used = 0
    for i, (n, count) in enumerate(zip(seq_lens, counts)):
        tables[i, :count] = ids[used:used + count]
        used += count
        pos = torch.arange(n, device=DEV)
        blocks = tables[i, pos // block_size].long()
        for cache in caches:
            cache[blocks, pos % block_size] = torch.randn(n, num_kv_heads, head_dim, generator=gen,
                                                          device=DEV).to(dtype)
    return caches[0], caches[1], tables


def check(out, ref, mag, dtype):
    assert out.dtype == dtype and not out.isnan().any()
    err = (out.float() - ref.float()).abs()
    assert (err <= RTOL[dtype] * mag.float() + 1e-6).all(), f"max err {err.max():.3g}"


def check_mass(mass, ref, num_queries):
    torch.testing.assert_close(mass, ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(mass.sum(1).double(), num_queries.double(), atol=0, rtol=1e-4)


@pytest.mark.parametrize("num_splits", [None, 1, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_decode_at_scale(dtype, num_splits):
    gen = torch.Generator(device=DEV).manual_seed(0)
    seq_lens = [1, 17, 300, 1000, 4096, 2049, 4000, 77]
    k_cache, v_cache, tables = make_cache(seq_lens, dtype, gen)
    q = torch.randn(len(seq_lens), HQ, D, generator=gen, device=DEV).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    out = torch.full_like(q, math.nan)
    got, mass = paged_decode_attention(q, k_cache, v_cache, tables, lens, num_splits=num_splits,
                                       return_attn_mass=True, out=out)
    ref, ref_mass = paged_decode_attention_torch(q, k_cache, v_cache, tables, lens,
                                                 return_attn_mass=True)
    mag = paged_decode_attention_torch(q, k_cache, v_cache.abs(), tables, lens)
    check(got, ref, mag, dtype)
    check_mass(mass, ref_mass, torch.full((len(seq_lens),), HQ, device=DEV))
    assert paged_decode_attention(q, k_cache, v_cache, tables, lens,
                                  num_splits=num_splits).equal(got)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_prefill_at_scale(dtype):
    gen = torch.Generator(device=DEV).manual_seed(1)
    chunks = [(0, 1000), (3000, 512), (100, 17), (4095, 1), (7, 300)]  # (context, new queries)
    seq_lens = [c + n for c, n in chunks]
    k_cache, v_cache, tables = make_cache(seq_lens, dtype, gen)
    query_lens = torch.tensor([n for _, n in chunks], device=DEV)
    qsl = torch.cat([query_lens.new_zeros(1), query_lens.cumsum(0)]).to(torch.int32)
    ctx = torch.tensor([c for c, _ in chunks], dtype=torch.int32, device=DEV)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    q = torch.randn(int(qsl[-1]), HQ, D, generator=gen, device=DEV).to(dtype)
    args = (tables, qsl, lens, ctx)
    out = torch.full_like(q, math.nan)
    got, mass = paged_prefill_attention(q, k_cache, v_cache, *args, return_attn_mass=True,
                                        out=out, max_query_len=1000)
    ref, ref_mass = paged_prefill_attention_torch(q, k_cache, v_cache, *args,
                                                  return_attn_mass=True)
    mag = paged_prefill_attention_torch(q, k_cache, v_cache.abs(), *args)
    check(got, ref, mag, dtype)
    check_mass(mass, ref_mass, query_lens * HQ)


@pytest.mark.parametrize("fold", [True, False], ids=["folded", "second_pass"])
@pytest.mark.parametrize("num_splits", [None, 1, 8])
def test_decode_mass_adds_into_a_buffer_both_ways(num_splits, fold):
    """The decode mass, folded into the attention kernel (the public path) and by the second
    pass over K (kept for prefill windows; bench/h2o_gpu.py times the two), added into a
    buffer holding earlier sums: the reference's mass plus what was there; a padding row (seq_len
    0) and the columns past max_seq_len untouched."""
    from mxserve.kernels.paged_attention import _decode_splits, _launch

    gen = torch.Generator(device=DEV).manual_seed(7)
    seq_lens = [4096, 0, 1, 2049, 300, 4000]
    k_cache, v_cache, tables = make_cache([max(n, 1) for n in seq_lens], torch.bfloat16, gen)
    q = torch.randn(len(seq_lens), HQ, D, generator=gen, device=DEV).bfloat16()
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    width = 4100
    before = torch.rand(len(seq_lens), width + 5, generator=gen, device=DEV)
    mass = before.clone()
    out = torch.full_like(q, math.nan)
    splits = num_splits or _decode_splits(len(seq_lens), HKV, width, q.device)
    _launch(q, k_cache, v_cache, (tables, lens, lens, lens), out, D ** -0.5, width,
            is_decode=True, num_splits=splits, max_query_len=1, mass=mass, fold_mass=fold)
    ref, ref_mass = paged_decode_attention_torch(q, k_cache, v_cache, tables, lens,
                                                 return_attn_mass=True, max_seq_len=width)
    check(out, ref, paged_decode_attention_torch(q, k_cache, v_cache.abs(), tables, lens),
          torch.bfloat16)
    check_mass(mass[:, :width] - before[:, :width], ref_mass,
               torch.tensor([HQ if n else 0 for n in seq_lens], device=DEV))
    assert mass[1].equal(before[1]) and mass[:, width:].equal(before[:, width:])


def test_decode_mass_in_a_cuda_graph():
    """Captured once over static buffers (zeroed inside the graph, as DecodeGraphs does), then
    replayed with other queries, lengths and tables: each replay gives that input's mass."""
    gen = torch.Generator(device=DEV).manual_seed(8)
    k_cache, v_cache, tables = make_cache([3000, 1500, 4096, 20], torch.bfloat16, gen)
    q = torch.zeros(4, HQ, D, device=DEV, dtype=torch.bfloat16)
    lens = torch.zeros(4, dtype=torch.int32, device=DEV)
    table = torch.zeros_like(tables)
    mass = torch.full((4, 4096), math.nan, device=DEV)
    out = torch.empty_like(q)

    def step():
        mass.zero_()
        paged_decode_attention(q, k_cache, v_cache, table, lens, out=out, return_attn_mass=True,
                               mass=mass, max_seq_len=4096)

    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        step()
    for order, new_lens in (([0, 1, 2, 3], [3000, 1500, 4096, 20]),
                            ([2, 3, 0, 1], [777, 20, 1, 0])):
        q.copy_(torch.randn(4, HQ, D, generator=gen, device=DEV))
        table.copy_(tables[order])
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        graph.replay()
        ref, ref_mass = paged_decode_attention_torch(q, k_cache, v_cache, table, lens,
                                                     return_attn_mass=True, max_seq_len=4096)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
        check_mass(mass, ref_mass, torch.tensor([HQ if n else 0 for n in new_lens], device=DEV))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_write_kv_cache_bit_exact(dtype):
    gen = torch.Generator(device=DEV).manual_seed(2)
    caches = [torch.randn(64, BS, HKV, D, generator=gen, device=DEV).to(dtype) for _ in range(2)]
    kv = torch.randn(300, 2 * HKV, D, generator=gen, device=DEV).to(dtype)
    k, v = kv[:, :HKV], kv[:, HKV:]
    slots = torch.randperm(64 * BS, generator=gen, device=DEV)[:300]
    slots[::7] = -1
    want = [c.clone() for c in caches]
    write_kv_cache_torch(k, v, *want, slots)
    write_kv_cache(k, v, *caches, slots)
    assert all(torch.equal(a, b) for a, b in zip(caches, want))


def test_triton_backend_matches_torch_backend():
    gen = torch.Generator(device=DEV).manual_seed(3)
    query_lens, starts = [1] * 6 + [200, 37], [5, 900, 31, 0, 2047, 64, 0, 600]
    ids = torch.randperm(400, generator=gen, device=DEV).tolist()
    tables = []
    for n, s in zip(query_lens, starts):
        count = math.ceil((n + s) / BS)
        tables.append(ids[:count])
        ids = ids[count:]
    batch = AttentionBatch(query_lens=query_lens, start_positions=starts, block_tables=tables,
                           num_decodes=6, block_size=BS, device=torch.device(DEV))
    caches = [torch.randn(400, BS, HKV, D, generator=gen, device=DEV).bfloat16() for _ in range(2)]
    qkv = torch.randn(sum(query_lens), HQ + 2 * HKV, D, generator=gen, device=DEV).bfloat16()
    q, k, v = qkv.split([HQ, HKV, HKV], dim=1)
    results = []
    for backend in (TorchAttention(), TritonAttention()):
        k_cache, v_cache = (c.clone() for c in caches)
        meta = backend.build_metadata(batch)
        backend.write_kv(k, v, k_cache, v_cache, meta)
        results.append((backend.forward(q, k_cache, v_cache, meta), k_cache, v_cache))
    (want, *want_caches), (got, *got_caches) = results
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    assert all(torch.equal(a, b) for a, b in zip(got_caches, want_caches))


# ---------------------------------------------------------------- the speed targets

def bench_decode(batch: int, seq_len: int) -> tuple[float, float]:
    """(paged Triton ms, SDPA ms) for bf16 decode; SDPA gets the same K/V contiguous."""
    gen = torch.Generator(device=DEV).manual_seed(4)
    k_cache, v_cache, tables = make_cache([seq_len] * batch, torch.bfloat16, gen)
    lens = torch.full((batch,), seq_len, dtype=torch.int32, device=DEV)
    q = torch.randn(batch, HQ, D, generator=gen, device=DEV).bfloat16()
    pos = torch.arange(seq_len, device=DEV)
    slots = tables[:, pos // BS].long(), pos % BS  # [B, L] blocks, offsets
    k4 = k_cache[slots].transpose(1, 2).contiguous()  # [B, Hkv, L, D]
    v4 = v_cache[slots].transpose(1, 2).contiguous()
    out = torch.empty_like(q)
    t_paged = triton.testing.do_bench_cudagraph(
        lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens, out=out,
                                       max_seq_len=seq_len))
    times = []  # SDPA with GQA, and with the KV heads expanded: the faster is the baseline
    expanded = k4.repeat_interleave(HQ // HKV, 1), v4.repeat_interleave(HQ // HKV, 1)
    for (ks, vs), kw in (((k4, v4), dict(enable_gqa=True)), (expanded, {})):
        try:
            times.append(triton.testing.do_bench_cudagraph(
                lambda ks=ks, vs=vs, kw=kw: F.scaled_dot_product_attention(q[:, :, None], ks, vs,
                                                                          **kw)))
        except RuntimeError as e:  # a torch without that path
            print(f"SDPA {sorted(kw)} unavailable: {e}")
    t_sdpa = min(times)
    ref = F.scaled_dot_product_attention(q[:, :, None].float(), k4.float(), v4.float(),
                                         enable_gqa=True)[:, :, 0]
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    gbs = 2 * k4.numel() * 2 / 1e6  # K and V bytes / 1e9, per ms
    print(f"B={batch} L={seq_len}: paged {t_paged * 1e3:.1f} us ({gbs / t_paged:.0f} GB/s), "
          f"SDPA {t_sdpa * 1e3:.1f} us ({gbs / t_sdpa:.0f} GB/s)")
    return t_paged, t_sdpa


def test_decode_batch64_4096_reaches_90pct_of_sdpa_bandwidth():
    t_paged, t_sdpa = bench_decode(64, 4096)
    assert t_sdpa / t_paged >= 0.9  # same bytes read: bandwidth ratio = time ratio


def test_decode_batch1_32768_split_k_1_5x_faster_than_sdpa():
    t_paged, t_sdpa = bench_decode(1, 32768)
    assert t_sdpa / t_paged >= 1.5
