"""Which tensor-parallel shard a process holds, and the collectives its layers run over the
group (torch.distributed: NCCL on GPU, gloo on CPU). Size 1 runs no collective."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """Which shard this process holds. `group`: a torch.distributed process group (None = world)."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} outside tensor-parallel size {self.size}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def shard(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's equal slice of `full` along `dim`."""
        if full.shape[dim] % self.size:
            raise ValueError(f"dim {dim} of size {full.shape[dim]} not divisible by tp {self.size}")
        return full.chunk(self.size, dim=dim)[self.rank]
