"""The linear-layer kernels `pd-bench kernels` times: every way torch can compute `x @ w.T` on a
CPU that a worker could choose (issue 24), each built from an fp32 weight.

A candidate is a compute dtype (what the activations are in) and a weight format, reached
through one torch op. `build(w, rows)` returns the layer, a function of `x` [rows, in] in
`act_dtype`; `rows` is the batch the weight may be laid out for (the packed fp32 kernels
reorder it for one batch size; the others ignore it). `rel_tol` is the most the output may differ
from fp32's (max abs difference over max abs of the fp32 output) on random inputs: what the
format loses with a margin, far below what a wrong layout or a saturating kernel gives (~0.1-1).

pd reaches three of them today: `fp32` (`--dtype float32`, what `auto` is on a CPU without
AVX512-BF16/AMX), `bf16` (`--dtype bfloat16`), and `int8pack-bf16` / `int4pack-bf16`
(`--quantization int8|int4`: pd's own `Int8Linear` / `Int4Linear`, which run an fp32 model's
activations in bf16 inside the kernel). The oneDNN and FBGEMM builders are the worker's own
(pd/worker/model/kernels.py: `--quantization onednn-bf16|fbgemm-int8|onednn-int8`); the FBGEMM/
oneDNN int8 ones take a quantized weight tensor, a tensor type torch now warns is deprecated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pd.worker.model.int4_fp32 import Int4Fp32Linear
from pd.worker.model.kernels import (
    linear_dynamic,
    linear_onednn,
    per_channel_int8,
    prepack_int8,
    quantized_engine,
    reorder_onednn,
)
from pd.worker.model.quant import Int4Linear, Int8Linear, quantize_groups
from pd.worker.model.tuning.cpu_info import CpuInfo

Layer = Callable[[torch.Tensor], torch.Tensor]
GROUP = 32  # int4 group size (pd's default --group-size; GGUF's Q4_1 blocks)


@dataclass(frozen=True)
class Candidate:
    name: str
    act_dtype: torch.dtype  # what the model's activations are in around this layer
    weights: str  # the stored format: "fp32", "bf16", "fp16", "int8/ch", "int4/g32"
    weight_bits: float  # bits a step reads per weight (scales included)
    op: str  # the torch op that computes
    rel_tol: float
    build: Callable[[torch.Tensor, int], Layer]
    pd_today: str = ""  # the worker's flags that run it today ("" if none)
    # a CPU flag without which the kernel is known to lose more than `rel_tol` (full 8-bit
    # activations in FBGEMM or oneDNN's s8 x s8: AVX2's u8 x s8 pair sums saturate int16; VNNI
    # sums into int32)
    exact_needs: str = ""
    # why it is not timed on a CPU ("" if it is): a kernel torch only ships elsewhere
    skip_unless: Callable[[CpuInfo], str] = lambda cpu: ""


def _dense(dtype: torch.dtype) -> Callable[[torch.Tensor, int], Layer]:
    def build(w: torch.Tensor, rows: int) -> Layer:
        wd = w.to(dtype).contiguous()
        return lambda x: F.linear(x, wd)

    return build


def _mkl_packed(w: torch.Tensor, rows: int) -> Layer:
    packed = torch.ops.mkl._mkl_reorder_linear_weight(w, rows)
    return lambda x: torch.ops.mkl._mkl_linear(x, packed, w, None, rows)


def _onednn(dtype: torch.dtype) -> Callable[[torch.Tensor, int], Layer]:
    def build(w: torch.Tensor, rows: int) -> Layer:
        packed = reorder_onednn(w, dtype, rows)
        return lambda x: linear_onednn(x, packed)

    return build


def _pd_int8(w: torch.Tensor, rows: int) -> Layer:
    return Int8Linear(w, None, torch.float32)


def _int8pack_fp32(w: torch.Tensor, rows: int) -> Layer:
    q, scale = per_channel_int8(w)
    return lambda x: torch.ops.aten._weight_int8pack_mm(x, q, scale)


def _pd_int4(w: torch.Tensor, rows: int) -> Layer:
    return Int4Linear(quantize_groups(w, GROUP), None, torch.float32)


def _pd_int4_fp32(w: torch.Tensor, rows: int) -> Layer:
    g = quantize_groups(w, GROUP)
    try:
        return Int4Fp32Linear(g.q, g.scale, g.low, None)
    except ValueError as e:  # no AVX2 or no C compiler here: try_build reports it
        raise RuntimeError(str(e)) from e


def _int4pack_fp32(w: torch.Tensor, rows: int) -> Layer:
    g = quantize_groups(w, GROUP)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(g.q.to(torch.int32), 1)
    zero = g.low + 8 * g.scale  # the kernel's (q - 8) * scale + zero
    sz = torch.stack([g.scale.t(), zero.t()], dim=-1).contiguous()  # [in / group, out, 2] fp32
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, sz)


def _dynamic_int8(engine: str, reduce_range: bool) -> Callable[[torch.Tensor, int], Layer]:
    """quantized::linear_dynamic: activations quantized per tensor to uint8 at each call (7 bits
    with `reduce_range`: AVX2's u8 x s8 pair sums saturate int16 at 8), int32 accumulation."""

    def build(w: torch.Tensor, rows: int) -> Layer:
        packed = prepack_int8(w, engine)
        return lambda x: linear_dynamic(x, packed, reduce_range)

    return build


def _fbgemm_fp16(w: torch.Tensor, rows: int) -> Layer:
    with quantized_engine("fbgemm"):
        packed = torch.ops.quantized.linear_prepack_fp16(w, None)
    return lambda x: torch.ops.quantized.linear_dynamic_fp16(x, packed)


def _int_mm(w: torch.Tensor, rows: int) -> Layer:
    """torch._int_mm (int8 x int8 -> int32) with the activations quantized per row by hand."""
    q, scale = per_channel_int8(w)
    qt = q.t()

    def layer(x: torch.Tensor) -> torch.Tensor:
        xs = (x.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-12)
        xq = torch.round(x / xs).to(torch.int8)
        return torch._int_mm(xq, qt) * xs * scale

    return layer


def _kleidiai_int4(w: torch.Tensor, rows: int) -> Layer:
    """aten._dyn_quant_matmul_4bit: int4 symmetric in groups of 32 (q in -8..7, two a byte,
    bf16 scales), activations quantized to int8 per row inside."""
    out, inp = w.shape
    wg = w.view(out, inp // GROUP, GROUP)
    scale = (wg.abs().amax(dim=-1) / 7).clamp(min=1e-12)
    q = (torch.round(wg / scale[..., None]).clamp(-8, 7) + 8).to(torch.uint8).view(out, inp)
    nibbles = (q[:, 1::2] << 4 | q[:, ::2]).contiguous()
    packed = torch.ops.aten._dyn_quant_pack_4bit_weight(
        nibbles, scale.to(torch.bfloat16), None, GROUP, inp, out
    )
    return lambda x: torch.ops.aten._dyn_quant_matmul_4bit(x, packed, GROUP, inp, out)


def _arm_only(cpu: CpuInfo) -> str:
    if cpu.arch in ("aarch64", "arm64"):
        return ""
    return "KleidiAI is built for Arm only: elsewhere torch runs a scalar reference"


f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16

CANDIDATES: tuple[Candidate, ...] = (
    Candidate("fp32", f32, "fp32", 32, "F.linear (MKL sgemm)", 1e-4, _dense(f32),
              "--dtype float32 (auto here)"),
    Candidate("fp32-mkl-packed", f32, "fp32", 32, "mkl._mkl_linear (packed for the batch)", 1e-4,
              _mkl_packed),
    Candidate("fp32-onednn", f32, "fp32", 32, "mkldnn._linear_pointwise (reordered)", 1e-4,
              _onednn(f32), "--quantization onednn-fp32"),
    Candidate("bf16", bf16, "bf16", 16, "F.linear", 2e-2, _dense(bf16), "--dtype bfloat16"),
    Candidate("bf16-onednn", bf16, "bf16", 16, "mkldnn._linear_pointwise (reordered)", 2e-2,
              _onednn(bf16), "--quantization onednn-bf16"),
    Candidate("fp16", f16, "fp16", 16, "F.linear", 5e-3, _dense(f16)),
    Candidate("fbgemm-fp16", f32, "fp16", 16, "quantized.linear_dynamic_fp16", 5e-3,
              _fbgemm_fp16),
    Candidate("int8pack-bf16", f32, "int8/ch", 8, "aten._weight_int8pack_mm, bf16 inside", 5e-2,
              _pd_int8, "--quantization int8"),
    Candidate("int8pack-fp32", f32, "int8/ch", 8, "aten._weight_int8pack_mm", 5e-2,
              _int8pack_fp32),
    Candidate("fbgemm-int8", f32, "int8/ch", 8, "quantized.linear_dynamic (reduce_range)", 7e-2,
              _dynamic_int8("fbgemm", True), "--quantization fbgemm-int8 (no VNNI)"),
    Candidate("fbgemm-int8-full", f32, "int8/ch", 8, "quantized.linear_dynamic", 7e-2,
              _dynamic_int8("fbgemm", False), "--quantization fbgemm-int8 (VNNI)",
              exact_needs="avx512_vnni"),
    Candidate("onednn-int8", f32, "int8/ch", 8, "quantized.linear_dynamic (oneDNN, reduce_range)",
              7e-2, _dynamic_int8("onednn", True), "--quantization onednn-int8"),
    Candidate("int_mm-int8", f32, "int8/ch", 8, "torch._int_mm, activations int8 per row", 7e-2,
              _int_mm, exact_needs="avx512_vnni"),
    Candidate("int4pack-bf16", f32, "int4/g32", 5, "aten._weight_int4pack_mm_for_cpu, bf16 "
              "inside", 0.15, _pd_int4, "--quantization int4"),
    Candidate("int4pack-fp32", f32, "int4/g32", 5, "aten._weight_int4pack_mm_for_cpu", 0.15,
              _int4pack_fp32),
    Candidate("int4-fp32", f32, "int4/g32", 5, "pd's int4_fp32.c (fp32 sums, one a row)", 0.15,
              _pd_int4_fp32, "--quantization int4-fp32"),
    Candidate("kleidiai-int4", f32, "int4/g32 sym", 4.5, "aten._dyn_quant_matmul_4bit", 0.25,
              _kleidiai_int4, skip_unless=_arm_only),
)  # fmt: skip

BY_NAME = {c.name: c for c in CANDIDATES}


def rel_error(y: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max abs error, max abs error / max abs of `ref`) of `y` against `ref`."""
    err = (y.double() - ref.double()).abs().max().item()
    return err, err / max(ref.abs().max().item(), 1e-30)


def try_build(c: Candidate, w: torch.Tensor, rows: int) -> tuple[Layer | None, str]:
    """(the layer, "") or (None, why it cannot run on this machine): a kernel torch refuses here
    (oneDNN's bf16 path needs AVX512-BF16 or AVX-NE-CONVERT, say) is a finding, not a crash."""
    try:
        layer = c.build(w, rows)
        layer(torch.zeros(rows, w.shape[1], dtype=c.act_dtype))
    except (RuntimeError, NotImplementedError) as e:
        return None, str(e).splitlines()[0][:160]
    return layer, ""
