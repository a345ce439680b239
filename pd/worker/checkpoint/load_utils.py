"""Pieces shared by the checkpoint loaders: the result type, the error type, a progress line."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass

from pd.worker.model.config import ModelConfig
from pd.worker.model.quant import Weight
from pd.worker.text.tokenizer import Tokenizer


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: unsupported architecture or tokenizer, or broken."""


@dataclass
class LoadedCheckpoint:
    config: ModelConfig
    # Hugging Face names and shapes (Linear weights [out, in]); no lm_head.weight when tied.
    weights: dict[str, Weight]  # float tensors; GroupQuant for Q4_1 layers kept as they are
    tokenizer: Tokenizer
    # The checkpoint as stored, sampled (digest.py): what a P/D pair must share. "" when the
    # weights did not come from a file (tests).
    digest: str = ""


class Progress:
    """`loading weights: 120/272` on stderr, rewritten in place; silent unless asked or a tty."""

    def __init__(self, total: int, enabled: bool | None, label: str = "loading weights") -> None:
        if enabled is None:
            enabled = sys.stderr.isatty()
        self.total, self.enabled, self.label = total, enabled, label
        self.done = 0

    def step(self) -> None:
        self.done += 1
        if self.enabled and (self.done == self.total or self.done % 8 == 0):
            sys.stderr.write(f"\r{self.label}: {self.done}/{self.total}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight a checkpoint for `config` must hold, with its Hugging Face shape."""
    h, q, kv, ff = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (ff, h),
            p + "mlp.up_proj.weight": (ff, h),
            p + "mlp.down_proj.weight": (h, ff),
        }
        if config.qkv_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.bias": (kv,),
            }
    return shapes


def check_weights(weights: Mapping[str, Weight], config: ModelConfig, source: str) -> None:
    """Raise CheckpointError unless `weights` is exactly the set `config` needs, in its shapes."""
    expected = expected_weight_shapes(config)
    missing = sorted(expected.keys() - weights.keys())
    extra = sorted(weights.keys() - expected.keys())
    if missing or extra:
        raise CheckpointError(
            f"{source}: weights do not match the config "
            f"(missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {extra[:5]}{'...' if len(extra) > 5 else ''})"
        )
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise CheckpointError(
                f"{source}: {name} has shape {tuple(weights[name].shape)}, expected {shape}"
            )
