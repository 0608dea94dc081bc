"""Why the folded H2O mass costs the decode kernel more than its bytes (bench/h2o_gpu.py: at
batch 64 the scores add ~2x what writing and reading them back must cost). One GPU call.

The 1B shape's decode attention over 16 layers (own caches, 4k context), batch 1 and 64, CUDA
graph medians, each variant beside its own no-mass baseline (same tiles): the shipped kernel
with float32 and float16 p; float16 with the scores store streaming (cache_modifier ".cs"), with
evict_first, with BLOCK_N 128, with 8 warps; and float16 with the mass kernel skipped (the store
alone). Each variant's mass is checked against the shipped float32 one.

    python bench/tune/h2o_store_probe.py --out $OUT/h2o_store_probe.json
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "lib"))

from gpu_timing import graph_median_us, write_sweep  # noqa: E402

from mxserve.kernels import paged_attention as pa  # noqa: E402

LAYERS, HQ, HKV, D, BS = 16, 32, 8, 64, 16
STORE = ("             s_g.to(row_ptr.dtype.element_ty), mask=(g < GROUP)[:, None] "
         "& (pos < hi)[None, :])")
TILES = "(64, 64 if q.shape[-1] <= 128 else 32, dict(num_warps=4))"
PATCHES = {
    "cs": (STORE, STORE[:-1] + ', cache_modifier=".cs")'),
    "evict_first": (STORE, STORE[:-1] + ', eviction_policy="evict_first")'),
    "block_n128": (TILES, "(64, 128, dict(num_warps=4))"),
    "warps8": (TILES, "(64, 64 if q.shape[-1] <= 128 else 32, dict(num_warps=8))"),
}


class _Skip:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def variant(name: str):
    """kernels/paged_attention.py with one patch, loaded from a temp file."""
    src = inspect.getsource(pa).replace("from .triton_compat import",
                                        "from mxserve.kernels.triton_compat import")
    old, new = PATCHES[name]
    assert src.count(old) == 1, name
    path = os.path.join(tempfile.mkdtemp(), f"pa_{name}.py")
    with open(path, "w") as f:
        f.write(src.replace(old, new))
    spec = importlib.util.spec_from_file_location(f"pa_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def probe(b: int, context: int, width: int, rows: list) -> None:
    gen = torch.Generator(device="cuda").manual_seed(b)
    nblk = b * -(-width // BS)
    caches = [(torch.randn(nblk, BS, HKV, D, generator=gen, device="cuda").bfloat16(),
               torch.randn(nblk, BS, HKV, D, generator=gen, device="cuda").bfloat16())
              for _ in range(LAYERS)]
    tables = torch.randperm(nblk, generator=gen, device="cuda").to(torch.int32).view(b, -1)
    lens = torch.full((b,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(b, HQ, D, generator=gen, device="cuda").bfloat16()
    out, mass = torch.empty_like(q), torch.zeros(b, width, device="cuda")

    def step(with_mass: bool, mod):
        if with_mass:
            mass.zero_()
        for kc, vc in caches:
            mod.paged_decode_attention(q, kc, vc, tables, lens, out=out, max_seq_len=width,
                                       return_attn_mass=with_mass,
                                       mass=mass if with_mass else None)

    step(True, pa)
    want = mass.clone()
    variants = [("fp32", pa, torch.float32), ("fp16", pa, torch.float16)] + \
        [(name, variant(name), torch.float16) for name in PATCHES]
    for name, mod, dtype in variants:
        mod.SCORES_DTYPE = dtype
        step(True, mod)
        row = {"batch": b, "variant": name,
               "rel_err": float((mass - want).abs().max() / want.abs().max()),
               "none_us": graph_median_us(lambda m=mod: step(False, m), rep=200),
               "folded_us": graph_median_us(lambda m=mod: step(True, m), rep=200)}
        if name == "fp16":
            real, mod._decode_mass_kernel = mod._decode_mass_kernel, _Skip()
            try:
                row["store_only_us"] = graph_median_us(lambda m=mod: step(True, m), rep=200)
            finally:
                mod._decode_mass_kernel = real
        row["folded_over_none"] = round(row["folded_us"] / row["none_us"], 4)
        mod.SCORES_DTYPE = torch.float32
        print(row, flush=True)
        rows.append(row)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--context", type=int, default=4000)
    args = parser.parse_args()
    t0, rows = time.time(), []
    for b in (1, 64):
        probe(b, args.context, args.context + 160, rows)
        torch.cuda.empty_cache()
    write_sweep(args.out, rows, t0, context=args.context)


if __name__ == "__main__":
    main()
