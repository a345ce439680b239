"""Shared helpers for tests that load the real default model (loaded once per session)."""

from __future__ import annotations

import functools

import torch

from pd.kvcache.paged_metadata import build_paged_metadata
from pd.worker.checkpoint.default_model import default_model_path
from pd.worker.checkpoint.loader import LoadedCheckpoint, load_checkpoint
from pd.worker.model.runner import ModelRunner
from pd.worker.model.runner_config import RunnerConfig


@functools.cache
def default_checkpoint(keep_q4_1: bool = False) -> LoadedCheckpoint:
    """The default model, dequantized (or with its Q4_1 layers as they are: `keep_q4_1`)."""
    return load_checkpoint(
        default_model_path(), dtype=torch.float32, progress=False, keep_q4_1=keep_q4_1
    )


def make_runner(
    tp: int = 1,
    dtype: torch.dtype = torch.float32,
    num_pages: int = 64,
    page_size: int = 16,
    quantization: str = "none",
    group_size: int = 32,
    keep_q4_1: bool = False,
    lm_head_quantization: str = "auto",
    deterministic: bool = False,
) -> ModelRunner:
    ckpt = default_checkpoint(keep_q4_1)
    rc = RunnerConfig(
        tp=tp,
        dtype=dtype,
        device="cpu",
        num_pages=num_pages,
        page_size=page_size,
        max_model_len=2048,
        quantization=quantization,
        group_size=group_size,
        lm_head_quantization=lm_head_quantization,
        deterministic=deterministic,
    )
    return ModelRunner(ckpt.config, ckpt.weights, rc)


def forward_chunk(
    runner: ModelRunner,
    page_ids: list[int],
    tokens: list[int],
    num_cached: int,
    all_logits: bool = True,
) -> torch.Tensor:
    """Run `tokens` after `num_cached` cached ones; logits of every new token ([T, V] fp32)."""
    meta = build_paged_metadata([(page_ids, num_cached, len(tokens))], runner.page_size, "cpu")
    ids = torch.tensor(tokens, dtype=torch.long)
    rows = torch.arange(len(tokens)) if all_logits else torch.tensor([len(tokens) - 1])
    return runner.model.forward(ids, meta, rows)


def greedy_generate(
    runner: ModelRunner, prompt: list[int], steps: int, chunk: int = 7
) -> tuple[list[int], list[torch.Tensor]]:
    """Prefill in chunks, then decode greedily; returns the tokens and each step's logits row."""
    pages = list(range(-(-(len(prompt) + steps) // runner.page_size)))
    rows = []
    for start in range(0, len(prompt), chunk):
        logits = forward_chunk(runner, pages, prompt[start : start + chunk], start)
    rows.append(logits[-1])
    out = [int(logits[-1].argmax())]
    for _ in range(steps - 1):
        logits = forward_chunk(runner, pages, out[-1:], len(prompt) + len(out) - 1)
        rows.append(logits[-1])
        out.append(int(logits[-1].argmax()))
    return out, rows
