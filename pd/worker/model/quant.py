"""The linear layers `--quantization` picks (`QUANTIZATIONS`), and the weight-only quantized
ones on torch's CPU kernels (`int8`, `int4`); `fbgemm-int8`, `onednn-int8` and `onednn-bf16` are
in kernels.py, with `onednn-fp32` (fp32 weights in oneDNN's layout: dense, exact).

- int8: per output channel, symmetric (`w = q * scale`, q in -127..127);
  `torch.ops.aten._weight_int8pack_mm`.
- int4: groups of `group_size` inputs per output channel, asymmetric (q in 0..15);
  `torch.ops.aten._convert_weight_to_int4pack_for_cpu` packs, `_weight_int4pack_mm_for_cpu`
  multiplies. The kernel's convention is `w = (q - 8) * scale + zero`.

`GroupQuant` is a weight already quantized in groups (`w = q * scale + low`), as a GGUF file's
Q4_1 blocks are (32 weights, a scale `d` and a minimum `m` each): it maps onto the int4 kernel
exactly (`zero = low + 8 * scale`), so such weights are packed as they are, never rounded through
bf16. Everything else is quantized at load from its float weights. Only the weights are stored
quantized; activations are the model's dtype, except inside the kernels: torch's CPU kernels have
a vectorized path for bf16 only (on fp32 activations they ran tens of times slower:
docs/EXPERIMENTS.md §23), so an fp32 model runs them on bf16 activations (`_kernel_dtype`) and
gets fp32 back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from pd.config import QUANTIZATION_CHOICES, quantization_error, split_quantization
from pd.worker.model.config import ModelConfig
from pd.worker.model.int4_fp32 import INT4_FP32, Int4Fp32Linear
from pd.worker.model.kernels import (
    DYNAMIC_INT8,
    ONEDNN_DTYPES,
    ONEDNN_FP32,
    DynamicInt8Linear,
    OneDnnLinear,
    onednn_refusal,
    per_channel_int8,
)
from pd.worker.model.smooth_quant import SMOOTH_INT8, SmoothInt8Linear

# What `--quantization` takes besides `auto` (config.py): the weight format and kernel of the
# linear layers. none: dense in the compute dtype (F.linear); int8: weight-only int8 per channel
# (aten._weight_int8pack_mm, bf16 activations inside); int4: groups of --group-size; fbgemm-int8
# and onednn-int8: int8 weights with activations quantized to 8 (or 7) bits per call; onednn-bf16
# and onednn-fp32: bf16 or fp32 weights reordered for oneDNN; smooth-int8: fbgemm-int8 with the
# activations scaled per row and smoothed per channel (smooth_quant.py); int4-fp32: int4 groups
# multiplied in fp32 by pd's own kernel, one sum per row at every batch (int4_fp32.py).
QUANTIZATIONS = QUANTIZATION_CHOICES  # defined beside the flag (the config loads without torch)


INT4_FORMATS = ("int4", INT4_FP32)  # the formats that keep int4 groups (a GGUF's Q4_1 as stored)


def holds_int4(quantization: str) -> bool:
    """Whether a `--quantization` value packs int4 groups (alone or as half of a split)."""
    split = split_quantization(quantization)
    parts = (quantization,) if split is None else (split[0], split[2])
    return any(q in INT4_FORMATS for q in parts)


@dataclass(frozen=True)
class GroupQuant:
    """A Linear weight [out, in] in groups of `group` inputs: `w = q * scale + low`."""

    q: torch.Tensor  # uint8 [out, in], values 0..15
    scale: torch.Tensor  # float32 [out, in / group]
    low: torch.Tensor  # float32 [out, in / group]

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.scale.shape[1]

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        g = self.group
        q = self.q.view(self.q.shape[0], -1, g).float()
        w = q * self.scale.unsqueeze(-1) + self.low.unsqueeze(-1)
        return w.view(self.q.shape).to(dtype)

    def rows(self, start: int, end: int) -> GroupQuant:
        return GroupQuant(self.q[start:end], self.scale[start:end], self.low[start:end])

    def take_rows(self, order: torch.Tensor) -> GroupQuant:
        return GroupQuant(self.q[order], self.scale[order], self.low[order])

    def cols(self, start: int, end: int) -> GroupQuant:
        g = self.group
        if start % g or end % g:
            raise ValueError(
                f"inputs {start}:{end} do not fall on groups of {g}: pick a --group-size that "
                "divides every layer's input width on each TP rank"
            )
        return GroupQuant(
            self.q[:, start:end],
            self.scale[:, start // g : end // g],
            self.low[:, start // g : end // g],
        )

    @staticmethod
    def cat_rows(parts: Sequence[GroupQuant]) -> GroupQuant:
        return GroupQuant(
            torch.cat([p.q for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat([p.low for p in parts]),
        )


Weight = torch.Tensor | GroupQuant  # what a checkpoint hands the model for a Linear


class Linear(Protocol):
    """`y = x @ w.T (+ bias)` for x [T, in] in the model's dtype."""

    nbytes: int  # bytes of weights (and scales) one application reads

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class SplitLinear:
    """One weight in two formats (`--quantization SMALL@ROWS+LARGE`): a batch of at most `rows`
    rows on `small`'s kernel, a larger one on `large`'s. Both stay resident (`resident_bytes`);
    `nbytes` is what a small batch (a decode step's) reads."""

    def __init__(self, small: Linear, large: Linear, rows: int) -> None:
        self.small, self.large, self.rows = small, large, rows
        self.nbytes = small.nbytes
        self.resident_bytes = small.nbytes + large.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.small(x) if x.shape[0] <= self.rows else self.large(x)


