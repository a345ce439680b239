"""SmoothQuant's calibration (smooth_quant.py): each decoder layer's largest |input| per channel
of its linear layers, from one prefill of the calibration text by the fp32 dense model. Part of
the tuning wing: it builds a `ModelRunner` for the prefill, so it sits above the runner, and the
worker's builder (or the kernel search) hands the maxima down to the runner it builds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from importlib import resources

import torch

from pd.worker.model.config import ModelConfig
from pd.worker.model.runner import ModelRunner
from pd.worker.model.runner_config import RunnerConfig
from pd.worker.model.smooth_quant import KINDS, ActivationMaxima
from pd.worker.model.tuning.perplexity import final_hidden, pages_for


def calibration_text() -> str:
    return resources.files("pd.worker.model").joinpath("data/calibration.txt").read_text()


class _Recording:
    """A linear layer that keeps the largest |input| per channel of every call."""

    def __init__(self, layer: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.layer = layer
        self.max: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = x.detach().abs().amax(0).float()
        self.max = m if self.max is None else torch.maximum(self.max, m)
        return self.layer(x)


@torch.inference_mode()
def activation_maxima(
    config: ModelConfig,
    weights: Mapping,
    encode: Callable[[str], Sequence[int]],
) -> ActivationMaxima:
    """The maxima, from one prefill of the calibration text by the fp32 dense model on one rank
    (built for it and dropped after; cheap for the default model: docs/EXPERIMENTS.md §23)."""
    ids = list(encode(calibration_text()))
    rc = RunnerConfig(
        tp=1, dtype=torch.float32, device="cpu",
        num_pages=pages_for(len(ids), 16) + 1, page_size=16, max_model_len=len(ids) + 16,
    )  # fmt: skip
    runner = ModelRunner(config, weights, rc)
    recorded = []
    for shard in runner.model.ranks[0].layers:
        rec = {kind: _Recording(getattr(shard, kind)) for kind in KINDS}
        for kind, r in rec.items():
            setattr(shard, kind, r)
        recorded.append(rec)
    final_hidden(runner, ids)
    out = []
    for i, rec in enumerate(recorded):
        maxima = {kind: r.max for kind, r in rec.items() if r.max is not None}
        if len(maxima) != len(KINDS):
            raise RuntimeError(f"the calibration's prefill did not call layer {i}'s linear layers")
        out.append(maxima)
    return ActivationMaxima(out)
