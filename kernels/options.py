"""Options of the kernels that the model picks per call, as a frozen value the engine passes
down (EngineConfig.gemv -> the model's linear layers), so two engines in one process can differ
and a benchmark's A/B is a config change. Torch-free: EngineConfig holds one."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GemvOptions:
    """When the model takes kernels/gemv.py's whole-row GEMV (and its fused decode projections)
    instead of cuBLAS or mx_linear, on CUDA.

    max_rows: rows of x up to which it does: it wins at 1 row on every 1B and 8B decode shape
      and mostly loses from 2 on (bench/results/gemv_gpu.md); 0 turns it off.
    pdl: programmatic dependent launch on sm_90+: the kernel may start while the one before it
      runs, loading its weights until gdc_wait (bench/results/gemv_gpu.engine_pdl.md).
    mx_max_elements: MX weights take it up to this many elements: decoded pair by pair it beat
      mx_linear's tensor-core decode up to the 8B q/k/v (24M elements) and lost from the 1B
      gate/up (32M) up, where a program's decode and products set the time
      (bench/results/gemv_gpu.mx_pairs.md).
    """

    max_rows: int = 1
    pdl: bool = True
    mx_max_elements: int = 24 << 20

    def __post_init__(self) -> None:
        for name in ("max_rows", "mx_max_elements"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"gemv.{name} must be an integer >= 0, got {value!r}")
        if not isinstance(self.pdl, bool):
            raise ValueError(f"gemv.pdl must be true or false, got {self.pdl!r}")


DEFAULT_GEMV = GemvOptions()
