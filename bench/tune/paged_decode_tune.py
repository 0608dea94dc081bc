"""Tile and split sweep for the paged decode attention kernel (kernels/paged_attention.py) on the
GPU, at the issue's two shapes (32 query / 8 KV heads, head dim 128, page 16, bf16): batch 64 x
4096 tokens and batch 1 x 4096 * 8. Each config's output is checked against SDPA on the same K/V
held contiguously before it is timed; SDPA's time is the baseline (the faster of its GQA and
expanded-heads forms). Picks the config with the best geometric-mean ratio to SDPA.

    python bench/tune/paged_decode_tune.py --out bench/results/paged_decode_tune.json
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import pathlib
import platform
import sys

import torch
import triton

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # bench/'s benchmarks
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "lib"))  # and helpers
from kernels_gpu import ATTN_SHAPES as SHAPES  # noqa: E402 (put on the path above)
from kernels_gpu import attention_case, bench_ms  # noqa: E402 (put on the path above)

from mxserve.kernels import paged_attention as pa

BLOCK_NS, WARPS, STAGES, PROGRAMS_PER_SM = [32, 64, 128], [2, 4, 8], [2, 3, 4], [1, 2, 4, 8]


def run_config(case: dict, seq_len: int, block_n: int, warps: int, stages: int,
               per_sm: int) -> dict | None:
    def tiles(q, group, is_decode):
        bq, bg, bm, _, _ = orig_tiles(q, group, is_decode)
        return bq, bg, bm, block_n, dict(num_warps=warps, num_stages=stages)

    def splits(num_seqs, num_kv_heads, max_seq_len, device):
        programs, target = num_seqs * num_kv_heads, per_sm * pa._num_sms(device)
        if programs >= target:  # (the kernel now splits only below 2 an SM; see _decode_splits)
            return 1
        return max(1, min(triton.cdiv(target, programs),
                          triton.cdiv(max_seq_len, pa.MIN_SPLIT_TOKENS), pa.MAX_SPLITS))

    pa._tiles, pa._decode_splits = tiles, splits
    args = case["args"]
    out = torch.full_like(args[0], float("nan"))
    try:
        pa.paged_decode_attention(*args, out=out, max_seq_len=seq_len)
        err = (out.float() - case["ref"]).abs().max().item()
        if not err < 2e-2:
            return dict(error=f"max err {err}")
        ms = bench_ms(lambda: pa.paged_decode_attention(*args, out=out, max_seq_len=seq_len))
    except Exception as e:  # e.g. out of shared memory for a tile
        return dict(error=str(e)[:200])
    finally:
        pa._tiles, pa._decode_splits = orig_tiles, orig_splits
    return dict(ms=ms, err=err, vs_sdpa=case["sdpa_ms"] / ms,
                TBps=case["kv_bytes"] / (ms * 1e-3) / 1e12)


orig_tiles, orig_splits = pa._tiles, pa._decode_splits


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/results/paged_decode_tune.json")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    cases = {shape: attention_case(*shape, gen) for shape in SHAPES}
    rows = []
    for block_n, warps, stages, per_sm in itertools.product(BLOCK_NS, WARPS, STAGES,
                                                            PROGRAMS_PER_SM):
        row = dict(BLOCK_N=block_n, num_warps=warps, num_stages=stages, programs_per_sm=per_sm)
        for (batch, seq_len), case in cases.items():
            row[f"{batch}x{seq_len}"] = run_config(case, seq_len, block_n, warps, stages, per_sm)
        rows.append(row)
        print(json.dumps(row), flush=True)
    ok = [r for r in rows if all("ms" in r[f"{b}x{s}"] for b, s in SHAPES)]

    def score(r):
        return math.exp(sum(math.log(r[f"{b}x{s}"]["vs_sdpa"]) for b, s in SHAPES) / len(SHAPES))

    best = max(ok, key=score)
    current = next(r for r in ok if (r["BLOCK_N"], r["num_warps"], r["num_stages"],
                                     r["programs_per_sm"]) == (64, 4, 3, 2))  # before the sweep
    result = dict(
        bench="paged_decode_tune", device=torch.cuda.get_device_name(),
        date=datetime.date.today().isoformat(),
        versions=dict(python=platform.python_version(), torch=torch.__version__,
                      triton=triton.__version__),
        command="python bench/tune/paged_decode_tune.py", shapes=SHAPES,
        sdpa_ms={f"{b}x{s}": cases[(b, s)]["sdpa_ms"] for b, s in SHAPES},
        best=best, current=current, rows=rows)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for name, r in (("current (64, 4 warps, 3 stages, 2/SM)", current), ("best", best)):
        print(name, {k: (v if not isinstance(v, dict) else
                         f"{v['ms'] * 1e3:.1f}us {v['vs_sdpa']:.2f}x SDPA {v['TBps']:.2f} TB/s")
                     for k, v in r.items()})
    print("SDPA", {k: f"{v * 1e3:.1f}us" for k, v in result["sdpa_ms"].items()})


if __name__ == "__main__":
    main()
