"""The C paged decode kernel (kernels/cpu_attention.py) against its torch reference and an
independent float64 computation, with the fixtures and tolerances of test_paged_attention.py:
caches filled through shuffled blocks with NaN in every slot no request owns, outputs poisoned
with NaN. Then its build fallbacks and the runner's choice of backend."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from test_paged_attention import SHAPES, check_out, dense, make_paged, seeded

from mxserve.kernels import cpu_attention, cpu_build
from mxserve.kernels.cpu_attention import available, paged_decode_attention_cpu
from mxserve.kernels.paged_attention import paged_decode_attention_torch

DTYPES = [torch.float32, torch.bfloat16]


def _check_decode(q, k_cache, v_cache, tables, seq_lens, truth, dtype, out=None):
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    got = paged_decode_attention_cpu(q, k_cache, v_cache, tables, lens, out=out)
    ref = paged_decode_attention_torch(q, k_cache, v_cache, tables, lens)
    for i, (n, (k, v)) in enumerate(zip(seq_lens, truth)):
        if n == 0:
            assert (got[i] == 0).all()
            continue
        want, _, mag = dense(q[i:i + 1], k, v, torch.tensor([n - 1]))
        check_out(got[i:i + 1], ref[i:i + 1], want, mag, dtype)
    return got


# 7 requests: whole requests per task (>= 2 per thread); 1 request: one task per KV head
@pytest.mark.parametrize("seq_lens", [[0, 1, 7, 16, 29, 45, 130], [77]])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_matches_reference(dtype, num_heads, num_kv_heads, head_dim, block_size,
                                  seq_lens):
    gen = seeded("cpu decode", dtype, num_heads, num_kv_heads, head_dim, block_size, seq_lens)
    k_cache, v_cache, tables, truth = make_paged(seq_lens, num_kv_heads, head_dim, block_size,
                                                 dtype, gen)
    q = (2 * torch.randn(len(seq_lens), num_heads, head_dim, generator=gen)).to(dtype)
    out = torch.full_like(q, math.nan)
    got = _check_decode(q, k_cache, v_cache, tables, seq_lens, truth, dtype, out=out)
    assert got.data_ptr() == out.data_ptr()


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_reads_strided_views(dtype):
    """As the model hands them over: q a view of a fused qkv buffer, out rows of a wider one."""
    gen = seeded("cpu strided", dtype)
    seq_lens, num_heads, num_kv_heads, head_dim = [3, 40, 17, 64], 8, 2, 32
    k_cache, v_cache, tables, truth = make_paged(seq_lens, num_kv_heads, head_dim, 16, dtype, gen)
    qkv = torch.randn(4, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
    q = qkv[:, :num_heads]
    wide = torch.full((6, num_heads, head_dim), math.nan, dtype=dtype)
    _check_decode(q, k_cache, v_cache, tables, seq_lens, truth, dtype, out=wide[1:5])
    assert wide[0].isnan().all() and wide[5].isnan().all()  # nothing written outside out


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_tree_rows_read_moved_positions_with_a_decodes_bits(dtype, num_heads, num_kv_heads,
                                                            head_dim, block_size):
    """A draft tree's row reads its last positions from slots outside its table (its ancestors'
    KV, wherever the tree put them): the very bits a decode gets with those KV in its table."""
    gen = seeded("cpu tree", dtype, num_heads, num_kv_heads, head_dim, block_size)
    seq_lens = [45, 19, 96]  # the third request's blocks hold the moved positions
    k_cache, v_cache, tables, _ = make_paged(seq_lens, num_kv_heads, head_dim, block_size, dtype,
                                             gen)
    spare = [b for b in range(k_cache.shape[0]) if b not in set(tables[:2].flatten().tolist())]
    free = [b * block_size + o for b in spare for o in range(block_size)]
    free = [free[i] for i in torch.randperm(len(free), generator=gen)]
    # rows: (request, seq_len, base_len): extras within a block, across blocks, none, all
    rows = [(0, 45, 41), (0, 45, 38), (0, 33, 30), (1, 19, 19), (1, 19, 15), (0, 3, 0)]
    width = max(n - b for _, n, b in rows) or 1
    extra = torch.full((len(rows), width), -1, dtype=torch.int32)
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    used = 0
    for i, (r, n, b) in enumerate(rows):
        for j, pos in enumerate(range(b, n)):
            src = int(tables[r, pos // block_size]) * block_size + pos % block_size
            dst = free[used]
            used += 1
            flat_k[dst], flat_v[dst] = flat_k[src], flat_v[src]
            extra[i, j] = dst
    q = (2 * torch.randn(len(rows), num_heads, head_dim, generator=gen)).to(dtype)
    row_tables = tables[[r for r, _, _ in rows]].contiguous()
    lens = torch.tensor([n for _, n, _ in rows], dtype=torch.int32)
    bases = torch.tensor([b for _, _, b in rows], dtype=torch.int32)
    want = paged_decode_attention_cpu(q, k_cache, v_cache, row_tables, lens)
    got = paged_decode_attention_cpu(q, k_cache, v_cache, row_tables, lens, tree=(bases, extra))
    assert torch.equal(got, want)
    for i, (r, n, b) in enumerate(rows):  # the extras are read, not the table's positions
        poisoned = k_cache.clone()
        for pos in range(b, n):
            slot = int(tables[r, pos // block_size]) * block_size + pos % block_size
            poisoned.view(-1, num_kv_heads, head_dim)[slot] = math.nan
        one = paged_decode_attention_cpu(q[i:i + 1], poisoned, v_cache, row_tables[i:i + 1],
                                         lens[i:i + 1], tree=(bases[i:i + 1], extra[i:i + 1]))
        assert torch.equal(one, want[i:i + 1])
    with pytest.raises(ValueError, match="tree"):
        paged_decode_attention_cpu(q, k_cache, v_cache, row_tables, lens,
                                   tree=(bases.long(), extra))
    with pytest.raises(ValueError, match="tree"):  # fewer extras than the rows need
        paged_decode_attention_cpu(q, k_cache, v_cache, row_tables, lens,
                                   tree=(bases, extra[:, :1].contiguous()))


def test_rejects_what_it_cannot_serve():
    k_cache, v_cache, tables, _ = make_paged([5, 9], 2, 16, 4, torch.float32, seeded("bad cpu"))
    q, lens = torch.randn(2, 4, 16), torch.tensor([5, 9], dtype=torch.int32)
    f16 = [t.half() for t in (q, k_cache, v_cache)]
    with pytest.raises(ValueError, match="float32"):
        paged_decode_attention_cpu(*f16, tables, lens)
    with pytest.raises(ValueError, match="block_tables must be int32"):
        paged_decode_attention_cpu(q, k_cache, v_cache, tables.long(), lens)
    odd = make_paged([5], 2, 24, 4, torch.float32, seeded("odd dim"))
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode_attention_cpu(torch.randn(1, 4, 24), odd[0], odd[1], odd[2], lens[:1])
    assert not available(torch.float16, 4, 2, 16, 16) and not available(torch.float32, 4, 2, 24, 16)
    assert available(torch.float32, 4, 2, 16, 16) and available(torch.bfloat16, 4, 2, 16, 16)


@pytest.fixture
def fresh_build(tmp_path, monkeypatch):
    """An empty kernel cache directory and no memoized library, restored afterwards."""
    monkeypatch.setenv("MXSERVE_CACHE_DIR", str(tmp_path))
    cpu_attention._library.cache_clear()
    yield tmp_path
    cpu_attention._library.cache_clear()


def test_builds_into_the_cache_dir_once(fresh_build):
    assert available(torch.float32, 6, 2, 32, 16)
    built = list(fresh_build.glob("cpu_attention_kv_heads2_group3_head_dim32_*.so"))
    assert len(built) == 1 and not list(fresh_build.glob("tmp*"))  # no half-written leftovers
    mtime = built[0].stat().st_mtime_ns
    cpu_attention._library.cache_clear()
    assert available(torch.float32, 6, 2, 32, 16) and built[0].stat().st_mtime_ns == mtime


def test_without_a_compiler_falls_back_with_a_warning(fresh_build, monkeypatch, caplog):
    monkeypatch.setenv("CC", str(fresh_build / "no-such-cc"))
    with caplog.at_level(logging.WARNING, logger=cpu_build.__name__):
        assert not available(torch.float32, 4, 2, 16, 16)
    assert "using the torch path" in caplog.text
    monkeypatch.setenv("CC", "cc")
    monkeypatch.setenv("MXSERVE_CPU_KERNELS", "0")
    cpu_attention._library.cache_clear()
    assert not available(torch.float32, 4, 2, 16, 16)


@pytest.mark.parametrize("extra_flags", [["-mno-avx512bf16"], ["-mno-avx512f"]])
def test_portable_paths_match_reference(fresh_build, monkeypatch, extra_flags):
    """The generic vector code (what CPUs without AVX512-BF16, or without AVX-512, compile) for
    bf16 and fp32; this machine's own build is what the tests above run."""
    monkeypatch.setattr(cpu_build, "FLAGS", [*cpu_build.FLAGS, *extra_flags])
    for dtype in DTYPES:
        seq_lens = [0, 5, 16, 40, 77]
        k_cache, v_cache, tables, truth = make_paged(seq_lens, 2, 64, 16, dtype,
                                                     seeded("portable", dtype, *extra_flags))
        q = torch.randn(len(seq_lens), 6, 64, generator=seeded("q", dtype)).to(dtype)
        _check_decode(q, k_cache, v_cache, tables, seq_lens, truth, dtype)


def test_runner_picks_the_kernel_on_cpu_and_rejects_it_where_it_cannot_run(tiny_checkpoint):
    from mxserve import LLM

    ckpt = str(tiny_checkpoint("llama"))
    llm = LLM(model=ckpt, dtype="float32", load_progress=False)
    assert type(llm.engine.runner.attn).__name__ == "CPUAttention"
    with pytest.raises(ValueError, match="attention_backend 'cpu'"):
        LLM(model=ckpt, dtype="float16", attention_backend="cpu", load_progress=False)
