"""The runner's one config (`RunnerConfig`): checked once, its LM head's format resolved, the
KV pool's scratch pages for its one decode accelerator."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pd.worker.model.config import ModelConfig
from pd.worker.model.one_row import SCRATCH_PAGES
from pd.worker.model.runner_config import Accelerator, RunnerConfig

CFG = ModelConfig("t", "llama", 256, 64, 128, 2, 4, 2, 16, 1e4, 1e-5, 128, True)
RC = RunnerConfig(tp=1, dtype=torch.float32, device="cpu", num_pages=10, page_size=16,
                  max_model_len=128)  # fmt: skip


def test_checked_resolves_the_heads_rule_and_keeps_an_explicit_one():
    assert RC.checked(CFG, None).lm_head_quantization == "none"
    int4 = dataclasses.replace(RC, quantization="int4")
    assert int4.checked(CFG, None).lm_head_quantization == "int8"  # int4's rule
    pinned = dataclasses.replace(int4, lm_head_quantization="none")
    assert pinned.checked(CFG, None).lm_head_quantization == "none"
    assert RC.lm_head_quantization == "auto"  # frozen: checked returns a new one


def test_checked_refuses_what_cannot_run():
    with pytest.raises(ValueError, match="--tp"):
        dataclasses.replace(RC, tp=3).checked(CFG, None)
    with pytest.raises(ValueError, match="activation maxima"):
        dataclasses.replace(RC, quantization="smooth-int8").checked(CFG, None)
    with pytest.raises(ValueError, match="--compile runs"):
        dataclasses.replace(RC, quantization="fbgemm-int8", accelerator=Accelerator("compile")).checked(CFG, None)  # fmt: skip
    with pytest.raises(ValueError, match="--cuda-graph-max-batch needs --device cuda"):
        dataclasses.replace(RC, accelerator=Accelerator("cuda-graphs", max_batch=4)).checked(CFG, None)  # fmt: skip
    with pytest.raises(ValueError, match="unknown decode accelerator"):
        dataclasses.replace(RC, accelerator=Accelerator("speculative")).checked(CFG, None)


def test_the_pool_holds_the_allocators_pages_and_the_accelerators_scratch():
    assert (RC.scratch_pages(), RC.pool_pages) == (range(10, 10), 10)
    one_row = dataclasses.replace(RC, accelerator=Accelerator("one-row", why="on"))
    assert one_row.scratch_pages() == range(10, 10 + SCRATCH_PAGES)
    assert one_row.pool_pages == 10 + SCRATCH_PAGES
    graphs = dataclasses.replace(RC, accelerator=Accelerator("cuda-graphs", max_batch=4))
    assert (graphs.scratch_pages(), graphs.pool_pages) == (range(11, 11), 11)  # page 10: padding
    assert dataclasses.replace(RC, tp=2).devices() == [torch.device("cpu")] * 2
