"""What bench/engine_gpu.py's sections share: the dummy engines, the sampling settings,
percentiles and the bytes a decode step reads (also bench/gemv_gpu.py's roofline)."""

from __future__ import annotations

import gc
import json
import os
import statistics
import time

import numpy as np
import torch

from mxserve import LLM
from mxserve.worker.model.dummy import DUMMY_MODELS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


GREEDY = dict(temperature=0.0, ignore_eos=True)


TOP_P = dict(temperature=0.7, top_p=0.9, ignore_eos=True)


def pct(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)), 3)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free() -> None:
    """Give the memory of engines the caller has dropped back to the device."""
    gc.unfreeze()  # make_llm froze the heap; let the dropped engines go
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def make_llm(args, shape: str, **options) -> tuple[LLM, float]:
    t0 = time.perf_counter()
    llm = LLM(model=shape, load_format="dummy", dtype="bfloat16", load_progress=False,
              device=args.device, max_model_len=args.max_model_len, **options)
    sync()
    gc.collect()
    gc.freeze()  # as a Serve worker does (cluster/worker.py): no full collections of the model
    return llm, round(time.perf_counter() - t0, 2)


def hf_config_dict(shape: str) -> dict:
    if shape in DUMMY_MODELS:
        return DUMMY_MODELS[shape]
    with open(os.path.join(shape, "config.json")) as f:
        return json.load(f)


def step_bytes(llm, bits: float, head_bits: float = 16) -> int:
    """Weight bytes one decode step reads: decoder linears at `bits` a weight (+ an E8M0 scale
    per 32 when MX) and the LM head at `head_bits` (bf16 unless `quantize_lm_head`); norms and
    the embedding row are negligible."""
    cfg = llm.engine.model_config
    per_layer = cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * cfg.hidden_size \
        + 3 * cfg.hidden_size * cfg.intermediate_size
    linears = per_layer * cfg.num_hidden_layers
    return int((linears * bits + cfg.vocab_size * cfg.hidden_size * head_bits) / 8)


def capture_s(llm) -> float | None:
    graphs = llm.engine.runner.graphs
    return None if graphs is None else round(graphs.capture_seconds, 2)


def mean_or_none(values: list[float]) -> float | None:
    return round(statistics.mean(values), 4) if values else None


def graph_replays(llm) -> int | None:
    graphs = llm.engine.runner.graphs
    return None if graphs is None else graphs.num_replays
