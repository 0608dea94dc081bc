"""The linear layers that shard over a tensor-parallel group (tp.py).

World size 1 is the trivial case: every layer holds the whole weight and no collective runs.
With size > 1 (the group's process group: NCCL on GPU, gloo on CPU), column-parallel layers hold
a slice of the output features and row-parallel layers a slice of the input features followed by
an all-reduce, so one attention block or MLP costs one all-reduce (Megatron's split). Layers load
this rank's slice of each weight only (the checkpoint reads it: checkpoint.TensorSlice); which
slice that is, the model says (llama.py `tensor_slice`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mxserve.kernels import cpu_linear
from mxserve.kernels.options import DEFAULT_GEMV, GemvOptions
from mxserve.worker.model.int4 import (
    Int4Weight,
    int4_linear,
    int4_supported,
    quantize_int4,
)
from mxserve.worker.model.tp import TPGroup


def can_pack_for_cpu(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether `pack_for_cpu` applies: bf16 weights on a CPU whose oneDNN runs bf16 natively."""
    return (torch.device(device).type == "cpu" and dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _pack(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked layout of a [out, in] bf16 weight: the same numbers, multiplied faster
    than the dense weight, more so at more tokens (bench/results/engine_cpu.md)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, int4: Int4Weight | None,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T (+ b) from the packed copies: int4 for a few rows (int4.py), else oneDNN bf16."""
    if int4 is not None and x.shape[0] <= int4.max_rows:
        return int4_linear(x, int4, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  gemv_options: GemvOptions, out_dtype: torch.dtype | None = None
                  ) -> torch.Tensor:
    """x @ weight.T (+ bias), in out_dtype (x's, or float32: the same values): on CUDA for a few
    rows (decode, `gemv_options`) the Triton GEMV of kernels/gemv.py, faster there than cuBLAS
    (imported only then: CPU installs need not have Triton); F.linear otherwise."""
    if x.is_cuda:
        from mxserve.kernels import gemv

        if gemv.preferred(x, weight, gemv_options):
            return gemv.gemv(x, weight, bias, out_dtype=out_dtype, pdl=gemv_options.pdl)
    y = F.linear(x, weight, bias)
    return y if out_dtype is None else y.to(out_dtype)


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b) with W's output rows split over ranks; the output stays sharded.

    Several logical projections may be fused (qkv, gate_up): `local_sizes` lists this rank's rows
    of each and `load(shard_index, w)` places each one's rank slice in its part of the fused
    weight.
    `quant` (an MX element format, e.g. "e2m1"): the weight is one MXWeight (mx_layers.py) for
    the fused layer; each shard's packed rows go to its part (MX blocks run along K, so rows
    concatenate exactly). `finish_loading()` runs once after the last `load`. `gemv_options`:
    when CUDA decode takes kernels/gemv.py.
    """

    def __init__(self, in_features: int, local_sizes: list[int], bias: bool, tp: TPGroup,
                 dtype: torch.dtype, device: torch.device | str = "cpu",
                 quant: str | None = None,
                 gemv_options: GemvOptions = DEFAULT_GEMV) -> None:
        super().__init__()
        self.tp = tp
        self.quant = quant
        self.gemv_options = gemv_options
        self.local_sizes = list(local_sizes)
        out = sum(self.local_sizes)
        self.weight = _weight(out, in_features, dtype, device, quant, gemv_options)
        self.bias = (nn.Parameter(torch.zeros(out, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)
        self.packed: torch.Tensor | None = None  # pack_for_cpu
        self.int4: Int4Weight | None = None  # pack_for_cpu(int4=True)

    def _rows(self, shard_index: int) -> slice:
        start = sum(self.local_sizes[:shard_index])
        return slice(start, start + self.local_sizes[shard_index])

    def load(self, shard_index: int, weight: torch.Tensor) -> None:
        """weight: this rank's [local_sizes[shard_index], in_features] (a tensor or MXTensor)."""
        if self.quant:
            return self.weight.load(self._rows(shard_index), weight)
        self.weight.data[self._rows(shard_index)].copy_(weight)

    def load_bias(self, shard_index: int, bias: torch.Tensor) -> None:
        if self.bias is None:
            raise ValueError("checkpoint has a bias for a layer built without one")
        self.bias.data[self._rows(shard_index)].copy_(bias)

    def finish_loading(self) -> None:
        if self.quant:
            self.weight.finish_loading()

    def pack_for_cpu(self, int4: bool = False) -> None:
        """After loading (`can_pack_for_cpu`): multiply with oneDNN's blocked copy of the weight
        and free the dense one; `int4` adds a 4-bit copy for small batches (int4.py). MX
        weights stay as they are."""
        if not self.quant:
            self.packed = _pack(self.weight)
            if int4 and int4_supported(self.weight):
                self.int4 = quantize_int4(self.weight)
            self.weight.data = self.weight.data.new_empty(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant:
            return self.weight(x, self.bias)
        if self.packed is not None:
            return _packed_linear(x, self.packed, self.int4, self.bias)
        return _dense_linear(x, self.weight, self.bias, self.gemv_options)

    def decode_weight(self):
        """The weight as kernels/gemv.py takes it: the dense tensor, or an MX layer's prepared
        MXLinearWeight (None before loading ends, or off CUDA)."""
        return self.weight.prepared if self.quant else self.weight

    def can_fuse_decode(self, x: torch.Tensor) -> bool:
        """kernels/gemv.py's decode_projection takes this layer at x (gemv.preferred under
        self.gemv_options: CUDA, at most max_rows rows, a dense 16-bit or a small enough MX
        weight); the model then calls it with the steps around the projection."""
        if not (x.is_cuda and self.packed is None):
            return False
        from mxserve.kernels import gemv

        w = self.decode_weight()
        return w is not None and gemv.preferred(x, w, self.gemv_options)


class RowParallelLinear(nn.Module):
    """y = x W^T with W's input columns split over ranks, then an all-reduce of the partial sums.

    `quant`: an MX weight, as in ColumnParallelLinear; each rank holds whole 32-blocks of K."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, dtype: torch.dtype,
                 device: torch.device | str = "cpu", quant: str | None = None,
                 gemv_options: GemvOptions = DEFAULT_GEMV) -> None:
        super().__init__()
        self.tp = tp
        self.quant = quant
        self.gemv_options = gemv_options
        self.weight = _weight(out_features, in_features // tp.size, dtype, device, quant,
                              gemv_options)
        self.packed: torch.Tensor | None = None  # pack_for_cpu
        self.int4: Int4Weight | None = None

    def load(self, weight: torch.Tensor) -> None:
        """weight: this rank's [out_features, in_features / size] (a tensor or MXTensor)."""
        if self.quant:
            return self.weight.load(slice(None), weight)
        self.weight.data.copy_(weight)

    def finish_loading(self) -> None:
        if self.quant:
            self.weight.finish_loading()

    pack_for_cpu = ColumnParallelLinear.pack_for_cpu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant:
            y = self.weight(x)
        elif self.packed is not None:
            y = _packed_linear(x, self.packed, self.int4, None)
        else:
            y = _dense_linear(x, self.weight, None, self.gemv_options)
        return self.tp.all_reduce(y)


def _weight(out_features: int, in_features: int, dtype: torch.dtype,
            device: torch.device | str, quant: str | None,
            gemv_options: GemvOptions) -> nn.Parameter | nn.Module:
    """A float nn.Parameter [out, in], or for `quant` an MXWeight module of that shape."""
    if quant is None:
        return nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device),
                            requires_grad=False)
    from mxserve.worker.model.mx_layers import MXWeight  # imports Triton: only for MX models

    return MXWeight(out_features, in_features, quant, dtype, device, gemv_options)


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split over ranks by vocabulary range (tp.py `vocab`: the last range padded
    with zero rows); out-of-range ids contribute zeros, then an all-reduce."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.tp = tp
        self.start, stop, rows = tp.vocab(vocab_size)
        self.num_local = stop - self.start  # real rows; the rest (to `rows`) are padding
        self.weight = nn.Parameter(torch.zeros(rows, hidden_size, dtype=dtype, device=device),
                                   requires_grad=False)

    def load(self, weight: torch.Tensor) -> None:
        """weight: this rank's vocabulary rows [num_local, hidden]."""
        self.weight.data[:self.num_local].copy_(weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_local)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(nn.Module):
    """Logits over the full vocabulary: each rank scores its vocab slice, then an all-gather."""

    def __init__(self, embedding: VocabParallelEmbedding | None, vocab_size: int, hidden_size: int,
                 tp: TPGroup, dtype: torch.dtype, device: torch.device | str = "cpu",
                 gemv_options: GemvOptions = DEFAULT_GEMV) -> None:
        super().__init__()
        self.tp = tp
        self.gemv_options = gemv_options
        self.vocab_size = vocab_size
        self.tied = embedding is not None
        self.embedding = embedding  # tied: share the embedding's weight, load nothing
        start, stop, rows = tp.vocab(vocab_size)  # as the embedding's
        self.num_local = stop - start
        if embedding is None:
            self.weight = nn.Parameter(torch.zeros(rows, hidden_size, dtype=dtype, device=device),
                                       requires_grad=False)
        self.packed: torch.Tensor | None = None  # pack_for_cpu: oneDNN's layout, or
        self.pairs: torch.Tensor | None = None  # cpu_linear.py's (float32 logits), or
        self.mx = None  # quantize_mx on CUDA: an mx_layers.MXWeight

    def load(self, weight: torch.Tensor) -> None:
        """weight: this rank's vocabulary rows [num_local, hidden]."""
        self.weight.data[:self.num_local].copy_(weight)

    def quantize_mx(self, fmt: str) -> None:
        """The head's weight (this rank's vocab slice) as MX element format `fmt`, after loading
        (EngineConfig.quantize_lm_head). Tied: the head gets its own copy and the embedding
        keeps its weights. CUDA: packed, multiplied by the MX kernels; CPU: dequantized once
        into a dense weight (as mx_layers.MXWeight does), which the CPU paths below then pack."""
        from mxserve.worker.model.mx_layers import MXWeight  # imports Triton

        weight = self.embedding.weight if self.tied else self.weight
        mx = MXWeight(*weight.shape, fmt, weight.dtype, weight.device, self.gemv_options)
        mx.load(slice(None), weight.data)  # this rank's slice
        mx.finish_loading()
        if mx.packed:
            self.mx = mx
            weight = weight.new_empty(0)
        else:
            weight = mx.weight.data
        self.tied, self.embedding = False, None
        self.weight = nn.Parameter(weight, requires_grad=False)

    def use_float32_logits(self) -> None:
        """CPU bf16 with AVX512-BF16 (`cpu_linear.available()`): multiply with kernels/
        cpu_linear.py's packed pairs, which give float32 logits (bf16 logits tie near-equal top
        tokens). Tied: the embedding keeps its dense weight."""
        weight = self.embedding.weight if self.tied else self.weight
        self.vocab_local = weight.shape[0]
        self.pairs = cpu_linear.pack_pairs(weight)
        if not self.tied:
            self.weight.data = self.weight.data.new_empty(0)

    def pack_for_cpu(self, int4: bool = False) -> None:
        """As the linears' (tied: a packed copy; the embedding keeps its dense weight), unless
        `use_float32_logits` took over. Never int4: a GGUF's embedding is 8-bit or more, and 4
        bits would lose that."""
        if self.pairs is not None:
            return
        self.packed = _pack(self.embedding.weight if self.tied else self.weight)
        if not self.tied:
            self.weight.data = self.weight.data.new_empty(0)

    def forward(self, hidden: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        # hidden [T, hidden] -> logits [T, vocab] in out_dtype (None: the model's dtype)
        if self.mx is not None:
            logits = self.mx(hidden, out_dtype=out_dtype)
        elif self.pairs is not None:  # [T, vocab / tp] float32
            logits = cpu_linear.linear_f32(hidden, self.pairs, self.vocab_local)
        elif self.packed is not None:
            logits = _packed_linear(hidden, self.packed, None, None)
        else:
            weight = self.embedding.weight if self.tied else self.weight
            logits = _dense_linear(hidden, weight, None, self.gemv_options, out_dtype)
        if out_dtype is not None:
            logits = logits.to(out_dtype)  # (a no-op where it already is)
        if self.tp.size == 1:
            return logits
        # [T, vocab]: the ranks' ranges side by side, the padding rows dropped
        return self.tp.all_gather_last_dim(logits)[:, :self.vocab_size].contiguous()
