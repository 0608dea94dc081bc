"""Chained block hashes: the one definition shared by the worker's prefix cache and the router.

A sequence of token ids is cut into blocks of `block_size` tokens; only full blocks get a hash:

    hash_i = H(hash_{i-1}, model_id, tokens of block i)        (hash_{-1} = None)

so a block's hash names its whole prefix, and two sequences share hash_i exactly when they share
their first (i + 1) * block_size tokens (under the same model). H is BLAKE2b with a 16-byte
(128-bit) digest over this fixed byte encoding, never Python's salted `hash()`:

    parent     16 bytes, little-endian (16 zero bytes when there is no parent)
    model_id   4-byte little-endian byte length, then the UTF-8 bytes
    token_ids  4 bytes each, little-endian uint32

The digest is read back as a little-endian unsigned int. Changing any of this changes every hash
and desynchronises router and worker: tests/cpu/test_block_hash.py pins golden values.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

_DIGEST_SIZE = 16
_NO_PARENT = bytes(_DIGEST_SIZE)
# array's "I" is 4 bytes on every platform CPython supports; fall back to "L" just in case.
_UINT32 = "I" if array("I").itemsize == 4 else "L"


def hash_block(parent: int | None, model_id: str, token_ids: Sequence[int]) -> int:
    """The 128-bit hash of one block given its parent's hash (None for the first block).

    Raises OverflowError if a token id is outside [0, 2**32) or parent outside [0, 2**128).
    """
    return _hash(parent, _model_bytes(model_id), _token_bytes(token_ids))


def extend_block_hashes(
    hashes: list[int], token_ids: Sequence[int], block_size: int, model_id: str
) -> None:
    """Append to `hashes` the hashes of the full blocks of `token_ids` not hashed yet.

    `hashes` holds the hashes of the first len(hashes) blocks of `token_ids` (the caller keeps it
    alongside a growing sequence); new ones chain from hashes[-1]. A trailing partial block gets
    no hash.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    start, stop = len(hashes), len(token_ids) // block_size
    if stop <= start:
        return
    model = _model_bytes(model_id)
    data = _token_bytes(token_ids[start * block_size : stop * block_size])
    step = 4 * block_size
    parent = hashes[-1] if hashes else None
    for offset in range(0, len(data), step):
        parent = _hash(parent, model, data[offset : offset + step])
        hashes.append(parent)


def block_hashes(token_ids: Sequence[int], block_size: int, model_id: str) -> list[int]:
    """The hashes of all full blocks of `token_ids`."""
    hashes: list[int] = []
    extend_block_hashes(hashes, token_ids, block_size, model_id)
    return hashes


def _hash(parent: int | None, model: bytes, tokens: bytes) -> int:
    h = hashlib.blake2b(digest_size=_DIGEST_SIZE)
    h.update(_NO_PARENT if parent is None else parent.to_bytes(_DIGEST_SIZE, "little"))
    h.update(model)
    h.update(tokens)
    return int.from_bytes(h.digest(), "little")


def _model_bytes(model_id: str) -> bytes:
    encoded = model_id.encode("utf-8")
    return len(encoded).to_bytes(4, "little") + encoded


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    arr = array(_UINT32, token_ids)
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tobytes()
