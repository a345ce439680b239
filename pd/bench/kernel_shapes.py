"""The linear layers of one model step, as `pd-bench kernels` times them: their shapes (from the
model's config), their real weights (from the checkpoint), and the (shape, batch) cells to time."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from pd.worker.model.config import ModelConfig
from pd.worker.model.quant import GroupQuant, Weight


@dataclass(frozen=True)
class Shape:
    name: str  # "qkv", "o", "gate_up", "down", "lm_head"
    out: int
    inp: int
    per_step: int  # applications in one step: the number of layers, 1 for the LM head

    @property
    def is_head(self) -> bool:
        return self.name == "lm_head"


def model_shapes(cfg: ModelConfig) -> list[Shape]:
    """The linear layers of one step as pd runs them (q/k/v fused, gate/up fused; tp = 1)."""
    n = cfg.num_layers
    return [
        Shape("qkv", cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size, n),
        Shape("o", cfg.hidden_size, cfg.q_size, n),
        Shape("gate_up", 2 * cfg.intermediate_size, cfg.hidden_size, n),
        Shape("down", cfg.hidden_size, cfg.intermediate_size, n),
        Shape("lm_head", cfg.vocab_size, cfg.hidden_size, 1),
    ]


def cells(
    shapes: Sequence[Shape], decode_rows: Sequence[int], prefill_rows: Sequence[int]
) -> list[tuple[Shape, int]]:
    """(shape, rows) to time: every layer at every batch; the LM head at the decode batches and
    at one row (what a prefill step applies it to)."""
    out = []
    for rows in sorted({*decode_rows, *prefill_rows}):
        out += [(s, rows) for s in shapes if not s.is_head or rows in decode_rows]
    if prefill_rows and 1 not in decode_rows:
        out += [(s, 1) for s in shapes if s.is_head]
    return sorted(out, key=lambda cell: cell[1])  # by batch (stable): smaller batches first


def shape_weights(
    weights: Mapping[str, Weight], cfg: ModelConfig, layer: int
) -> dict[str, torch.Tensor]:
    """{shape name: fp32 weight [out, in]} from a checkpoint's Hugging Face names."""

    def w(name: str) -> torch.Tensor:
        t = weights[name]
        return (t.dequantize() if isinstance(t, GroupQuant) else t).float().contiguous()

    p = f"model.layers.{layer}."
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    return {
        "qkv": torch.cat([w(p + f"self_attn.{x}_proj.weight") for x in "qkv"]),
        "o": w(p + "self_attn.o_proj.weight"),
        "gate_up": torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")]),
        "down": w(p + "mlp.down_proj.weight"),
        "lm_head": w(head),
    }


def step_cells(shapes: Sequence[Shape], rows: int, prefill: bool) -> list[tuple[Shape, int]]:
    """The cells one step of `rows` rows is made of: each layer at `rows`, the LM head at `rows`
    (decode: every stream samples) or at 1 (a prefill chunk samples its last row)."""
    return [(s, 1 if s.is_head and prefill else rows) for s in shapes]


def step_weights(shapes: Sequence[Shape]) -> int:
    """Weights one step reads (every layer's and the LM head's)."""
    return sum(s.out * s.inp * s.per_step for s in shapes)
