"""MX-compressed KV transfer payloads (kv_transfer.encoding) on CPU: what they save on the wire,
what they cost to encode and decode, and what they do to outputs. SmolLM2-135M-Instruct, one
process.

- Size: bytes a block on the wire for raw (the cache's bytes), mxfp8 and mxfp6, fp32 and bf16
  caches.
- Cost: encode and decode rates (GB/s of raw cache bytes) over the 128 blocks of a 2,048-token
  prefix; from them and the wire sizes, the time to move those blocks over links of 1 to 100
  Gbit/s (bytes / link + encode + decode, not overlapped: the worst case) and which encoding is
  faster there.
- Outputs: `--prompts` KJV passages of `--prefix-tokens` tokens (+ a 16-token tail) cached on
  a holder engine; each prefix moved block by block (Exporter -> Importer with the encoding)
  into a fresh receiver, which then decodes `--max-tokens` greedy tokens taking the prefix as
  cached. Against the raw move (itself checked equal to the holder's own answer): prompts with
  identical output, mean tokens before the first difference, and the moved KV's relative error.

Run: python bench/kv_transfer_mx.py [--out bench/results/kv_transfer_mx.json]  (~5 min)
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lib.revision import head_commit, write_result  # noqa: E402
from mx_quality import kjv_tokens  # noqa: E402

from mxserve import LLM, SamplingParams  # noqa: E402
from mxserve.worker.kv_transfer import (  # noqa: E402
    ENCODINGS,
    Exporter,
    Importer,
    KVPort,
    decode,
    encode,
    engine_block_io,
    wire_bytes_per_block,
)

ENGINE = dict(num_threads=1, num_kv_blocks=600, max_model_len=4096,
              max_num_batched_tokens=2048, load_progress=False)
LINKS_GBIT = (1, 10, 25, 100)
TAIL = 16


def sizes_and_rates(reps: int) -> dict:
    """Wire bytes a block per dtype and encoding; encode / decode GB/s over 128 blocks."""
    out = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(dtype=dtype, **ENGINE)
        io, layout = engine_block_io(llm.engine)
        n = 128
        raw = torch.randn(n * layout.bytes_per_block // torch.empty((), dtype=getattr(
            torch, dtype)).element_size(), generator=torch.Generator().manual_seed(0)).to(
            getattr(torch, dtype)).view(torch.uint8).numpy().tobytes()
        rows = {}
        for encoding in ENCODINGS:
            wire = encode(raw, dtype, encoding)
            enc, dec = [], []
            for _ in range(reps):
                t = time.perf_counter()
                encode(raw, dtype, encoding)
                enc.append(time.perf_counter() - t)
                t = time.perf_counter()
                decode(wire, dtype, encoding)
                dec.append(time.perf_counter() - t)
            e, d = statistics.median(enc), statistics.median(dec)
            rows[encoding] = dict(
                wire_bytes_per_block=wire_bytes_per_block(layout, encoding),
                ratio=round(layout.bytes_per_block / wire_bytes_per_block(layout, encoding), 3),
                encode_gb_s=None if encoding == "raw" else round(len(raw) / e / 1e9, 3),
                decode_gb_s=None if encoding == "raw" else round(len(raw) / d / 1e9, 3),
                encode_s=0.0 if encoding == "raw" else round(e, 4),
                decode_s=0.0 if encoding == "raw" else round(d, 4))
            rows[encoding]["links_s"] = {
                f"{g}gbit": round(n * rows[encoding]["wire_bytes_per_block"] * 8 / (g * 1e9)
                                  + rows[encoding]["encode_s"] + rows[encoding]["decode_s"], 4)
                for g in LINKS_GBIT}
        out[dtype] = dict(bytes_per_block=layout.bytes_per_block, blocks=n, encodings=rows,
                          fastest={f"{g}gbit": min(rows, key=lambda k: rows[k]["links_s"][
                              f"{g}gbit"]) for g in LINKS_GBIT})
        llm.shutdown()
    return out


def move(holder: LLM, receiver: LLM, prompt: list[int], encoding: str) -> tuple[int, float]:
    """Move the prompt's cached full blocks from holder to receiver in `encoding`; returns the
    blocks moved and the moved KV's median relative error."""
    (h_io, layout), (r_io, _) = engine_block_io(holder.engine), engine_block_io(receiver.engine)
    hashes = receiver.engine.make_request(prompt).block_hashes[:(len(prompt) - 1) // 16]
    h_port, r_port = KVPort(holder.engine.kv), KVPort(receiver.engine.kv)
    pinned, reservation = h_port.pin(hashes), r_port.reserve(hashes, len(hashes))
    importer = Importer(r_io, layout, reservation, encoding=encoding)
    importer.accept(layout, len(pinned.block_ids), wire_bytes_per_block(layout, encoding))
    for chunk in Exporter(h_io, layout, pinned, 4 << 20, encoding=encoding).chunks():
        importer.add(*chunk)
    importer.finish()
    held = torch.frombuffer(bytearray(h_io.read(pinned.block_ids)), dtype=torch.float32)
    moved = torch.frombuffer(bytearray(r_io.read(reservation.block_ids)), dtype=torch.float32)
    error = ((moved - held).abs() / held.abs().clamp(min=1e-6)).median().item()
    h_port.release(pinned)
    r_port.commit(reservation, importer.close())
    return len(hashes), error


def output_effect(args) -> dict:
    from mxserve.worker.model.loader import open_checkpoint

    tokens = kjv_tokens(open_checkpoint(None).tokenizer, args.prompts * (args.prefix_tokens
                                                                         + TAIL))
    step = args.prefix_tokens + TAIL
    prompts = [tokens[i * step:(i + 1) * step] for i in range(args.prompts)]
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    holder = LLM(dtype="float32", **ENGINE)
    own = [o.token_ids for o in holder.generate(prompts, greedy)]  # caches every prefix
    out = {}
    for encoding in ENCODINGS:
        receiver = LLM(dtype="float32", **ENGINE)
        got, errors, cached = [], [], []
        for prompt in prompts:
            _, error = move(holder, receiver, prompt, encoding)
            (o,) = receiver.generate([prompt], greedy)
            got.append(o.token_ids)
            errors.append(error)
            cached.append(o.num_cached_tokens)
            receiver.engine.kv.reset_prefix_cache()
        receiver.shutdown()
        out[encoding] = dict(outputs=got, cached_tokens=cached,
                             kv_relative_error_median=round(statistics.median(errors), 5))
    reference = out["raw"]["outputs"]
    for r in out.values():
        first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(y))
                 for x, y in zip(r.pop("outputs"), reference)]
        r.update(identical=sum(f == args.max_tokens for f in first), of=len(first),
                 mean_tokens_before_first_difference=round(statistics.fmean(first), 1))
    out["raw"]["equals_holders_own_output"] = reference == own
    return out


