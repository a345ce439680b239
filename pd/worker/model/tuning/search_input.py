"""What a worker asks of the kernel search: its flags and sizes and the checkpoint's digest. The
choice's cache key is derived from it (kernel_cache.cache_key), with the CPU as capped and
torch's version: every field counts, so a choice never follows a worker to another machine,
model or shape. The role is not in it: P and D of one machine share a choice."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SearchInput:
    dtype: str  # --dtype: "auto" or pinned
    quantization: str  # --quantization: "auto" or pinned
    lm_head_quantization: str  # --lm-head-quantization: "auto" or pinned
    device: str  # "cpu" | "cuda" (only a CPU is measured)
    chunk_size: int  # a prefill chunk's rows
    max_running: int  # the largest decode batch
    threads: int  # the torch thread's
    tp: int
    group_size: int  # int4's group
    digest: str  # the checkpoint's
    compile: bool = False  # --compile: the formats torch.compile runs only
