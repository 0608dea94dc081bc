"""Chained block hashes: pinned encoding, chaining, and incremental extension."""

from __future__ import annotations

import hashlib
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mxserve.api.block_hash import block_hashes, extend_block_hashes, hash_block

MODEL = "HuggingFaceTB/SmolLM2-135M"


def reference_hash(parent: int | None, model_id: str, token_ids: list[int]) -> int:
    """The encoding of ARCHITECTURE.md "Block hashes", written out with struct."""
    model = model_id.encode("utf-8")
    data = (
        (parent or 0).to_bytes(16, "little")
        + struct.pack("<I", len(model))
        + model
        + struct.pack(f"<{len(token_ids)}I", *token_ids)
    )
    return int.from_bytes(hashlib.blake2b(data, digest_size=16).digest(), "little")


def test_golden_values_pin_the_encoding():
    # Router and worker must agree forever: if these change, every cached prefix is lost.
    assert hash_block(None, MODEL, [1, 2, 3, 4]) == 279400130101998673066204074620150090786
    assert block_hashes(list(range(10)), 4, "m") == [
        212288727109264990242193254206732131117,
        16343150805022844068261244107266478585,
    ]


@given(
    parent=st.none() | st.integers(0, 2**128 - 1),
    model_id=st.text(max_size=20),
    token_ids=st.lists(st.integers(0, 2**32 - 1), max_size=40),
)
def test_matches_reference_encoding(parent, model_id, token_ids):
    assert hash_block(parent, model_id, token_ids) == reference_hash(parent, model_id, token_ids)


def test_hash_is_128_bit_int():
    h = hash_block(None, MODEL, [7] * 16)
    assert isinstance(h, int) and 0 <= h < 2**128 and h.bit_length() > 64


def test_model_id_changes_hash():
    tokens = list(range(16))
    assert hash_block(None, "a", tokens) != hash_block(None, "b", tokens)
    # The length prefix keeps model id and token bytes apart.
    assert hash_block(None, "a\x00", [0]) != hash_block(None, "a", [0, 0])


def test_chain_depends_on_every_earlier_block():
    a = block_hashes([1] * 4 + [2] * 4 + [3] * 4, 4, MODEL)
    b = block_hashes([9] * 4 + [2] * 4 + [3] * 4, 4, MODEL)
    assert a[0] != b[0] and a[1] != b[1] and a[2] != b[2]
    assert a[1] == hash_block(a[0], MODEL, [2] * 4)
    assert a[0] == hash_block(None, MODEL, [1] * 4)
    assert hash_block(None, MODEL, [2] * 4) != a[1]


def test_only_full_blocks_are_hashed():
    assert block_hashes(list(range(15)), 16, MODEL) == []
    assert len(block_hashes(list(range(33)), 16, MODEL)) == 2


@given(
    tokens=st.lists(st.integers(0, 50_000), max_size=80),
    cuts=st.lists(st.integers(0, 80), max_size=5),
    block_size=st.integers(1, 8),
)
def test_extend_incrementally_equals_fresh(tokens, cuts, block_size):
    hashes: list[int] = []
    for cut in sorted(cuts) + [len(tokens)]:
        extend_block_hashes(hashes, tokens[:cut], block_size, MODEL)
    assert hashes == block_hashes(tokens, block_size, MODEL)
    assert len(hashes) == len(tokens) // block_size


def test_extend_with_no_new_full_block_is_noop():
    hashes = block_hashes(list(range(16)), 16, MODEL)
    extend_block_hashes(hashes, list(range(20)), 16, MODEL)
    assert len(hashes) == 1


@pytest.mark.parametrize("bad", [-1, 2**32])
def test_token_ids_outside_uint32_raise(bad):
    with pytest.raises(OverflowError):
        hash_block(None, MODEL, [bad])
