"""CPU tests: Triton kernels run in the interpreter.

It must be chosen before triton is first imported, hence here rather than in each test module.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

# What a compile script starts with (the `compile_outside_interpreter` fixture). The interpreter
# also takes code the compiler refuses (a plain global read in a kernel, say), so kernels are
# compiled for a GPU target too, with no GPU: in a subprocess without TRITON_INTERPRET.
COMPILE_PRELUDE = r'''
import contextlib, io, json, os
os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"  # ptxas's log on stdout, on every compile
os.environ["TRITON_ALWAYS_COMPILE"] = "1"  # (a cache hit would skip ptxas and its log)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

def compile_for(fn, const, types=None, pointer="*bf16", arch=90, aligned=(), **options):
    """(kernel, ptxas log) of jit function fn compiled for sm_<arch>: arguments in const are
    constexprs; `*_ptr` ones types[name] (else `pointer`); eps and qk_scale fp32; others i32.
    aligned: argument names (and every pointer and stride) specialized as 16-divisible, as a
    launch with aligned values does (when given)."""
    types = types or {}
    sig = {n: "constexpr" if n in const else types.get(n, pointer) if n.endswith("_ptr")
           else "fp32" if n in ("eps", "qk_scale") else "i32" for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if aligned and n not in const
             and (n.endswith("_ptr") or n.startswith("stride") or n in aligned)}
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        kernel = triton.compile(ASTSource(fn, sig, constexprs=const, attrs=attrs),
                                target=GPUTarget("cuda", arch, 32), options=options)
    return kernel, log.getvalue()
'''


@pytest.fixture(scope="session")
def compile_outside_interpreter():
    """run(script, timeout) -> the last line the script prints: COMPILE_PRELUDE + script in a
    Python subprocess without TRITON_INTERPRET; fails the test on a non-zero exit."""
    def run(script: str, timeout: int = 900) -> str:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        done = subprocess.run([sys.executable, "-c", COMPILE_PRELUDE + script], env=env,
                              capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.splitlines()[-1]
    return run
