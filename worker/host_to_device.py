"""Host lists to device tensors without waiting for the GPU.

`torch.tensor(values, device="cuda")` copies from pageable memory and then synchronizes the
stream: the host waits for every kernel queued before it. With async scheduling the queue holds
the step in flight, so each such call would stall the host for a whole step. `to_device` stages
the values in pinned memory (torch's caching host allocator, which keeps a buffer until its copy
has run) and copies asynchronously, in stream order: kernels queued after it see the values.
"""

from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of `values` (a list, nested lists or a numpy array) on `device`."""
    if device.type != "cuda":
        return torch.as_tensor(values, dtype=dtype)
    host = torch.as_tensor(values, dtype=dtype).pin_memory()
    return host.to(device, non_blocking=True)


def index_on(values: list[int], like: torch.Tensor) -> torch.Tensor:
    """Row indices [len(values)] int64 on like's device, for index_select / index_copy_."""
    return to_device(values, torch.long, like.device)


def fill_inflight_tokens(input_ids: torch.Tensor, rows: list[tuple[int, int]],
                         inflight_tokens: torch.Tensor) -> None:
    """input_ids[i] = inflight_tokens[j] for each (i, j) in rows: the ids the previous step
    sampled, which the host has not seen yet, copied on the device."""
    dst, src = (list(x) for x in zip(*rows))
    n = len(rows)
    if dst == list(range(dst[0], dst[0] + n)) and src == list(range(src[0], src[0] + n)):
        input_ids[dst[0]:dst[0] + n].copy_(inflight_tokens[src[0]:src[0] + n])  # steady decode
        return
    input_ids.index_copy_(0, index_on(dst, input_ids),
                          inflight_tokens.index_select(0, index_on(src, input_ids)))
