"""The attention backends by name (EngineConfig.attention_backend): "torch" and "cpu"
(worker/attention.py) and "triton" (worker/attention_triton.py, imported only when asked for, as
it loads the Triton kernels)."""

from __future__ import annotations

from mxserve.worker.attention import AttentionBackend, CPUAttention, TorchAttention

NAMES = ("cpu", "torch", "triton")


def get_attention_backend(name: str) -> AttentionBackend:
    if name == "torch":
        return TorchAttention()
    if name == "cpu":
        return CPUAttention()
    if name == "triton":
        from mxserve.worker.attention_triton import TritonAttention

        return TritonAttention()
    raise ValueError(f"unknown attention backend {name!r}; known: {list(NAMES)}")
