"""Backend choice for the kernels, the one place they import Triton from (a stand-in where it
is not installed: no_triton.py), and the Triton interpreter's bf16 workarounds.

The interpreter (TRITON_INTERPRET=1, how tests/cpu runs every kernel) differs from the GPU in
three bf16 details, as of Triton 3.9: fp32 -> bf16 casts truncate, bf16 <-> fp32 casts lose
subnormals, and tl.dot on bf16 operands returns garbage. Kernels take an INTERP_BF16 constexpr
(true only when interpreting with bf16 data) and route those operations through the bit-level
helpers here, which are exact; on a GPU the flag is false and the plain casts run.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: kernels are defined but cannot launch (no_triton.py)
    from mxserve.kernels import no_triton as triton

    tl = triton.language

try:  # programmatic dependent launch's grid dependency control, Triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # older Triton, or none: pdl_supported says no, and no kernel reaches these
    gdc_launch_dependents = gdc_wait = None

BACKENDS = ("auto", "triton", "torch")


@triton.jit
def _probe():
    pass


def is_interpreted() -> bool:
    """True when triton.jit chose the interpreter (it decides when it decorates, at import)."""
    return type(_probe).__name__ == "InterpretedFunction"


def use_triton(backend: str, t: torch.Tensor) -> bool:
    """'auto' = Triton on CUDA, torch on CPU; 'triton' on CPU needs the Triton interpreter."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "triton" and not (t.is_cuda or is_interpreted()):
        raise ValueError("backend='triton' on a CPU tensor needs TRITON_INTERPRET=1 set before "
                         "mxserve.kernels is first imported")
    return backend == "triton" or (backend == "auto" and t.is_cuda)


def pdl_supported(t: torch.Tensor) -> bool:
    """Programmatic dependent launch applies to kernels on `t`'s device: NVIDIA sm_90+ (below,
    griddepcontrol does not assemble: a kernel must not even contain it; ROCm reports its own
    capability numbers through the same call) with a Triton that has it."""
    return (gdc_wait is not None and t.is_cuda and torch.version.hip is None
            and _capability_major(t.device.index or 0) >= 9)


@functools.cache
def _capability_major(index: int) -> int:  # (asked once a device: a launch path calls this)
    return torch.cuda.get_device_capability(index)[0]


def interpreted_bf16(dtype: torch.dtype, t: torch.Tensor) -> bool:
    """The INTERP_BF16 flag: a kernel on `t` runs in the interpreter with bf16 data."""
    return dtype == torch.bfloat16 and not t.is_cuda


@triton.jit
def round_bf16(v):
    """fp32 v rounded to nearest-even bf16, kept in fp32. Only for the Triton interpreter, whose
    fp32 -> bf16 cast truncates: after this the cast is exact (on GPU the cast is already RNE)."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def cast_out(v, dtype: tl.constexpr, INTERP_BF16: tl.constexpr):
    """fp32 v.to(dtype); INTERP_BF16 (bf16 data in the interpreter) and dtype bf16: by bits, see
    round_bf16 and to_f32."""
    if INTERP_BF16 and dtype == tl.bfloat16:
        bits = round_bf16(v).to(tl.int32, bitcast=True) >> 16
        return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
    return v.to(dtype)


@triton.jit
def to_f32(x, INTERP_BF16: tl.constexpr):
    """x.to(fp32); INTERP_BF16 (x is bf16): by bits; the interpreter's upcast loses subnormals."""
    if INTERP_BF16:
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


