"""Linear layers on torch's oneDNN and FBGEMM CPU kernels (issue 24), beside quant.py's
weight-only int8/int4 ones, and the builders `pd-bench kernels` times them with.

- `onednn-bf16`: the weight in bf16, reordered once for oneDNN
  (`mkldnn._reorder_linear_weight`), multiplied by `mkldnn._linear_pointwise` (AMX or
  AVX512-BF16 dot products where the CPU has them). torch refuses the reorder on a CPU without a
  bf16 path: `onednn_refusal` says so before a worker is built on it.
- `onednn-fp32`: the same with the weight in fp32: exact fp32 products (no bf16, no
  quantization), in oneDNN's blocked layout made once rather than MKL's sgemm repacking the
  weight at every call: under the AVX2 cap it was faster than `F.linear` at every batch timed,
  the LM head's too (docs/EXPERIMENTS.md §13, "The linear layers at decode batches").
- `fbgemm-int8` / `onednn-int8`: `quantized.linear_prepack` of per-channel symmetric int8 weights
  (`w = q * scale`, q in -127..127), `quantized.linear_dynamic` at each call: the activations are
  quantized per tensor to uint8 inside the kernel and the products summed in int32. With
  `reduce_range` the activations get 7 bits: on AVX2 FBGEMM sums u8 x s8 pairs into int16, which
  saturates at 8 bits; VNNI (AVX512-VNNI) sums into int32, so FBGEMM takes 8 bits there. oneDNN
  is always run with 7 bits (the setting the probe measured within its tolerance).

These kernels take fp32 activations (dynamic int8) or bf16 ones (oneDNN bf16): a layer converts
the model's activations into them and its answer back, so either compute dtype runs either
format. The packed weight runs on the library it was packed with, whatever
`torch.backends.quantized.engine` is later.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from pd.worker.model.tuning.cpu_info import read_cpu_info

# --quantization values that run here: the name and the quantized engine (None: oneDNN bf16)
DYNAMIC_INT8 = {"fbgemm-int8": "fbgemm", "onednn-int8": "onednn"}
ONEDNN_BF16 = "onednn-bf16"
ONEDNN_FP32 = "onednn-fp32"
ONEDNN_DTYPES = {ONEDNN_BF16: torch.bfloat16, ONEDNN_FP32: torch.float32}  # weights and products
# The batch a weight's oneDNN layout is reordered for: laid out for 32 rows, both dtypes ran
# faster than laid out for one at every batch timed (docs/EXPERIMENTS.md §13).
REORDER_ROWS = 32


@contextmanager
def quantized_engine(name: str) -> Iterator[None]:
    """torch.backends.quantized.engine set to `name` while weights are packed."""
    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = name
    try:
        yield
    finally:
        torch.backends.quantized.engine = before


def per_channel_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [out, in] in -127..127, scale fp32 [out]): symmetric, per output channel."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale


def per_channel_qtensor(w: torch.Tensor) -> torch.Tensor:
    """`w` as torch's per-channel quantized tensor (what `linear_prepack` takes)."""
    q, scale = per_channel_int8(w)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensor creation is deprecated (torch 2.10+)
        return torch._make_per_channel_quantized_tensor(
            q, scale.double(), torch.zeros_like(scale, dtype=torch.long), 0
        )


def prepack_int8(w: torch.Tensor, engine: str) -> torch.Tensor:
    """The packed int8 weight for `quantized.linear_dynamic` on `engine` (fbgemm or onednn)."""
    with quantized_engine(engine):
        packed: torch.Tensor = torch.ops.quantized.linear_prepack(per_channel_qtensor(w), None)
    return packed


def reorder_onednn(w: torch.Tensor, dtype: torch.dtype, rows: int) -> torch.Tensor:
    """`w` in `dtype`, reordered for `mkldnn._linear_pointwise` at batches of `rows`."""
    reordered: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(w.to(dtype), rows)
    return reordered


def linear_onednn(x: torch.Tensor, reordered: torch.Tensor) -> torch.Tensor:
    y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, reordered, None, "none", [], "")
    return y


def linear_dynamic(x: torch.Tensor, packed: torch.Tensor, reduce_range: bool) -> torch.Tensor:
    y: torch.Tensor = torch.ops.quantized.linear_dynamic(x, packed, reduce_range)
    return y


def reduce_range_for(engine: str, flags: frozenset[str]) -> bool:
    """Whether `linear_dynamic` on `engine` must quantize activations to 7 bits on a CPU with
    `flags` (module docstring): FBGEMM only without AVX512-VNNI, oneDNN always."""
    return engine != "fbgemm" or "avx512_vnni" not in flags


@functools.cache
def onednn_refusal(quantization: str = ONEDNN_BF16) -> str:
    """Why this CPU's torch cannot run oneDNN's linear of `quantization` ("" if it can): torch
    refuses the bf16 reorder without a bf16 path (AVX512-BF16, AMX or AVX-NE-CONVERT), and
    either without oneDNN."""
    dtype = ONEDNN_DTYPES[quantization]
    if not torch.backends.mkldnn.is_available():
        return "torch was built without oneDNN (mkldnn)"
    try:
        w = reorder_onednn(torch.zeros(16, 16), dtype, 1)
        linear_onednn(torch.zeros(1, 16, dtype=dtype), w)
    except (RuntimeError, NotImplementedError) as e:
        return str(e).splitlines()[0][:160]
    return ""


def onednn_bf16_refusal() -> str:
    return onednn_refusal(ONEDNN_BF16)


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class OneDnnLinear:
    """Weights in bf16 (`onednn-bf16`) or fp32 (`onednn-fp32`) reordered for oneDNN; activations
    in that dtype inside, the model's dtype out."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        quantization: str = ONEDNN_BF16,
        rows: int = REORDER_ROWS,
    ) -> None:
        why = onednn_refusal(quantization)
        if why:
            raise ValueError(
                f"--quantization {quantization}: this CPU's torch has no oneDNN "
                f"{str(ONEDNN_DTYPES[quantization]).removeprefix('torch.')} linear ({why}); "
                "use --quantization none or auto"
            )
        self.dtype = ONEDNN_DTYPES[quantization]
        self.weight = reorder_onednn(weight, self.dtype, rows)
        self.bias = bias
        self.nbytes = weight.numel() * self.dtype.itemsize + _nbytes(bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = linear_onednn(x.to(self.dtype), self.weight).to(x.dtype)
        return y if self.bias is None else y + self.bias


class DynamicInt8Linear:
    """int8 weights per channel on FBGEMM or oneDNN; activations quantized per call (fp32 in)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        engine: str,
        reduce_range: bool | None = None,
    ) -> None:
        if engine not in torch.backends.quantized.supported_engines:
            raise ValueError(
                f"torch on this machine has no {engine} quantized engine (it has "
                f"{', '.join(torch.backends.quantized.supported_engines)})"
            )
        self.engine = engine
        self.packed = prepack_int8(weight, engine)
        if reduce_range is None:
            reduce_range = reduce_range_for(engine, read_cpu_info().flags)
        self.reduce_range = reduce_range
        self.bias = bias
        out, inp = weight.shape
        self.nbytes = out * inp + out * 4 + _nbytes(bias)  # int8 weights, fp32 scales

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = linear_dynamic(x.float(), self.packed, self.reduce_range).to(x.dtype)
        return y if self.bias is None else y + self.bias
