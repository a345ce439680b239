"""`--quantization smooth-int8`: SmoothQuant's int8 on FBGEMM for the layers that read a norm's
output (q/k/v and gate/up), oneDNN in the compute dtype for the others (o, down) and the LM head.

FBGEMM's dynamic int8 (`fbgemm-int8`) quantizes a call's activations per tensor, to 7 bits
without AVX512-VNNI: a few input channels far larger than the rest (the norms' outputs have
them) take the whole range, and the model's perplexity on the shipped text went to 1.041x fp32's
with q/k/v alone, 1.124x with gate/up alone (bound 1.02x). SmoothQuant (Xiao et al., 2023) moves
that spread into the weights: input channel j is divided by `s_j = a_j^alpha / w_j^(1-alpha)`
(a_j the channel's largest activation on a calibration text, w_j the weight's largest in that
column) and the weight's column multiplied by it, so the product is the same and both halves
quantize well. With alpha 0.5, maxima taken on `data/calibration.txt` (not the text the bound is
judged on), q/k/v and gate/up together came to 1.003x on the AVX512 kind (8 bits) and within the
bound under the AVX2 cap (7 bits; docs/EXPERIMENTS.md section 14). o and down fail per tensor
even smoothed (1.049x with all four): they stay exact, in oneDNN's layout.

The division is one multiply of the call's activations by 1/s (folding it into the norm's
weight would save it, but would tie every other format of the same layer to the scaled weights).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources

import torch

from pd.config import quantization_formats
from pd.worker.model.config import ModelConfig
from pd.worker.model.kernels import DynamicInt8Linear, OneDnnLinear

SMOOTH_INT8 = "smooth-int8"
ALPHA = 0.5  # the share of the spread moved into the weights (0.5, 0.7, 0.85 tried: section 14)
SMOOTHED = ("qkv", "gate_up")  # the layers that read a norm's output
ONEDNN_OF_DTYPE = {torch.float32: "onednn-fp32", torch.bfloat16: "onednn-bf16"}


def holds_smooth(quantization: str) -> bool:
    """Whether a `--quantization` value runs smooth-int8 (alone or as half of a split)."""
    return SMOOTH_INT8 in quantization_formats(quantization)


def calibration_text() -> str:
    return resources.files("pd.worker.model").joinpath("data/calibration.txt").read_text()


@dataclass(frozen=True)
class ActivationMaxima:
    """Each layer's largest |activation| per input channel [hidden] (fp32) on the calibration
    text: at the input norm's output (q/k/v's input) and the post-attention norm's (gate/up's)."""

    attn: list[torch.Tensor]
    mlp: list[torch.Tensor]

    @staticmethod
    def flat(config: ModelConfig) -> ActivationMaxima:
        """Ones: for a layer timed on random weights (a kernel's time does not depend on the
        values)."""
        ones = [torch.ones(config.hidden_size) for _ in range(config.num_layers)]
        return ActivationMaxima(ones, list(ones))


class _Recording:
    """A norm that keeps the largest |output| per channel of every call."""

    def __init__(self, norm: Callable[[torch.Tensor], torch.Tensor], into: list[torch.Tensor]):
        self.norm, self.into = norm, into

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        m = y.detach().abs().amax(0).float()
        self.into.append(m if not self.into else torch.maximum(self.into.pop(), m))
        return y


@torch.inference_mode()
def activation_maxima(
    config: ModelConfig,
    weights: Mapping[str, torch.Tensor] | Mapping,
    encode: Callable[[str], Sequence[int]],
) -> ActivationMaxima:
    """The maxima, from one prefill of the calibration text by the fp32 dense model on one rank
    (built for it and dropped after; ~1 s for the default model on two cores)."""
    from pd.worker.model.perplexity import final_hidden, pages_for
    from pd.worker.model.runner import ModelRunner

    ids = list(encode(calibration_text()))
    runner = ModelRunner(
        config, weights, tp=1, dtype=torch.float32, device="cpu",
        num_pages=pages_for(len(ids), 16) + 1, page_size=16, max_model_len=len(ids) + 16,
    )  # fmt: skip
    model = runner.model
    attn: list[list[torch.Tensor]] = [[] for _ in range(config.num_layers)]
    mlp: list[list[torch.Tensor]] = [[] for _ in range(config.num_layers)]
    model.norms = [
        (_Recording(a, attn[i]), _Recording(b, mlp[i]))  # type: ignore[misc]
        for i, (a, b) in enumerate(model.norms)
    ]
    final_hidden(runner, ids)
    return ActivationMaxima([m[0] for m in attn], [m[0] for m in mlp])


def smoothing_scales(act_max: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """s [in]: x / s and w * s (per input column) have the same product, their spreads shared
    by ALPHA."""
    a = act_max.float().clamp(min=1e-5)
    w = weight.float().abs().amax(0).clamp(min=1e-5)
    return (a.pow(ALPHA) / w.pow(1 - ALPHA)).clamp(min=1e-5)


class SmoothInt8Linear:
    """FBGEMM's dynamic int8 on `weight * s` (per input column), called on `x / s`."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, act_max: torch.Tensor
    ) -> None:
        s = smoothing_scales(act_max, weight)
        self.inv_s = (1.0 / s).contiguous()
        self.layer = DynamicInt8Linear(weight.float() * s[None, :], bias, "fbgemm")
        self.nbytes = self.layer.nbytes + self.inv_s.numel() * 4

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x.float() * self.inv_s).to(x.dtype)


def make_smooth_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    act_max: torch.Tensor | None,
) -> SmoothInt8Linear | OneDnnLinear:
    """smooth-int8's layer: SmoothQuant int8 where `act_max` is given (a layer that reads a
    norm's output), oneDNN in `dtype` elsewhere."""
    if act_max is not None:
        return SmoothInt8Linear(weight, bias, act_max)
    if dtype not in ONEDNN_OF_DTYPE:
        raise ValueError(f"--quantization {SMOOTH_INT8} runs in float32 or bfloat16, not {dtype}")
    return OneDnnLinear(weight, bias, ONEDNN_OF_DTYPE[dtype])
