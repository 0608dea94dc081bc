"""kernels/sampling_ops.py's argmax under the Triton interpreter, against torch.argmax: the first
maximal index of each row, ties within and across chunks, -inf rows and masked tails."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

from mxserve.kernels.sampling_ops import BLOCK, argmax_rows  # noqa: E402


@pytest.mark.parametrize("rows,vocab", [(1, 7), (3, BLOCK), (2, BLOCK + 1), (5, 3 * BLOCK - 17),
                                        (4, 49152)])
def test_argmax_rows_matches_torch_on_random_logits(rows, vocab):
    gen = torch.Generator().manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab, generator=gen)
    got = argmax_rows(logits, backend="triton")
    assert got.dtype == torch.long and torch.equal(got, logits.argmax(-1))


def test_argmax_rows_takes_the_first_of_tied_maxima_within_and_across_chunks():
    vocab = 3 * BLOCK + 5
    logits = torch.zeros(5, vocab)
    logits[0, [9, 2 * BLOCK + 1]] = 4.0  # across chunks: the first chunk's
    logits[1, [BLOCK + 3, BLOCK + 7]] = 4.0  # within a chunk
    logits[2] = float("-inf")  # nothing but -inf: index 0, as torch
    logits[3, -1] = 1.0  # the masked tail's last real entry
    logits[4, :] = 2.0  # all tied
    want = torch.tensor([9, BLOCK + 3, 0, vocab - 1, 0])
    assert torch.equal(logits.argmax(-1), want)
    assert torch.equal(argmax_rows(logits, backend="triton"), want)
    assert torch.equal(argmax_rows(logits[:0], backend="triton"), want[:0])


def test_argmax_rows_rejects_what_it_cannot_reduce():
    with pytest.raises(ValueError, match="2-D float"):
        argmax_rows(torch.zeros(4, dtype=torch.long).view(2, 2), backend="triton")
    with pytest.raises(ValueError, match="contiguous rows"):
        argmax_rows(torch.zeros(8, 4).t(), backend="triton")
    with pytest.raises(ValueError, match="empty"):
        argmax_rows(torch.zeros(3, 0), backend="triton")
