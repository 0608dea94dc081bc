"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) over the paged KV cache, tensor-parallel ready.

The model sees a flat batch of tokens (no padding): input_ids [T] and positions [T] for every new
token of every scheduled request; attention finds each token's context through the metadata.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from mxserve.api.errors import ModelLoadError
from mxserve.kernels.options import DEFAULT_GEMV, GemvOptions
from mxserve.worker.attention import AttentionBackend
from mxserve.worker.model.checkpoint import TensorSlice
from mxserve.worker.model.config import ModelConfig
from mxserve.worker.model.layers import RMSNorm, RotaryEmbedding, fused_layer_ops
from mxserve.worker.model.parallel import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from mxserve.worker.model.tp import TPGroup, check_tensor_parallel


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, device,
                 rope: RotaryEmbedding, quant: str | None = None,
                 gemv_options: GemvOptions = DEFAULT_GEMV) -> None:
        super().__init__()
        check_tensor_parallel(cfg, tp.size)
        self.num_heads = cfg.num_attention_heads // tp.size
        start, stop = tp.kv_heads(cfg.num_key_value_heads)
        self.num_kv_heads = stop - start
        self.head_dim = cfg.head_dim
        q, kv = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [q, kv, kv], cfg.attention_bias,
                                             tp, dtype, device, quant, gemv_options)
        self.o_proj = RowParallelLinear(cfg.q_size, cfg.hidden_size, tp, dtype, device, quant,
                                        gemv_options)
        self.rope = rope  # the model's one table, shared by every layer

    def forward(self, h: torch.Tensor, residual: torch.Tensor, norm: RMSNorm,
                positions: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                attn: AttentionBackend, meta: object) -> tuple[torch.Tensor, torch.Tensor]:
        # h, residual [T, hidden] -> (o_proj(attention(norm(residual + h))), residual + h).
        # This layer owns the step's K/V write: in its projection kernel, or through the backend.
        qkv, residual, kv_written = self._qkv(h, residual, norm, positions, kv_cache, attn, meta)
        qkv = qkv.view(qkv.shape[0], self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        if not kv_written:
            attn.write_kv(k, v, kv_cache[0], kv_cache[1], meta)
        out = attn.forward(q, kv_cache[0], kv_cache[1], meta)  # [T, Hq * D]
        return self.o_proj(out), residual

    def _qkv(self, h, residual, norm, positions, kv_cache, attn, meta):
        """(q/k/v with q and k rotated [T, (Hq + 2 Hkv) * D], residual + h (h when residual is
        None: the first layer), whether k and v are in the caches already). On CUDA at one row
        it is one kernel (kernels/gemv.py's decode_projection: norm, projection, RoPE and the
        K/V write); otherwise the norm (residual in place), the projection and the rotation."""
        if not self.qkv_proj.can_fuse_decode(h):
            qkv = self.qkv_proj(norm(h, residual))
            residual = h if residual is None else residual
            rotated = qkv.view(qkv.shape[0], -1, self.head_dim)[:, :self.num_heads
                                                                + self.num_kv_heads]
            self.rope(rotated, positions)  # q and k rotated in place
            return qkv, residual, False
        from mxserve.kernels import gemv

        kv = gemv.KVWrite(kv_cache[0], kv_cache[1], attn.kv_slots(meta))
        qkv, residual = gemv.decode_projection(
            h, self.qkv_proj.decode_weight(), self.qkv_proj.bias,
            norm=gemv.Norm(residual, norm.weight, norm.eps),
            rope=gemv.Rope(positions, self.rope.cos, self.rope.sin, self.num_heads,
                           self.num_kv_heads, self.head_dim), kv=kv,
            pdl=self.qkv_proj.gemv_options.pdl)
        return qkv, residual, True


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, device,
                 quant: str | None = None, gemv_options: GemvOptions = DEFAULT_GEMV) -> None:
        super().__init__()
        inter = cfg.intermediate_size // tp.size  # this rank's columns
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [inter, inter], False, tp,
                                                 dtype, device, quant, gemv_options)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, tp, dtype,
                                           device, quant, gemv_options)

    def forward(self, h: torch.Tensor, residual: torch.Tensor,
                norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        # h, residual [T, hidden] -> (down(silu(gate) * up of norm(residual + h)), residual + h)
        if self.gate_up_proj.can_fuse_decode(h):  # one kernel (kernels/gemv.py) up to down
            from mxserve.kernels import gemv

            act, residual = gemv.decode_projection(
                h, self.gate_up_proj.decode_weight(), self.gate_up_proj.bias,
                norm=gemv.Norm(residual, norm.weight, norm.eps), silu_and_mul=True,
                pdl=self.gate_up_proj.gemv_options.pdl)
            return self.down_proj(act), residual
        gate_up = self.gate_up_proj(norm(h, residual))  # [T, 2 * intermediate]
        ops = fused_layer_ops(gate_up)  # one kernel (kernels/layer_ops.py, cpu_layer_ops.py)
        if ops is not None:
            return self.down_proj(ops.silu_and_mul(gate_up)), residual
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up), residual


