"""The tensor-core kernels keep their wgmma pipeline on Hopper.

Triton issues a tl.dot on sm_90 as a chain of asynchronous wgmma instructions with one group
left in flight, and ptxas may still serialize them: it waits for every wgmma before the next
starts when it finds a non-wgmma instruction writing an accumulator register inside a pipeline
stage, and says so in its log (info C7515, "wgmma.mma_async instructions are serialized"). A
loop whose trip count may be zero leaves such a write behind: the zero-trip path sets the
accumulators to the initial zeros. The MX tensor-core decode at its tuned batch-1 tile (128
rows) was serialized that way until its loop was declared non-empty (tl.assume), and every
small 64x16x16 wgmma then waited out its own latency.

Each case is compiled here for sm_90 (no GPU needed; compile_outside_interpreter, tests/cpu/
conftest.py) with ptxas's log captured, fresh (no cache hit skips ptxas)."""

from __future__ import annotations

import json

import pytest

COMPILE = r"""
from mxserve.kernels import mx_decode, paged_attention as pa

TYPES = {"x_ptr": "*bf16", "planes_ptr": "*i32", "scales_ptr": "*u8", "partial_ptr": "*fp32",
         "counter_ptr": "*i32", "bt_ptr": "*i32", "qsl_ptr": "*i32", "ctx_lens_ptr": "*i32",
         "seq_lens_ptr": "*i32", "lse_ptr": "*fp32"}
ALIGNED = ("K", "num_words", "words_per_split", "tokens_per_split")  # as launches specialize

def compile_case(fn, const, num_warps, num_stages):
    kernel, log = compile_for(fn, const, TYPES, aligned=ALIGNED, num_warps=num_warps,
                              num_stages=num_stages)
    return {"wgmma": "wgmma.mma_async" in kernel.asm["ptx"],
            "serialized": [line for line in log.splitlines() if "serialized" in line]}

out = {}
for e, m in ((8, 1), (8, 16), (8, 64), (16, 1), (16, 64)):  # the tuned tiles (_tc_config)
    (block_n, num_warps, num_stages), _ = mx_decode._tc_config(e, m, 4096, 132)
    const = dict(EBITS=2, MBITS=1 if e == 8 else 3, E=e, P=1 if e == 8 else 3, FOLD=True,
                 NAN_SCALES=False, TILE=64, BLOCK_M=max(16, m), BLOCK_N=block_n, SPLIT=True,
                 HAS_BIAS=False, INTERP_BF16=False)
    out[f"mx_decode_tc_e{e}_m{m}"] = compile_case(mx_decode._mx_linear_decode_tc_kernel, const,
                                                  num_warps, num_stages)
# prefill/extend attention (64-row tiles; decode's 16-row tiles take mma.sync, not wgmma)
const = dict(GROUP=4, HEAD_DIM=128, PAGE_SIZE=16, NUM_SPLITS=1, IS_DECODE=False, BLOCK_Q=16,
             BLOCK_G=4, BLOCK_M=64, BLOCK_N=64, BLOCK_D=128, STORE_LSE=False, STORE_SCORES=False,
             INTERP_BF16=False)
out["paged_attention_prefill"] = compile_case(pa._paged_attention_kernel, const, 4, 3)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled(compile_outside_interpreter):
    return json.loads(compile_outside_interpreter(COMPILE))


CASES = ["mx_decode_tc_e8_m1", "mx_decode_tc_e8_m16", "mx_decode_tc_e8_m64", "mx_decode_tc_e16_m1",
         "mx_decode_tc_e16_m64", "paged_attention_prefill"]


@pytest.mark.parametrize("case", CASES)
def test_wgmma_chains_are_not_serialized(compiled, case):
    result = compiled[case]
    assert result["wgmma"], f"{case}: no wgmma in its sm_90 PTX (the check would be empty)"
    assert not result["serialized"], f"{case}: {result['serialized']}"
