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
