"""What a `ModelRunner` is built from, besides the checkpoint: one frozen `RunnerConfig`, made
once by its caller (the worker's builder, the kernel search, a benchmark, a test) and checked
once (`checked`), with the one decode accelerator the runner may have (`Accelerator`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from pd.worker.model.config import ModelConfig
from pd.worker.model.llama import check_tp
from pd.worker.model.one_row import COMPILABLE, SCRATCH_PAGES
from pd.worker.model.quant import (
    check_group_size,
    check_quantization,
    head_quantization,
    holds_int4,
)
from pd.worker.model.smooth_quant import ActivationMaxima, holds_smooth


@dataclass(frozen=True)
class Accelerator:
    """The decode accelerator of a runner, at most one: `compile` (--compile: every decode step
    through torch.compile, warmed up at start), `one-row` (the one-row step compiled in the
    background while the worker serves: one_row.py; `why` says what asked for it) or
    `cuda-graphs` (decode batches of up to `max_batch` rows replayed as CUDA graphs)."""

    kind: str = "none"
    why: str = ""
    max_batch: int = 0

    KINDS = ("none", "compile", "one-row", "cuda-graphs")


@dataclass(frozen=True)
class RunnerConfig:
    tp: int
    dtype: torch.dtype
    device: str  # "cpu" or "cuda"
    num_pages: int  # KV pages the allocator hands out
    page_size: int
    max_model_len: int
    seed: int = 0
    quantization: str = "none"  # the linear layers' format (quant.py)
    lm_head_quantization: str = "auto"  # auto: the layers' rule (quant.head_quantization)
    group_size: int = 32
    attention_backend: str = "auto"
    deterministic: bool = False  # every row's attention as a decode row's (--deterministic)
    checkpoint_digest: str = ""  # LoadedCheckpoint.digest: see KVContract
    accelerator: Accelerator = field(default_factory=Accelerator)

    def checked(self, model: ModelConfig, act_maxima: ActivationMaxima | None) -> RunnerConfig:
        """This config with its LM head's format resolved, or a ValueError saying what of it
        cannot run `model` here."""
        check_tp(model, self.tp)
        check_quantization(self.quantization)
        head = self.lm_head_quantization
        if head == "auto":
            head = head_quantization(self.quantization, self.dtype)
        check_quantization(head)
        if holds_int4(self.quantization) or holds_int4(head):
            check_group_size(model, self.tp, self.group_size)
        if holds_smooth(self.quantization) and act_maxima is None and self.device == "cpu":
            raise ValueError(
                f"--quantization {self.quantization} needs the calibration's activation maxima "
                "(tuning/calibration.py's activation_maxima)"
            )
        if self.device == "cuda" and torch.cuda.device_count() < self.tp:
            raise ValueError(
                f"--tp {self.tp} needs {self.tp} CUDA devices, found {torch.cuda.device_count()}"
            )
        self._check_accelerator()
        return replace(self, lm_head_quantization=head)

    def _check_accelerator(self) -> None:
        kind = self.accelerator.kind
        if kind not in Accelerator.KINDS:
            raise ValueError(f"unknown decode accelerator {kind!r}")
        if kind == "compile" and self.quantization not in COMPILABLE:
            raise ValueError(
                f"--compile runs --quantization none, int8 or int4, not {self.quantization}: "
                "torch.compile has not been tried on the oneDNN/FBGEMM kernels"
            )
        if kind == "cuda-graphs" and (self.device != "cuda" or self.tp != 1):
            raise ValueError("--cuda-graph-max-batch needs --device cuda and --tp 1")

    def devices(self) -> list[torch.device]:
        """One device per TP rank."""
        if self.device == "cuda":
            return [torch.device("cuda", r) for r in range(self.tp)]
        return [torch.device("cpu")] * self.tp

    def scratch_pages(self) -> range:
        """KV pages past the allocator's the accelerator uses: a CUDA-graph step pads its batch
        with sequences on a page of its own (page `num_pages`); a background compile warms up
        on pages of its own, past those."""
        first = self.num_pages + (1 if self.accelerator.kind == "cuda-graphs" else 0)
        return range(first, first + (SCRATCH_PAGES if self.accelerator.kind == "one-row" else 0))

    @property
    def pool_pages(self) -> int:
        """The KV pool's pages: the allocator's and the accelerator's scratch."""
        return self.scratch_pages().stop
