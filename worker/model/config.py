"""The model description every loader produces and the model and engine consume."""

from __future__ import annotations

from dataclasses import dataclass, field

from mxserve.api.errors import ModelLoadError


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 frequency scaling ("rope_type": "llama3"); None in ModelConfig means plain RoPE."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder (Llama, Mistral, Qwen2).

    `architecture` is the Hugging Face class name ("LlamaForCausalLM", ...). `attention_bias` is the
    q/k/v projection bias (Qwen2 has it); o_proj never has one in these families.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None  # parsed for Mistral; full attention is used (see README)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    hidden_act: str = "silu"
    model_id: str = ""  # stable name used in block hashes (ARCHITECTURE.md, "Block hashes")

    SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

    def __post_init__(self) -> None:
        if self.architecture not in self.SUPPORTED:
            raise ModelLoadError(
                f"unsupported architecture {self.architecture!r}; supported: {self.SUPPORTED}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.hidden_act != "silu":
            raise ModelLoadError(f"unsupported hidden_act {self.hidden_act!r}")

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim
