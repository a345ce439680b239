"""Paged attention backends: FlashInfer on CUDA, plain torch elsewhere, same metadata."""

from pd.worker.model.attention.base import AttentionBackend
from pd.worker.model.attention.flashinfer_backend import (
    FlashInferAttentionBackend,
    select_attention_backend,
)
from pd.worker.model.attention.torch_backend import TorchAttentionBackend

__all__ = [
    "AttentionBackend",
    "FlashInferAttentionBackend",
    "TorchAttentionBackend",
    "select_attention_backend",
]
