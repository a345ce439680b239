"""`--quantization smooth-int8`: int8 weights and activations on FBGEMM's dynamic int8 kernel,
the activations scaled per row and smoothed per channel (SmoothQuant), for every decoder linear
layer; the LM head exact by its rule (`quant.head_quantization`), or as the search or
`--lm-head-quantization` says (a smooth-int8 head is scaled per row, not smoothed: it has no
calibration).

FBGEMM's dynamic int8 (`fbgemm-int8`) quantizes a call's activations with one scale for the
whole tensor, to 7 bits without AVX512-VNNI (kernels.py): the model's perplexity on the shipped
text then lies far outside the bound, with AVX512-VNNI or without (docs/EXPERIMENTS.md §14). Two
rescalings that leave the product unchanged fix that:

- per channel (SmoothQuant, Xiao et al., 2023): a few input channels far larger than the rest
  take the whole range. Channel j is divided by `s_j = sqrt(a_j / w_j)` (a_j its largest
  |activation| on a calibration text, w_j the largest |weight| in its column) and the weight's
  column multiplied by it, so both halves share the spread (alpha 0.5 of the paper: 0.7 and
  0.85 came out worse here);
- per row: each row of the call's activations is divided by its own largest value before the
  kernel quantizes the tensor and its output row multiplied back, so every row (a token) uses
  the whole 7 or 8 bits, as a per-token quantization would (a one-row call needs nothing: ~4
  small ops a layer saved, 120 a decode step of the default model).

Under the AVX2 cap (7 bits) only the two together kept the four kinds of layer (q/k/v, o, gate/up,
down) within the bound; smoothing alone or scaling rows alone did not (docs/EXPERIMENTS.md §13 and
§14). The calibration text (`data/calibration.txt`: a chat, code, minutes, prose; read by
tuning/calibration.py) is not the one the bound is judged on.

Both rescalings are a multiply of the call's activations (folding 1/s into the norm's weight
would save one, but ties every other format of the layer to the scaled weights; o and down have
no norm before them) and one of its output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pd.config import quantization_formats
from pd.worker.model.kernels import DynamicInt8Linear

SMOOTH_INT8 = "smooth-int8"
ALPHA = 0.5  # the share of the spread moved into the weights
KINDS = ("qkv", "o", "gate_up", "down")  # a decoder layer's linear layers (llama.LayerShard)


def holds_smooth(quantization: str) -> bool:
    """Whether a `--quantization` value runs smooth-int8 (alone or as half of a split)."""
    return SMOOTH_INT8 in quantization_formats(quantization)


@dataclass(frozen=True)
class ActivationMaxima:
    """Each decoder layer's largest |input| per channel of each of its linear layers (`KINDS`),
    fp32, on the calibration text, over the whole input (one TP rank's slice: `ranks_slice`)."""

    layers: list[dict[str, torch.Tensor]]

    def at(self, layer: int) -> dict[str, torch.Tensor]:
        return self.layers[layer]


def smoothing_scales(act_max: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """s [in]: x / s and w * s (per input column) have the same product, their spreads shared
    by ALPHA."""
    a = act_max.float().clamp(min=1e-5)
    w = weight.float().abs().amax(0).clamp(min=1e-5)
    return (a.pow(ALPHA) / w.pow(1 - ALPHA)).clamp(min=1e-5)


class SmoothInt8Linear:
    """FBGEMM's dynamic int8 on `weight * s` (per input column), called on `x / s` with each row
    scaled to its largest value (the output row scaled back); no s without `act_max`."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, act_max: torch.Tensor | None
    ) -> None:
        weight = weight.float()
        self.inv_s: torch.Tensor | None = None
        if act_max is not None:
            s = smoothing_scales(act_max, weight)
            self.inv_s = (1.0 / s).contiguous()
            weight = weight * s[None, :]
        self.layer = DynamicInt8Linear(weight, None, "fbgemm")
        self.bias = bias
        self.nbytes = self.layer.nbytes + (0 if act_max is None else weight.shape[1] * 4)
        self.nbytes += 0 if bias is None else bias.numel() * bias.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if self.inv_s is not None:
            xf = xf * self.inv_s
        if xf.shape[0] == 1:  # the kernel's one scale is the row's own
            y = self.layer(xf)
        else:
            peak = torch.linalg.vector_norm(xf, float("inf"), dim=1, keepdim=True)  # [rows, 1]
            peak = peak.clamp_(min=1e-12)
            y = self.layer(xf / peak).mul_(peak)
        y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias
