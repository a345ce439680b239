"""The shape of a Llama-family decoder, read from a GGUF header or a Hugging Face config.json."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    name: str  # served model name by default (e.g. "SmolLM2-135M-Instruct")
    architecture: str  # "llama", "qwen2", "mistral", ...
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False  # Qwen2 has biases on q/k/v projections
    # Llama 3 style rope scaling: {"factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"} or None.
    rope_scaling: dict | None = None

    def __post_init__(self) -> None:
        assert self.num_heads % self.num_kv_heads == 0, (
            "num_heads must be a multiple of num_kv_heads"
        )
        assert self.head_dim > 0 and self.num_layers > 0

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim
