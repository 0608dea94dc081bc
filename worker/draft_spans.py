"""What an EAGLE drafting round runs over and where its chains end (worker/eagle.py's rounds,
cuda_graphs.EagleGraphs' replays of them, the draft replica's run-ahead)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Span:
    """Positions start .. start + length - 1 of a request for the head to run over, its KV
    going to the block table's slots; their RoPE positions are offset further by the tokens
    KV eviction dropped before them."""

    start: int
    length: int
    block_table: list[int]
    offset: int = 0


@dataclass(slots=True)
class ChainEnd:
    """Where a request's chain of drafts stopped: the head's output `feature` [hidden] predicted
    `token`, and `position` is where the head would run on that token next. `guess`: the token
    was not drafted (the head was unsure of it), so it is the head's guess at the token the
    target adds after the drafts; otherwise it is the last draft."""

    position: int
    token: int
    feature: torch.Tensor
    guess: bool
    block_table: list[int]
    offset: int = 0
