"""What the kernel modules see as `triton` where Triton is not installed.

Triton is a GPU compiler of about 1 GB; a CPU-only install has no use for it (every CPU path runs
torch or the C kernels), so it is not a dependency (the `test` extra brings it for the kernel tests
under TRITON_INTERPRET=1). The kernel modules still import on such a machine and define their
kernels with this module's `jit`; launching one raises `TritonMissingError`, which says how to get
Triton. `cdiv` and `next_power_of_2` are real: launchers compute grids with them.
"""

from __future__ import annotations

from typing import Any

INSTALL_HINT = "pip install triton (or mxserve[test]); CUDA builds of torch bring it along"


class TritonMissingError(RuntimeError):
    """A Triton kernel was launched on a machine without Triton."""


class Kernel:
    """A kernel defined without Triton: it keeps the Python function and refuses to launch."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "kernel")
        self.__doc__ = getattr(fn, "__doc__", None)

    def _missing(self, *args, **kwargs):
        raise TritonMissingError(f"the Triton kernel {self.__name__} needs Triton, which is not "
                                 f"installed: {INSTALL_HINT}")

    __call__ = _missing

    def __getitem__(self, grid) -> Any:
        return self._missing


def jit(fn=None, **options):
    """triton.jit's two call forms: @jit and @jit(...)."""
    if fn is None:
        return Kernel
    return Kernel(fn)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


class constexpr:  # noqa: N801 (triton.language's name)
    """A compile-time constant as module-level code builds them (`tl.constexpr(value)`)."""

    def __init__(self, value: Any) -> None:
        self.value = value


class _Language:
    """triton.language: `constexpr` as above; other names, used only in kernel bodies and
    annotations, resolve to placeholders."""

    constexpr = constexpr

    def __getattr__(self, name: str) -> str:
        if name.startswith("__"):
            raise AttributeError(name)
        return f"triton.language.{name} (Triton is not installed)"


language = _Language()
