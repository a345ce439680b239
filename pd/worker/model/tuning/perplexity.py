"""The model's perplexity on a text shipped with pd (data/perplexity.txt, 369 tokens of plain
English prose): the quality bound a kernel or weight format must keep (issue 24: within 1.02x of
the fp32 model's), measured in one prefill of the whole text."""

from __future__ import annotations

import math
from importlib import resources

import torch

from pd.kvcache.paged_metadata import build_paged_metadata
from pd.worker.model.runner import ModelRunner


def shipped_text() -> str:
    return resources.files("pd.worker.model").joinpath("data/perplexity.txt").read_text()


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


@torch.inference_mode()
def final_hidden(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """The final norm's output [len(ids) - 1, hidden] at each token of `ids` but the last (the
    LM head's input), in one prefill on pages 0.. of `runner` (it needs
    `pages_for(len(ids), page_size)` of them)."""
    pages = list(range(pages_for(len(ids), runner.page_size)))
    meta = build_paged_metadata([(pages, 0, len(ids))], runner.page_size, str(runner.device))
    tokens = torch.tensor(ids, dtype=torch.long, device=runner.device)
    rows = torch.arange(len(ids) - 1, device=runner.device)
    model = runner.model
    angles, kv_rows = model.plan(meta, [rank.attn for rank in model.ranks])
    return model.hidden(tokens, angles, kv_rows, None, rows)


@torch.inference_mode()
def perplexity_of(logits: torch.Tensor, ids: list[int]) -> float:
    """exp(mean NLL) of each token of `ids` after the first, from the logits [len(ids) - 1, V]
    before it."""
    targets = torch.tensor(ids[1:], dtype=torch.long, device=logits.device)
    return math.exp(torch.nn.functional.cross_entropy(logits.float(), targets).item())


def perplexity(runner: ModelRunner, ids: list[int]) -> float:
    """exp(mean NLL) of each token of `ids` after the ones before it, in one prefill on pages
    0.. of `runner` (it needs `pages_for(len(ids), page_size)` of them)."""
    return perplexity_of(runner.model.logits(final_hidden(runner, ids)), ids)
