"""KV transfer's parts on the H200 (issue 26), for the 1B- and 8B-shaped dummy bf16 models
(llama-3.2-1b, llama-3-8b): what a pull of a 2,048-token prefix costs on each side of the link
and what computing it costs instead, so the link speed where pulling starts to pay follows.

Per shape, one engine (bf16, prefix caching off, eager), side by side:
- prefill: time to first token of a 2,048-token random prompt (max_tokens 1), median of 5;
  the recompute a pull replaces;
- export (worker/kv_transfer.BlockIO.read: gather on the GPU, copy to the host, to bytes) and
  import (BlockIO.write: bytes to the GPU, scatter) of the prompt's 128 blocks, GB/s, median of
  5, checked: what is imported into other blocks reads back equal;
- the parts: the gather alone (on the GPU), the device-to-host copy of the gathered bytes into
  pinned memory, XXH3-64 on the host, WSUM64 on the GPU (kernels/checksum.py, checked equal to
  its torch reference on the host);
- chunked, as a pull streams them (chunks of 2 MiB): export + checksum and checksum + import
  with XXH3-64 on the host vs WSUM64 on the GPU (BlockIO.read_summed / write(wsum=...), what a
  GPU pool's raw payloads use), GB/s, median of 5;
- break-even: the link rate at which moving the bytes takes as long as the prefill, and the
  pull time (export + link + import, not overlapped) at 10, 100 and 400 Gbit/s.

Run on the GPU machine:  python bench/kv_transfer_gpu.py --out $OUT   (~2 min)
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))

from gpu_timing import header  # noqa: E402
from revision import write_result  # noqa: E402

from mxserve import LLM, SamplingParams  # noqa: E402
from mxserve.kernels.checksum import wsum64, wsum64_torch  # noqa: E402
from mxserve.worker.kv_transfer import BlockIO, checksum, engine_layout  # noqa: E402

SHAPES = ("llama-3.2-1b", "llama-3-8b")
PROMPT = 2048
LINKS_GBIT = (10, 100, 400)


def _median_s(fn, reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def shape_section(shape: str) -> dict:
    llm = LLM(model=shape, load_format="dummy", dtype="bfloat16", load_progress=False,
              enable_prefix_caching=False, enforce_eager=True, max_model_len=PROMPT + 64,
              max_num_batched_tokens=PROMPT, kv_cache_memory_gb=8.0)
    engine, rng = llm.engine, np.random.default_rng(0)
    vocab = engine.model_config.vocab_size
    first = SamplingParams(temperature=0, max_tokens=1)
    prefill = _median_s(lambda: llm.generate([rng.integers(10, vocab - 10, PROMPT).tolist()],
                                             first))
    caches = [c for pair in engine.runner.kv_caches for c in pair]
    io, layout = BlockIO(caches), engine_layout(engine.model_config.model_id, caches)
    n = PROMPT // layout.block_size
    src, dst = list(range(n)), list(range(n, 2 * n))
    for c in caches:  # random contents, not zeros
        c[:2 * n].normal_()
    data = io.read(src)
    io.write(dst, data)
    ok = all(torch.equal(c[:n], c[n:2 * n]) for c in caches)
    num_bytes = len(data)
    export_s = _median_s(lambda: io.read(src))
    import_s = _median_s(lambda: io.write(dst, data))
    ids = torch.tensor(src, device="cuda")
    gathered = torch.empty(len(caches), n, *caches[0].shape[1:], dtype=caches[0].dtype,
                           device="cuda")

    def gather():
        for i, c in enumerate(caches):
            torch.index_select(c, 0, ids, out=gathered[i])

    pinned = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
    gather_s = _median_s(gather)
    d2h_s = _median_s(lambda: pinned.copy_(gathered))
    checksum_s = _median_s(lambda: checksum(data))
    wsum_s = _median_s(lambda: wsum64(gathered))
    wsum_ok = wsum64(gathered) == wsum64_torch(gathered.cpu())
    per = max(1, (2 << 20) // layout.bytes_per_block)
    chunks = [(src[i:i + per], dst[i:i + per]) for i in range(0, n, per)]
    payloads = [io.read_summed(a) for a, _ in chunks]  # (bytes, WSUM64)

    def export(summed: bool):
        for a, _ in chunks:
            if summed:
                io.read_summed(a)
            else:
                checksum(io.read(a))

    def import_(summed: bool):
        for (_, b), (payload, digest) in zip(chunks, payloads):
            if summed:
                assert io.write(b, payload, digest)
            else:
                checksum(payload)
                io.write(b, payload)

    chunked = {f"{way}_{kind}_gb_s": round(num_bytes / 1e9 / _median_s(
        lambda f=fn, k=kind: f(k == "wsum64_gpu")), 2)
        for way, fn in (("export", export), ("import", import_))
        for kind in ("xxh3_host", "wsum64_gpu")}
    gb = num_bytes / 1e9
    row = dict(shape=shape, bytes_per_block=layout.bytes_per_block, blocks=n, bytes=num_bytes,
               roundtrip_equal=ok, prefill_2k_s=round(prefill, 5),
               export_gb_s=round(gb / export_s, 2), import_gb_s=round(gb / import_s, 2),
               gather_gpu_gb_s=round(gb / gather_s, 1), d2h_pinned_gb_s=round(gb / d2h_s, 1),
               checksum_host_gb_s=round(gb / checksum_s, 2),
               checksum_gpu_gb_s=round(gb / wsum_s, 1), wsum64_gpu_equals_reference=wsum_ok,
               chunk_blocks=per, chunked=chunked,
               break_even_link_gb_s=round(gb / prefill, 2))
    for gbit in LINKS_GBIT:
        pull = export_s + gb / (gbit / 8) + import_s
        row[f"pull_s_at_{gbit}gbit"] = round(pull, 4)
        row[f"pull_vs_prefill_at_{gbit}gbit"] = round(prefill / pull, 2)
    return row


def markdown(result: dict) -> str:
    lines = [f"# KV transfer parts on the GPU ({result['device']}, {result['date']})", "",
             "2,048-token prefix (128 blocks), bf16 dummy weights. GB/s are of the KV bytes.", "",
             "| shape | MB | prefill s | export GB/s | import GB/s | gather GB/s | D2H GB/s | "
             "XXH3 host GB/s | break-even link GB/s | pull vs prefill 10/100/400 Gbit |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        ratios = "/".join(str(r[f"pull_vs_prefill_at_{g}gbit"]) for g in LINKS_GBIT)
        lines.append(f"| {r['shape']} | {r['bytes'] / 1e6:.0f} | {r['prefill_2k_s']} | "
                     f"{r['export_gb_s']} | {r['import_gb_s']} | {r['gather_gpu_gb_s']} | "
                     f"{r['d2h_pinned_gb_s']} | {r['checksum_host_gb_s']} | "
                     f"{r['break_even_link_gb_s']} | {ratios} |")
    lines += ["", "Checksums, and a pull's export and import in 2 MiB chunks (GB/s):", "",
              "| shape | WSUM64 GPU | = reference | export XXH3 host | export WSUM64 GPU | "
              "import XXH3 host | import WSUM64 GPU |", "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        c = r["chunked"]
        lines.append(f"| {r['shape']} | {r['checksum_gpu_gb_s']} | "
                     f"{r['wsum64_gpu_equals_reference']} | {c['export_xxh3_host_gb_s']} | "
                     f"{c['export_wsum64_gpu_gb_s']} | {c['import_xxh3_host_gb_s']} | "
                     f"{c['import_wsum64_gpu_gb_s']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench/results")
    args = p.parse_args()
    rows = []
    for shape in SHAPES:
        rows.append(shape_section(shape))
        print(rows[-1], flush=True)
        gc.collect()  # the engine of the shape before goes with its section's frame
        torch.cuda.empty_cache()
    result = {**header("kv_transfer_gpu"), "rows": rows}
    write_result(os.path.join(args.out, "kv_transfer_gpu.json"), result, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