def markdown(result: dict) -> str:
    c = result["config"]
    lines = [f"# MX-compressed KV transfer payloads (CPU, {result['date']}, {result['commit']})",
             "", f"`{result['command']}`", "",
             "Wire size and the cost of encoding, per cache dtype (128 blocks, a 2,048-token "
             "prefix of SmolLM2-135M):", "",
             "| dtype | encoding | bytes a block | vs raw | encode GB/s | decode GB/s | "
             + " | ".join(f"{g} Gbit/s s" for g in LINKS_GBIT) + " |",
             "|---|---|---|---|---|---|" + "---|" * len(LINKS_GBIT)]
    for dtype, d in result["sizes"].items():
        for encoding, r in d["encodings"].items():
            lines.append(f"| {dtype} | {encoding} | {r['wire_bytes_per_block']:,} | "
                         f"{r['ratio']}x | {r['encode_gb_s'] or '-'} | {r['decode_gb_s'] or '-'}"
                         " | " + " | ".join(str(r["links_s"][f"{g}gbit"]) for g in LINKS_GBIT)
                         + " |")
        lines.append(f"| {dtype} | fastest | | | | | " + " | ".join(
            d["fastest"][f"{g}gbit"] for g in LINKS_GBIT) + " |")
    lines += ["", f"Effect on outputs (fp32 cache, {c['prompts']} KJV prefixes of "
                  f"{c['prefix_tokens']} tokens moved, then {c['max_tokens']} greedy tokens; "
                  "against the raw move):", "",
              "| encoding | identical outputs | mean tokens before a difference | "
              "moved KV median relative error |", "|---|---|---|---|"]
    for encoding, r in result["outputs"].items():
        lines.append(f"| {encoding} | {r['identical']} / {r['of']} | "
                     f"{r['mean_tokens_before_first_difference']} | "
                     f"{r['kv_relative_error_median']} |")
    lines += ["", f"Raw move equals the holder's own output: "
                  f"{result['outputs']['raw']['equals_holders_own_output']}.", ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prefix-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", default="bench/results/kv_transfer_mx.json")
    args = p.parse_args()
    torch.manual_seed(0)
    result = dict(bench="kv_transfer_mx", device=f"cpu ({platform.processor() or 'x86_64'}, "
                                                f"{os.cpu_count()} cores)",
                  date=datetime.date.today().isoformat(), commit=head_commit(),
                  versions=dict(python=platform.python_version(), torch=torch.__version__),
                  command=" ".join(["python", *sys.argv]),
                  config={k: v for k, v in vars(args).items() if k != "out"})
    result["sizes"] = sizes_and_rates(args.reps)
    result["outputs"] = output_effect(args)
    write_result(args.out, result, markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
