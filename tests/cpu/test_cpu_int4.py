"""The AMX int4 kernel (kernels/cpu_int4.py): against the float32 reference of the same
dequantized weights, the same bits for a row whatever the batch, worker/model/int4.py taking it,
and clear refusals."""

from __future__ import annotations

import pytest
import torch

from mxserve.kernels import cpu_int4
from mxserve.kernels.cpu_int4 import linear_int4, linear_int4_torch, pack_tiles
from mxserve.worker.model import int4

pytestmark = pytest.mark.skipif(not cpu_int4.available(), reason="needs AMX-BF16")


def rand(*shape, seed=0, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale
            ).bfloat16()


# N: whole tasks of 32 channels, half a task, a padded last task; K: one group and several;
# rows: one, a verify's, the most a tile holds
@pytest.mark.parametrize("n, k", [(64, 32), (48, 96), (400, 576), (96, 1536)])
@pytest.mark.parametrize("rows", [1, 4, 7, 16])
def test_matches_the_reference_and_rows_do_not_depend_on_the_batch(n, k, rows):
    weight, x = rand(n, k, seed=1, scale=0.05), rand(rows, k, seed=2)
    q, scales_zeros = int4._quantize(weight)
    got = linear_int4(x, pack_tiles(q, scales_zeros))
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    want = linear_int4_torch(x, q, scales_zeros)
    exact = x.float() @ int4.dequantize_int4_torch(weight).T  # int4.py's own reference
    # one bf16 step of the output (fp32 sums in another order may round the other way), plus
    # those sums' own error (and the 128 offset's)
    bound = want.float().abs() * 2**-7 + 1e-5 * (x.float().abs() @ weight.float().abs().T) + 1e-6
    assert ((got.float() - want.float()).abs() <= bound).all()
    assert ((got.float() - exact).abs() <= exact.abs() * 2**-8 + bound).all()
    tiles = pack_tiles(q, scales_zeros)
    for i in range(rows):  # a row alone: the bits it gets inside the batch
        assert torch.equal(linear_int4(x[i:i + 1], tiles)[0], got[i])


def test_extreme_codes_and_scales():
    # every group spans 0..15 with large and tiny scales: the 128 offset must cancel exactly
    g = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (64, 128), generator=g)
    q[:, ::32], q[:, 1::32] = 0, 15
    scale = torch.tensor([2.0**e for e in range(-12, 4)]).repeat(4)[None, :, None] \
        .expand(4, 64, 1)
    zero = -8 * scale
    scales_zeros = torch.cat([scale, zero], -1).bfloat16()
    x = rand(5, 128, seed=4)
    got = linear_int4(x, pack_tiles(q, scales_zeros)).float()
    want = linear_int4_torch(x, q, scales_zeros).float()
    assert ((got - want).abs() <= want.abs() * 2**-7 + 1e-6 * want.abs().amax(0)).all()


def test_reads_strided_rows():
    weight, x = rand(32, 64, seed=5, scale=0.05), rand(3, 96, seed=6)
    tiles = pack_tiles(*int4._quantize(weight))
    view = x[:, 16:80]  # row stride 96
    assert torch.equal(linear_int4(view, tiles), linear_int4(view.contiguous(), tiles))


def test_int4_weights_take_the_kernel_for_up_to_16_rows():
    weight, x = rand(96, 64, seed=7, scale=0.05), rand(16, 64, seed=8)
    w = int4.quantize_int4(weight)
    assert w.tiles is not None and w.packed is None and w.shape == (96, 64)
    assert w.max_rows == 16
    bias = rand(96, seed=9)
    assert torch.equal(int4.int4_linear(x, w), linear_int4(x, w.tiles))
    assert torch.equal(int4.int4_linear(x, w, bias), linear_int4(x, w.tiles).add_(bias))


def test_bad_input_is_refused():
    tiles = pack_tiles(*int4._quantize(rand(32, 64, seed=10, scale=0.05)))
    for x in (torch.zeros(1, 64), rand(1, 32), rand(17, 64), rand(0, 64)):  # dtype, K, rows
        with pytest.raises(ValueError, match="linear_int4"):
            linear_int4(x, tiles)
    with pytest.raises(ValueError, match="linear_int4"):
        linear_int4(rand(2, 128)[:, ::2], tiles)  # column stride 2
    q, scales_zeros = int4._quantize(rand(32, 64, seed=11, scale=0.05))
    with pytest.raises(ValueError, match="pack_tiles"):
        pack_tiles(q, scales_zeros[:1])
    with pytest.raises(ValueError, match="pack_tiles"):
        pack_tiles(q[:, :48], scales_zeros)
