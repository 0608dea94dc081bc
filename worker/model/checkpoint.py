"""An opened checkpoint, whatever its format: its ModelConfig, tokenizer, generation defaults and a
lazy stream of its tensors under Hugging Face Llama names (loader.py opens one)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from tqdm import tqdm

from mxserve.api.tokenizer import Tokenizer
from mxserve.worker.model.config import ModelConfig

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TensorSlice:
    """Rows (dim 0) or columns (dim 1) [start, stop) of a tensor: what one tensor-parallel rank
    holds of it (worker/model/tp.py)."""

    dim: int
    start: int
    stop: int

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This slice of a full tensor (a view)."""
        return full.narrow(self.dim, self.start, self.stop - self.start)


# HF name -> the slice of it to read (None: the whole tensor)
SliceFor = Callable[[str], "TensorSlice | None"]


class CheckpointSource(Protocol):
    """Where a checkpoint's tensors come from: safetensors, GGUF, or dummy.py's random ones."""

    def tensors(self, slice_for: SliceFor | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) once for each of `expected_tensor_names(config)`, in file order;
        with `slice_for`, only each tensor's slice, read without the rest where the format
        allows."""


@dataclass
class Checkpoint:
    """An opened, fully validated checkpoint. `source` streams its tensors (see `weights`)."""

    config: ModelConfig
    tokenizer: Tokenizer | None  # None only for dummy weights without tokenizer files (dummy.py)
    # Sampling defaults: a subset of GENERATION_KEYS from generation_config.json ({} if none;
    # the packaged SmolLM2's are SMOLLM2_GENERATION_DEFAULTS).
    generation_defaults: dict
    path: str
    source: CheckpointSource = field(repr=False)
    quantization: str | None = None  # an MX checkpoint's format ("mxfp4", ...), else None
    # A GGUF's decoder linears as stored: the most bits per weight of their types (4 for Q4_0 /
    # Q4_1, 8 for Q8_0, 16 for F16); None for float or MX checkpoints. The CPU engine keeps 4-bit
    # ones 4-bit (`EngineConfig.cpu_int4`).
    linear_bits: int | None = None

    def weights(self, progress: bool = True, slice_for: SliceFor | None = None
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, tensor) once for each of `expected_tensor_names(config)`, lazily, in
        file order; with `slice_for` (a tensor-parallel rank's), each tensor's slice only.

        safetensors tensors keep their stored dtype (an MX checkpoint's linears: MXTensors); GGUF
        tensors are dequantized to float32 and their q/k rows put back in Hugging Face's
        rotate-half order. A tqdm bar goes to stderr (where that is not a terminal, e.g. a Ray
        replica's log, a line every few seconds)."""
        tty = sys.stderr.isatty()
        with tqdm(total=len(expected_tensor_names(self.config)), unit="tensor",
                  file=sys.stderr if tty else _Lines(sys.stderr), mininterval=0.1 if tty else 3,
                  desc=f"loading {os.path.basename(self.path)}", disable=not progress) as bar:
            for name, tensor in self.source.tensors(slice_for):
                yield name, tensor
                bar.update(1)


class _Lines:
    """A stream for tqdm that writes each update as a whole line (logs have no carriage
    return: a bar redrawn in place would reach them as one line at the end)."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        text = text.strip("\r\n")
        if text:
            self.stream.write(text + "\n")

    def flush(self) -> None:
        self.stream.flush()


def expected_tensor_names(config: ModelConfig) -> list[str]:
    """The HF names a model of `config` needs (lm_head only when untied), in model order."""
    names = ["model.embed_tokens.weight"]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        names += [f"{p}self_attn.{x}_proj.weight" for x in "qkvo"]
        names += [f"{p}self_attn.{x}_proj.bias" for x in "qkv"] if config.attention_bias else []
        names += [f"{p}mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        names += [f"{p}input_layernorm.weight", f"{p}post_attention_layernorm.weight"]
    names.append("model.norm.weight")
    return names if config.tie_word_embeddings else [*names, "lm_head.weight"]


def torch_module():
    """torch, imported when tensors are read: opening a checkpoint for its config and tokenizer
    (as the router does) needs none."""
    import torch

    return torch


def set_default_permissions(path: str) -> None:
    """Give `path` the permissions a file opened for writing gets (0666 less the umask):
    safetensors' save_file creates its file private (0600)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)