class DenseLinear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias
        self.nbytes = _nbytes(weight, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def _kernel_dtype(dtype: torch.dtype) -> torch.dtype:
    """The activations' dtype inside the quantized kernels: fp32 runs them in bf16 (the only
    dtype with a vectorized CPU path: the module's note)."""
    return torch.bfloat16 if dtype == torch.float32 else dtype


class Int8Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        self.q, scale = per_channel_int8(weight)
        self.kernel_dtype = _kernel_dtype(dtype)
        self.scale = scale.to(self.kernel_dtype)
        self.bias = bias
        self.nbytes = _nbytes(self.q, self.scale, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x.to(self.kernel_dtype), self.q, self.scale)
        y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias


class Int4Linear:
    def __init__(self, weight: GroupQuant, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        self.group = weight.group
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            weight.q.to(torch.int32).contiguous(), 1
        )
        zero = weight.low + 8 * weight.scale  # the kernel's (q - 8) * scale + zero
        # [in / group, out, 2]: per group, per output channel, (scale, zero)
        self.kernel_dtype = _kernel_dtype(dtype)
        self.scales_zeros = (
            torch.stack([weight.scale.t(), zero.t()], dim=-1).to(self.kernel_dtype).contiguous()
        )
        self.bias = bias
        self.nbytes = _nbytes(self.packed, self.scales_zeros, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(self.kernel_dtype), self.packed, self.group, self.scales_zeros
        ).to(x.dtype)
        return y if self.bias is None else y + self.bias


def quantize_groups(w: torch.Tensor, group: int) -> GroupQuant:
    """Round a float weight [out, in] to 4 bits in groups of `group` inputs (min/max)."""
    out, inp = w.shape
    if inp % group:
        raise ValueError(f"--group-size {group} does not divide a layer's input width {inp}")
    wg = w.float().view(out, inp // group, group)
    low, high = wg.amin(dim=-1), wg.amax(dim=-1)
    scale = ((high - low) / 15).clamp(min=1e-12)
    q = torch.round((wg - low.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp(0, 15)
    return GroupQuant(q.to(torch.uint8).view(out, inp), scale, low)


def check_group_size(config: ModelConfig, tp: int, group_size: int) -> None:
    """Refuse a group size that does not divide every layer's input width on each TP rank."""
    widths = {
        "q/k/v and gate/up (hidden)": config.hidden_size,
        "o_proj": config.num_heads * config.head_dim // tp,
        "down_proj": config.intermediate_size // tp,
    }
    bad = {name: w for name, w in widths.items() if group_size < 1 or w % group_size}
    if bad:
        fits = [g for g in (32, 64, 128, 256) if all(w % g == 0 for w in widths.values())]
        raise ValueError(
            f"--group-size {group_size} does not divide the input width of "
            + ", ".join(f"{name} ({w})" for name, w in bad.items())
            + f" at --tp {tp}; group sizes that do: {', '.join(map(str, fits)) or 'none'}"
        )


def make_linear(
    weight: Weight,
    bias: torch.Tensor | None,
    quantization: str,
    group_size: int,
    dtype: torch.dtype,
    device: torch.device,
    act_max: torch.Tensor | None = None,
) -> Linear:
    """The layer for one rank's slice of a weight, as `--quantization` asks; `act_max`: the
    largest |input| per channel of this slice on the calibration text, for smooth-int8
    (smooth_quant.py; it smooths a layer that has one)."""
    if quantization != "none" and device.type != "cpu":
        raise ValueError(
            f"--quantization {quantization} runs on torch's CPU kernels; on {device.type} use "
            "--quantization none"
        )
    split = split_quantization(quantization)
    if split is not None:
        small, rows, large = split
        return SplitLinear(
            make_linear(weight, bias, small, group_size, dtype, device, act_max),
            make_linear(weight, bias, large, group_size, dtype, device, act_max),
            rows,
        )
    b = None if bias is None else bias.to(device=device, dtype=dtype).contiguous()
    if quantization in INT4_FORMATS:
        if not isinstance(weight, GroupQuant) or weight.group != group_size:
            dense = weight.dequantize() if isinstance(weight, GroupQuant) else weight
            weight = quantize_groups(dense, group_size)
        if quantization == INT4_FP32:
            return Int4Fp32Linear(weight.q, weight.scale, weight.low, b)
        return Int4Linear(weight, b, dtype)
    dense = weight.dequantize() if isinstance(weight, GroupQuant) else weight
    if quantization == "int8":
        return Int8Linear(dense, b, dtype)
    if quantization in DYNAMIC_INT8:
        return DynamicInt8Linear(dense, b, DYNAMIC_INT8[quantization])
    if quantization in ONEDNN_DTYPES:
        return OneDnnLinear(dense, b, quantization)
    if quantization == SMOOTH_INT8:
        return SmoothInt8Linear(dense, b, act_max)
    if quantization == "none":
        return DenseLinear(dense.to(device=device, dtype=dtype).contiguous(), b)
    raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}")


def head_quantization(quantization: str, dtype: torch.dtype) -> str:
    """The LM head's format for the layers' `quantization` in `dtype`: the same kernel, except
    int4 layers get an int8 head (the largest matrix a step reads, kept at 8 bits), and
    smooth-int8 ones (no calibration for the head, and scaled per row alone it failed the
    perplexity bound under the AVX2 cap: docs/EXPERIMENTS.md §14) an exact one, in oneDNN's
    layout where it runs, and int4-fp32 ones the exact fp32 head (the GGUF's head is not Q4_1:
    int4 groups made from it again failed the bound, docs/EXPERIMENTS.md §20); a split's
    halves each so (the head stays a split unless both halves come out the same)."""
    split = split_quantization(quantization)
    if split is not None:
        small, large = head_quantization(split[0], dtype), head_quantization(split[2], dtype)
        return small if small == large else f"{small}@{split[1]}+{large}"
    if quantization == SMOOTH_INT8:
        exact = [q for q, t in ONEDNN_DTYPES.items() if t == dtype] + [ONEDNN_FP32]
        return next((q for q in exact if not onednn_refusal(q)), "none")
    if quantization == INT4_FP32:  # fp32 arithmetic: the head's exact fp32 weights
        return "none" if onednn_refusal(ONEDNN_FP32) else ONEDNN_FP32
    return "int8" if quantization == "int4" else quantization


def check_quantization(quantization: str) -> None:
    """Refuse a `--quantization` value (not auto) this module cannot build."""
    why = quantization_error(quantization)
    if why:
        raise ValueError(why)


def rows(w: Weight, start: int, end: int) -> Weight:
    return w.rows(start, end) if isinstance(w, GroupQuant) else w[start:end]


def take_rows(w: Weight, order: torch.Tensor) -> Weight:
    """Rows `order` of `w` (a reordering: exact for either kind)."""
    return w.take_rows(order) if isinstance(w, GroupQuant) else w[order]


def cols(w: Weight, start: int, end: int, quantization: str, group_size: int) -> Weight:
    """Inputs `start:end` of `w` (a TP rank's slice of a row-parallel layer). A group-quantized
    weight is cut on its groups when it will be packed as it is, else dequantized first."""
    if isinstance(w, GroupQuant):
        if holds_int4(quantization) and w.group == group_size:
            return w.cols(start, end)
        w = w.dequantize()
    if holds_int4(quantization) and (end - start) % group_size:
        raise ValueError(
            f"--group-size {group_size} does not divide {end - start}, a layer's input width "
            "on each TP rank: pick a group size that does"
        )
    return w[:, start:end]


def cat_rows(parts: Sequence[Weight]) -> Weight:
    if all(isinstance(p, GroupQuant) for p in parts):
        return GroupQuant.cat_rows([p for p in parts if isinstance(p, GroupQuant)])
    return torch.cat([p.dequantize() if isinstance(p, GroupQuant) else p for p in parts])


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
