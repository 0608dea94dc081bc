"""WSUM64 (kernels/checksum.py): the Triton kernel (interpreted here) equals the torch reference
bit for bit, and the digest changes with any one corrupted half, a truncation or a swap."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

from mxserve.kernels.checksum import SEGMENT, wsum64, wsum64_torch  # noqa: E402


def payload(num_bytes: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=gen)


@pytest.mark.parametrize("num_bytes", [0, 2, 6, 8190, 2 * SEGMENT + 6])
def test_triton_equals_the_reference(num_bytes):
    data = payload(num_bytes, num_bytes)
    assert wsum64(data, backend="triton") == wsum64_torch(data)
    as_bf16 = data.view(torch.bfloat16) if num_bytes else data  # any dtype: its bytes
    assert wsum64(as_bf16, backend="triton") == wsum64_torch(data)


def test_digest_changes_with_corruption_truncation_and_swaps():
    data = payload(2 * SEGMENT + 64, 1)  # two segments and a bit
    want = wsum64(data, backend="triton")
    gen = torch.Generator().manual_seed(2)
    for i in torch.randint(0, data.numel(), (24,), generator=gen).tolist() + [0, SEGMENT - 1,
                                                                             data.numel() - 1]:
        for bit in (0, 7):
            bad = data.clone()
            bad[i] ^= 1 << bit
            assert wsum64(bad, backend="triton") != want, (i, bit)
    assert wsum64(data[:-2], backend="triton") != want
    halves = data.clone().view(torch.int16)
    a, b = 10, SEGMENT + 10  # same weight, other segments: the fold tells them apart
    assert halves[a] != halves[b]
    halves[[a, b]] = halves[[b, a]]
    assert wsum64(halves, backend="triton") != want
    halves = data.clone().view(torch.int16)
    halves[[3, 4]] = halves[[4, 3]]
    assert halves[3] != halves[4] and wsum64(halves, backend="triton") != want


def test_rejects_odd_lengths_and_strided_payloads():
    with pytest.raises(ValueError, match="even number of bytes"):
        wsum64(payload(7, 0))
    with pytest.raises(ValueError, match="contiguous"):
        wsum64(torch.zeros(8, 4)[:, 1])
