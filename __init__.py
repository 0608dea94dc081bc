"""mxserve: an LLM serving cluster on Ray.

The offline API, as vLLM users know it::

    from mxserve import LLM, SamplingParams
    llm = LLM()  # SmolLM2-135M-Instruct
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))

Exports are imported lazily, so `import mxserve.router...` does not pull in torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "mxserve.worker.llm",
    "RequestOutput": "mxserve.worker.llm",
    "SamplingParams": "mxserve.api.sampling_params",
    "InvalidRequestError": "mxserve.api.errors",
    "ModelLoadError": "mxserve.api.errors",
    "MxserveError": "mxserve.api.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mxserve' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
