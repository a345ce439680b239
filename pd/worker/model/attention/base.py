"""The attention backend interface: plan once per batch, run once per layer."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from pd.kvcache.paged_metadata import PagedMetadata


class AttentionBackend(ABC):
    """Paged attention over FlashInfer's metadata, one instance per TP rank (device).

    Semantics (FlashInfer's causal mode, aligned bottom-right): new query i of a sequence sits at
    position num_cached + i and attends to the KV positions <= that one, among the
    num_cached + num_new tokens the sequence holds once this step's K/V is written.
    GQA: query head h reads KV head h // (Hq // Hkv).
    """

    @abstractmethod
    def plan(
        self,
        meta: PagedMetadata,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        dtype: torch.dtype,
    ) -> None:
        """Prepare for a batch; the work done here is shared by every layer's forward."""

    @abstractmethod
    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, sm_scale: float) -> torch.Tensor:
        """q: [T, Hq, D]; kv_cache: [num_pages, 2, Hkv, page_size, D] (HND). Returns [T, Hq, D].

        Run after this layer's new K/V has been written into kv_cache.
        """

    def decode_inputs(self, min_pages: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """A planned pure decode step's attention as tensors (page table, mask), for a compiled
        decode step; only the torch backend has them."""
        raise NotImplementedError(f"{type(self).__name__} has no compiled decode step")

    @abstractmethod
    def plan_graph(
        self, max_pages: int, sm_scale: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """After `plan` of a pure decode step padded to a captured graph's batch size
        (`decode_graphs.py`), no sequence holding more than `max_pages` pages: put what the
        graph reads into buffers kept per batch size, at the same addresses from one step to
        the next. Returns the attention inputs the graph passes to `paged_decode_attention`
        (page table, mask), or None when `forward` reads the backend's own buffers
        (FlashInfer's CUDA-graph wrappers)."""


def check_plan_args(num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int) -> None:
    if num_kv_heads <= 0 or num_qo_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_qo_heads ({num_qo_heads}) must be a positive multiple of "
            f"num_kv_heads ({num_kv_heads})"
        )
    if head_dim <= 0 or page_size <= 0:
        raise ValueError(f"head_dim ({head_dim}) and page_size ({page_size}) must be > 0")
