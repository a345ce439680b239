"""Where the model runs and in what precision, and how many KV pages fit there."""

from __future__ import annotations

import os

import torch

from pd.kvcache.kv_pool import pages_for_budget
from pd.worker.model.config import ModelConfig
from pd.worker.model.tuning.cpu_info import (
    read_cpu_info,  # its flags follow an AVX2 cap (ISA_LIMITS)
)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def cpu_has_fast_bf16() -> bool:
    flags = read_cpu_info().flags
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA device is available")
    return device


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype != "auto":
        return DTYPES[dtype]
    if device == "cuda" or cpu_has_fast_bf16():
        return torch.bfloat16
    return torch.float32


def size_kv_pages(
    config: ModelConfig,
    tp: int,
    page_size: int,
    dtype: torch.dtype,
    device: str,
    kv_pages: int,
    memory_fraction: float,
) -> int:
    """Pages per rank: as asked, else a fraction of the device's memory."""
    if kv_pages:
        return kv_pages
    if device == "cuda":
        free, _ = torch.cuda.mem_get_info(0)
        budget = free * memory_fraction
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        budget = total * memory_fraction / tp
    pages = pages_for_budget(
        int(budget), config.num_layers, config.num_kv_heads // tp, page_size, config.head_dim, dtype
    )
    return max(16, pages)
