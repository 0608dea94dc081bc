"""Building the project's C kernels for the CPU (cpu_attention.py, cpu_linear.py): compiled on first
use with the machine's C compiler, loaded with ctypes.

Each kernel's C source lives in its Python module beside its torch reference. `build` compiles it
with `cc -O3 -march=native -fopenmp` into $MXSERVE_CACHE_DIR (default ~/.cache/mxserve) under a
name that hashes the source, the defines, the compiler and the CPU's flags, so a library built
for another CPU is never loaded and a rebuild happens only when one of them changes. The OpenMP
runtime is the libgomp torch already loaded (same soname), so torch.set_num_threads applies.
Without a compiler (or with MXSERVE_CPU_KERNELS=0) `build` returns None and logs why; callers
fall back to their torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile

logger = logging.getLogger(__name__)

FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
         "-shared", "-fPIC"]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def build(name: str, source: str, defines: dict[str, int] | None = None) -> ctypes.CDLL | None:
    """The shared library of `source` compiled with -D`defines`, from the cache when there; None
    (logged) when it cannot be built or MXSERVE_CPU_KERNELS=0."""
    if os.environ.get("MXSERVE_CPU_KERNELS", "1") == "0":
        return None
    compiler = os.environ.get("CC", "cc")
    flags = [*FLAGS, *(f"-D{k}={v}" for k, v in (defines or {}).items())]
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                 check=True, timeout=30).stdout
        key = hashlib.sha256("\0".join([source, version, _cpu_flags(), *flags]).encode())
        cache = os.environ.get("MXSERVE_CACHE_DIR", os.path.expanduser("~/.cache/mxserve"))
        tag = "".join(f"_{k.lower()}{v}" for k, v in (defines or {}).items())
        path = os.path.join(cache, f"{name}{tag}_{key.hexdigest()[:16]}.so")
        if not os.path.exists(path):
            os.makedirs(cache, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cache) as tmp:
                src, lib = os.path.join(tmp, "k.c"), os.path.join(tmp, "k.so")
                with open(src, "w") as f:
                    f.write(source)
                subprocess.run([compiler, *flags, src, "-o", lib, "-lm"], check=True,
                               capture_output=True, text=True, timeout=300)
                os.replace(lib, path)  # atomic: a concurrent builder finds a whole file
        return ctypes.CDLL(path)
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        logger.warning("CPU kernel %s unavailable, using the torch path: %s", name, detail)
        return None
