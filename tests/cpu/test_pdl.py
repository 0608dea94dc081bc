"""Programmatic dependent launch stays out of GPUs that lack it. `griddepcontrol` (Triton's
gdc_wait / gdc_launch_dependents) assembles only for sm_90+, so the kernels that use it take a
constexpr flag the wrappers set from triton_compat.pdl_supported: compiled here (no GPU needed)
for an sm_80 target with the flag off they carry none of it and assemble; for sm_90 with it on
they carry it. (A wrapper that set the flag off CUDA would fail the kernels' CPU tests: the
interpreter has no gdc calls.)"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from mxserve.kernels.triton_compat import pdl_supported  # noqa: E402

# Compiled in a subprocess (compile_outside_interpreter): under TRITON_INTERPRET (tests/cpu)
# kernels are not JITFunctions
COMPILE = r"""
from mxserve.kernels import gemv, layer_ops, paged_attention

POINTERS = {"pos_ptr": "*i64", "slot_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
            "scales_ptr": "*u8", "part_ptr": "*fp32", "part_lse_ptr": "*fp32",
            "lse_out_ptr": "*fp32"}

def ptx(fn, arch, constexprs):
    return compile_for(fn, constexprs, POINTERS, arch=arch)[0].asm["ptx"]

def cases(flag):
    return {
        "gemv": (gemv._gemv_kernel, dict(
            BLOCK_M=4, BLOCK_N=4, BLOCK_K=2048, HAS_BIAS=False, NORM=True, ADD=True, EPILOGUE=0,
            KV=False, HEAD_DIM=2, ROT_ROWS=0, Q_ROWS=0, PAGE_SIZE=1, MX=False, EBITS=1, MBITS=1,
            NAN_CODE=-1, E=8, P=1, S=1, FOLD=True, TILE=0, NAN_SCALES=False, LAUNCH_PDL=flag,
            INTERP_BF16=False)),
        "rms_norm": (layer_ops._rms_norm_kernel, dict(
            HAS_RESIDUAL=True, BLOCK_N=2048, TRIGGER=flag, INTERP_BF16=False)),
        "merge_splits": (paged_attention._merge_splits_kernel, dict(
            NUM_HEADS=32, HEAD_DIM=64, NUM_SPLITS=8, BLOCK_S=8, BLOCK_D=64, TRIGGER=flag,
            INTERP_BF16=False)),
    }

out = {}
for name in cases(False):
    fn, off = cases(False)[name]
    sm80 = "griddepcontrol" in ptx(fn, 80, off)  # ptxas assembles it for sm_80, or raises
    fn, on = cases(True)[name]
    out[name] = [sm80, "griddepcontrol" in ptx(fn, 90, on)]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled(compile_outside_interpreter):
    return json.loads(compile_outside_interpreter(COMPILE, 600))


@pytest.mark.parametrize("name", ["gemv", "rms_norm", "merge_splits"])
def test_kernels_assemble_without_pdl_below_sm90_and_carry_it_from_sm90(compiled, name):
    without_on_sm80, with_on_sm90 = compiled[name]
    assert not without_on_sm80 and with_on_sm90


def test_pdl_is_off_off_cuda():
    assert not pdl_supported(torch.zeros(1))


def test_without_gdc_in_triton_the_kernels_still_import_and_run():
    """Triton < 3.3 has no gdc_wait: the kernels import, pdl_supported says no, and a wrapper
    runs (here in the interpreter)."""
    code = r"""
import builtins
real_import = builtins.__import__
def old_triton_import(name, globals=None, locals=None, fromlist=(), level=0):
    if name == "triton.language.extra.cuda" and "gdc_wait" in (fromlist or ()):
        raise ImportError("cannot import name 'gdc_wait'")  # as an older Triton
    return real_import(name, globals, locals, fromlist, level)
builtins.__import__ = old_triton_import
import torch
from mxserve.kernels import gemv, triton_compat
assert triton_compat.gdc_wait is None and not triton_compat.pdl_supported(torch.zeros(1))
x, w = torch.randn(1, 64).bfloat16(), torch.randn(8, 64).bfloat16()
y = gemv.gemv(x, w, backend="triton")
assert torch.allclose(y.float(), x.float() @ w.float().T, rtol=2e-2, atol=2e-2)
print("ok")
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-2000:]
