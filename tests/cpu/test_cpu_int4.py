"""The CPU int4 kernel (kernels/cpu_int4.py): against the float32 reference of the same
dequantized weights, the same bits for a row whatever the batch, worker/model/int4.py taking it,
and clear refusals."""

from __future__ import annotations

import pytest
import torch

from mxserve.kernels import cpu_int4
from mxserve.kernels.cpu_int4 import linear_int4, linear_int4_torch, pack_tiles
from mxserve.worker.model import int4

pytestmark = pytest.mark.skipif(not cpu_int4.available(), reason="needs AVX512-BF16")


def rand(*shape, seed=0, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale
            ).bfloat16()


def tiles(weight: torch.Tensor):
    q, scales_zeros = int4._quantize(weight)
    return pack_tiles(q, scales_zeros)


# N: an even and an odd number of 16-channel tiles; K: one group and several; rows on both
# tilings (up to 4: two tiles a task; more: one)
@pytest.mark.parametrize("n, k", [(64, 32), (48, 96), (400, 576)])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8])
def test_matches_the_reference_and_rows_do_not_depend_on_the_batch(n, k, rows):
    weight, x = rand(n, k, seed=1, scale=0.05), rand(rows, k, seed=2)
    nibbles, sz = tiles(weight)
    got = linear_int4(x, nibbles, sz)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    want = linear_int4_torch(x, nibbles, sz)
    exact = x.float() @ int4.dequantize_int4_torch(weight).T  # int4.py's own reference
    # one bf16 rounding of the output, plus fp32 sums in another order
    bound = want.float().abs() * 2**-8 + 1e-5 * (x.float().abs() @ weight.float().abs().T) + 1e-6
    assert ((got.float() - want.float()).abs() <= bound).all()
    assert ((got.float() - exact).abs() <= exact.abs() * 2**-8 + bound).all()
    for i in range(rows):  # a row alone: the bits it gets inside the batch
        assert torch.equal(linear_int4(x[i:i + 1], nibbles, sz)[0], got[i])


def test_reads_strided_rows():
    weight, x = rand(32, 64, seed=3, scale=0.05), rand(3, 96, seed=4)
    nibbles, sz = tiles(weight)
    view = x[:, 16:80]  # row stride 96
    assert torch.equal(linear_int4(view, nibbles, sz), linear_int4(view.contiguous(), nibbles, sz))


def test_int4_weights_take_the_kernel():
    weight, x = rand(96, 64, seed=5, scale=0.05), rand(4, 64, seed=6)
    w = int4.quantize_int4(weight)
    assert w.tiles is not None and w.packed is None and w.shape == (96, 64)
    bias = rand(96, seed=7)
    assert torch.equal(int4.int4_linear(x, w), linear_int4(x, *w.tiles))
    assert torch.equal(int4.int4_linear(x, w, bias), linear_int4(x, *w.tiles).add_(bias))


def test_bad_input_is_refused():
    nibbles, sz = tiles(rand(32, 64, seed=8, scale=0.05))
    for x in (torch.zeros(1, 64), rand(1, 32), rand(9, 64), rand(0, 64)):  # dtype, K, rows
        with pytest.raises(ValueError, match="linear_int4"):
            linear_int4(x, nibbles, sz)
    with pytest.raises(ValueError, match="pack_tiles"):
        linear_int4(rand(1, 64), nibbles, sz[:, :1].contiguous())