class LlamaDecoderLayer(nn.Module):
    """x = x + attn(norm(x)); x = x + mlp(norm(x)), with the residual stream x kept apart and each
    add folded into the next norm: forward(h, residual) takes the previous layer's output h and
    the stream before it and returns this layer's (h, residual). Each block gets its norm and
    runs it with its first projection: on CUDA at one row one kernel does the norm, the
    projection and what follows it (RoPE and the K/V write, or SiLU-and-mul; kernels/gemv.py)
    and the stream comes back as a new tensor; otherwise it is updated in place."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype, device,
                 rope: RotaryEmbedding, quant: str | None = None,
                 gemv_options: GemvOptions = DEFAULT_GEMV) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, tp, dtype, device, rope, quant, gemv_options)
        self.mlp = LlamaMLP(cfg, tp, dtype, device, quant, gemv_options)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)

    def forward(self, h, residual, positions, kv_cache, attn, meta):
        h, residual = self.self_attn(h, residual, self.input_layernorm, positions, kv_cache,
                                     attn, meta)
        return self.mlp(h, residual, self.post_attention_layernorm)


class LlamaForCausalLM(nn.Module):
    """Embeddings -> decoder layers -> final norm; `compute_logits` applies the LM head.

    `quantization` ("mxfp4", "mxfp6", "mxfp6_e3m2"; mx_layers.py): the decoder linears hold MX
    weights. They load an MX checkpoint's MXTensors as they are and quantize float weights.
    `quantize_lm_head`: the LM head is quantized to the same format once its weight has loaded.
    `gemv_options`: when CUDA decode takes kernels/gemv.py (every linear and the head)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 quantization: str | None = None, quantize_lm_head: bool = False,
                 gemv_options: GemvOptions = DEFAULT_GEMV) -> None:
        super().__init__()
        tp = tp or TPGroup()
        self.tp = tp
        self.config = cfg
        self.quantization = quantization
        if quantize_lm_head and quantization is None:
            raise ValueError("quantize_lm_head needs an MX model: pass quantization= or serve an "
                             "`mxserve quantize` checkpoint")
        self.quantize_lm_head = quantize_lm_head
        quant = None
        if quantization is not None:
            from mxserve.worker.model.mx_layers import model_element_format  # imports Triton

            quant = model_element_format(cfg, tp.size, quantization)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype,
                                                   device)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                    cfg.rope_scaling, device)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, tp, dtype, device, self.rope, quant,
                                                      gemv_options)
                                    for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.lm_head = ParallelLMHead(
            self.embed_tokens if cfg.tie_word_embeddings else None, cfg.vocab_size,
            cfg.hidden_size, tp, dtype, device, gemv_options)
        self.mx_format = quant  # the decoder linears' element format, or None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], attn: AttentionBackend,
                meta: object) -> torch.Tensor:
        # input_ids, positions [T] -> hidden states [T, hidden]
        self.rope.prepare(positions)
        # the stream starts as the embedding: the first norm adds nothing (residual None);
        # each block returns the stream
        h, residual = self.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.layers, kv_caches):
            h, residual = layer(h, residual, positions, kv_cache, attn, meta)
        return self.norm(h, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden, torch.float32)  # [R, vocab]

    def tensor_slice(self, name: str) -> TensorSlice | None:
        """The slice of Hugging Face tensor `name` this rank holds (`tensor_slice`)."""
        return tensor_slice(self.config, self.tp, name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors, each already this rank's slice (`tensor_slice`),
        fusing q/k/v and gate/up."""
        expected = set(self._expected_names())
        seen: set[str] = set()
        for name, tensor in weights:
            if name not in expected:
                continue  # e.g. rotary inv_freq buffers some checkpoints carry
            if not isinstance(tensor, torch.Tensor) and self.quantization is None:
                raise ModelLoadError(f"{name} is MX-quantized: build the model with its "
                                     "quantization")
            self._load_one(name, tensor)
            seen.add(name)
        missing = sorted(expected - seen)
        if missing:
            raise ModelLoadError(
                f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
        for module in self.modules():
            if isinstance(module, ColumnParallelLinear | RowParallelLinear):
                module.finish_loading()
        if self.quantize_lm_head:
            self.lm_head.quantize_mx(self.mx_format)

    def _expected_names(self) -> list[str]:
        cfg = self.config
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not cfg.tie_word_embeddings:
            names.append("lm_head.weight")
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            names += [p + f"self_attn.{n}_proj.weight" for n in "qkvo"]
            names += [p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
            names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
            if cfg.attention_bias:
                names += [p + f"self_attn.{n}_proj.bias" for n in "qkv"]
        return names

    def _load_one(self, name: str, t: torch.Tensor) -> None:
        if name == "model.embed_tokens.weight":
            return self.embed_tokens.load(t)
        if name == "lm_head.weight":
            return self.lm_head.load(t)
        if name == "model.norm.weight":
            return self.norm.weight.data.copy_(t)
        # model.layers.{i}.{input_layernorm|post_attention_layernorm}.weight
        # model.layers.{i}.{self_attn|mlp}.{q|k|v|o|gate|up|down}_proj.{weight|bias}
        parts = name.split(".")
        layer = self.layers[int(parts[2])]
        if len(parts) == 5:
            return getattr(layer, parts[3]).weight.data.copy_(t)
        proj, kind = parts[4], parts[5]
        if proj in ("q_proj", "k_proj", "v_proj"):
            shard = "qkv".index(proj[0])
            if kind == "bias":
                return layer.self_attn.qkv_proj.load_bias(shard, t)
            return layer.self_attn.qkv_proj.load(shard, t)
        if proj == "o_proj":
            return layer.self_attn.o_proj.load(t)
        if proj in ("gate_proj", "up_proj"):
            return layer.mlp.gate_up_proj.load(0 if proj == "gate_proj" else 1, t)
        return layer.mlp.down_proj.load(t)


def tensor_slice(cfg: ModelConfig, tp: TPGroup, name: str) -> TensorSlice | None:
    """The slice of Hugging Face tensor `name` that rank tp.rank holds (None: all of it): rows
    of column-parallel weights (q/k/v by heads, gate/up) and of the vocabulary, columns of
    row-parallel ones (o, down)."""
    if tp.size == 1 or name.endswith("norm.weight"):
        return None
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return TensorSlice(0, *tp.vocab(cfg.vocab_size)[:2])
    proj = name.split(".")[-2]
    if proj in ("q_proj", "o_proj"):
        return TensorSlice(0 if proj == "q_proj" else 1, *tp.split(cfg.q_size))
    if proj in ("k_proj", "v_proj"):
        start, stop = tp.kv_heads(cfg.num_key_value_heads)
        return TensorSlice(0, start * cfg.head_dim, stop * cfg.head_dim)
    start, stop = tp.split(cfg.intermediate_size)  # gate_proj, up_proj, down_proj
    return TensorSlice(0 if proj != "down_proj" else 1, start, stop)
