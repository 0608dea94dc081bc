"""Probe (issue 25): does the decode attention kernel's register count, and so its CTAs an SM
and waves at batch 64, explain part of the folded mass's extra? Per variant (no mass / folded)
the compiled kernel's registers and spills, and the 16-layer decode attention graph (as
h2o_gpu.py's kernel section) with the default registers and capped by `maxnreg`.

Run on the GPU machine:  python bench/tune/h2o_regs_probe.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "lib"))

import h2o_gpu  # noqa: E402
from gpu_timing import header  # noqa: E402

from mxserve.kernels import paged_attention as pa  # noqa: E402
from mxserve.kernels.paged_attention import (  # noqa: E402
    _decode_splits,
    paged_decode_attention,
    paged_decode_attention_torch,
)
from mxserve.worker.model.dummy import DUMMY_MODELS  # noqa: E402

TILES = pa._tiles


def with_maxnreg(maxnreg):
    def tiles(q, group, is_decode):
        out = TILES(q, group, is_decode)
        if maxnreg:
            out[4]["maxnreg"] = maxnreg
        return out
    return tiles


def compiled(fn) -> list:
    found = []

    def walk(x):
        if hasattr(x, "asm") and hasattr(x, "metadata"):
            found.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (tuple, list)):
            for v in x:
                walk(v)
    for v in fn.device_caches.values():
        walk(v)
    return found


def kernel_info(k) -> dict:
    if hasattr(k, "_init_handles"):
        k._init_handles()
    return {"n_regs": getattr(k, "n_regs", None), "n_spills": getattr(k, "n_spills", None),
            "shared": getattr(k.metadata, "shared", None),
            "store_scores": "tile_max" in str(getattr(k, "src", "")) or None}


def row(b: int, context: int, width: int, caps: list) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    cfg = DUMMY_MODELS[h2o_gpu.SHAPE]
    layers, hq, hkv, d, bs = cfg["num_hidden_layers"], cfg["num_attention_heads"], \
        cfg["num_key_value_heads"], cfg["head_dim"], 16
    nblk = b * -(-width // bs)
    caches = [(torch.randn(nblk, bs, hkv, d, generator=gen, device="cuda").bfloat16(),
               torch.randn(nblk, bs, hkv, d, generator=gen, device="cuda").bfloat16())
              for _ in range(layers)]
    tables = torch.randperm(nblk, generator=gen, device="cuda").to(torch.int32).view(b, -1)
    lens = torch.full((b,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(b, hq, d, generator=gen, device="cuda").bfloat16()
    out = torch.empty_like(q)
    mass = torch.zeros(b, width, device="cuda")
    ref_out, want = paged_decode_attention_torch(q, *caches[0], tables, lens,
                                                 return_attn_mass=True, max_seq_len=width)

    def attend(kc, vc, variant):
        if variant == "none":
            paged_decode_attention(q, kc, vc, tables, lens, out=out, max_seq_len=width)
        else:
            paged_decode_attention(q, kc, vc, tables, lens, out=out, max_seq_len=width,
                                   return_attn_mass=True, mass=mass)

    def step(variant):
        if variant != "none":
            mass.zero_()
        for kc, vc in caches:
            attend(kc, vc, variant)

    res = {"batch": b, "num_splits": _decode_splits(b, hkv, width, q.device)}
    for cap in caps:
        pa._tiles = with_maxnreg(cap)
        try:
            for variant in ("none", "folded"):
                before = {id(k) for k in compiled(pa._paged_attention_kernel)}
                mass.zero_()
                attend(*caches[0], variant)
                torch.cuda.synchronize()
                new = [k for k in compiled(pa._paged_attention_kernel) if id(k) not in before]
                key = f"{variant}_cap{cap or 0}"
                res[key + "_kernels"] = [kernel_info(k) for k in new]
                res[key + "_out_err"] = float((out.float() - ref_out.float()).abs().max())
                if variant == "folded":
                    res[key + "_mass_err"] = float((mass - want).abs().max())
                res[key + "_us"] = round(h2o_gpu._graph_median_ms(lambda v=variant: step(v))
                                         * 1e3, 2)
            res[f"ratio_cap{cap or 0}"] = round(res[f"folded_cap{cap or 0}_us"]
                                                / res[f"none_cap{cap or 0}_us"], 4)
        finally:
            pa._tiles = TILES
        print({k: v for k, v in res.items() if not k.endswith("_kernels")}, flush=True)
    torch.cuda.empty_cache()
    return res


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--caps", default="0,128,96")
    args = parser.parse_args()
    caps = [int(c) or None for c in args.caps.split(",")]
    result = header("h2o_regs_probe")
    result["command"] = "python bench/tune/h2o_regs_probe.py " + " ".join(sys.argv[1:])
    context, width = 4000, 4000 + 32 + 96 + 32
    result["rows"] = [row(b, context, width, caps) for b in (64, 1)]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "h2o_regs_probe.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["rows"], indent=1))


if __name__ == "__main__":
    main()
