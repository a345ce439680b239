"""Load a checkpoint for the worker: a GGUF file or a Hugging Face directory.

ckpt = load_checkpoint(default_model_path())
ckpt.config      # ModelConfig
ckpt.weights     # {"model.layers.0.self_attn.q_proj.weight": Tensor[out, in], ...}
ckpt.tokenizer   # Tokenizer (encode / decode / apply_chat_template / eos_token_ids)
ckpt.digest      # "gguf:3f0c..." the checkpoint as stored, sampled (digest.py): P and D share it
"""

from __future__ import annotations

from pathlib import Path

import torch

from pd.worker.checkpoint.default_model import DefaultModelMissing, default_model_path
from pd.worker.checkpoint.gguf_loader import load_gguf, load_gguf_tokenizer
from pd.worker.checkpoint.hf_loader import load_hf, load_hf_tokenizer
from pd.worker.checkpoint.load_utils import CheckpointError, LoadedCheckpoint
from pd.worker.text.tokenizer import ChatTemplateError, Tokenizer

__all__ = [
    "ChatTemplateError",
    "CheckpointError",
    "DefaultModelMissing",
    "LoadedCheckpoint",
    "Tokenizer",
    "default_model_path",
    "load_checkpoint",
    "load_tokenizer",
]


def _kind(path: str) -> str:
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return "gguf"
    if p.is_dir() and (p / "config.json").is_file():
        return "hf"
    if not p.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    raise CheckpointError(
        f"{path}: not a checkpoint (expected a .gguf file or a directory with config.json)"
    )


def load_checkpoint(
    path: str,
    dtype: torch.dtype = torch.float32,
    progress: bool | None = None,
    keep_q4_1: bool = False,
) -> LoadedCheckpoint:
    """Config, weights (Hugging Face names, cast to `dtype`), tokenizer and digest (of the files
    as stored: the same whatever `dtype` and `keep_q4_1`) of the checkpoint at `path`. GGUF
    tensors are dequantized, except Q4_1 linear layers when `keep_q4_1` (for int4 weights: they
    come as `GroupQuant`). `progress`: a progress line on stderr (None: only when stderr is a
    terminal)."""
    if _kind(path) == "gguf":
        config, weights, tokenizer, digest = load_gguf(path, dtype, progress, keep_q4_1)
        return LoadedCheckpoint(config, weights, tokenizer, digest)
    config, dense, tokenizer, digest = load_hf(path, dtype, progress)
    return LoadedCheckpoint(config, dict(dense), tokenizer, digest)


def load_tokenizer(path: str) -> Tokenizer:
    """Only the tokenizer of the checkpoint at `path` (no weights are read)."""
    return load_gguf_tokenizer(path) if _kind(path) == "gguf" else load_hf_tokenizer(path)
