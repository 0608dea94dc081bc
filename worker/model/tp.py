"""Which tensor-parallel shard a process holds, which slice of each weight that is, and the
collectives its layers run over the group. Size 1 runs no collective.

Megatron's split: attention heads and MLP columns go to ranks in equal contiguous ranges; the
query heads of rank r use the KV heads of rank r. With fewer KV heads than ranks, each KV head
is held by `size // num_kv_heads` consecutive ranks (replicated, as vLLM does), so a rank still
holds exactly the KV heads its query heads read. The vocabulary (embedding, LM head) is split in
equal ranges of ceil(vocab / size) rows, the last one padded with zero rows.

`group` is a torch.distributed process group object (ProcessGroupGloo on CPU, ProcessGroupNCCL
on CUDA) built for this engine alone (worker/tp_executor.py), not the process-wide default
group, so one process may hold several engines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mxserve.api.errors import ModelLoadError
from mxserve.worker.model.config import ModelConfig


@dataclass(frozen=True)
class TPGroup:
    """This process's rank in a group of `size`, and the group's process group (None: size 1)."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} outside tensor-parallel size {self.size}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place."""
        if self.size > 1:
            self.group.allreduce([x]).wait()
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x side by side along the last dim: [..., n] -> [..., size * n]."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.allgather([parts], [x.contiguous()]).wait()
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank, in place."""
        if self.size > 1:
            self.group.broadcast(x, 0).wait()
        return x

    def split(self, n: int) -> tuple[int, int]:
        """[start, stop) of this rank's equal share of n (which `size` divides)."""
        share = n // self.size
        return self.rank * share, (self.rank + 1) * share

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """[start, stop) of the KV heads this rank holds (one replicated head when there are
        fewer heads than ranks)."""
        if num_kv_heads >= self.size:
            return self.split(num_kv_heads)
        head = self.rank // (self.size // num_kv_heads)
        return head, head + 1

    def vocab(self, vocab_size: int) -> tuple[int, int, int]:
        """(start, stop, rows): this rank's vocabulary range and its padded row count."""
        rows = -(-vocab_size // self.size)
        start = min(self.rank * rows, vocab_size)
        return start, min(start + rows, vocab_size), rows


def check_tensor_parallel(cfg: ModelConfig, size: int) -> None:
    """ModelLoadError naming the config field a tensor-parallel size of `size` cannot split."""
    if size == 1:
        return
    for name in ("num_attention_heads", "intermediate_size"):
        if getattr(cfg, name) % size:
            raise ModelLoadError(f"tensor_parallel_size {size} does not divide the model's "
                                 f"{name} ({getattr(cfg, name)})")
    kv = cfg.num_key_value_heads
    if kv % size and size % kv:
        raise ModelLoadError(f"tensor_parallel_size {size} and the model's num_key_value_heads "
                             f"({kv}): one must divide the other (KV heads are split over the "
                             "ranks, or each replicated on size / heads ranks)")
