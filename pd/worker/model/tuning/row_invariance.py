"""Whether a weight format computes a row the same way in any batch: the judge that keeps a
format out of `auto` when a request's answer would depend on the load.

A kernel may take another path for one row than for many (a matrix-vector product against a
matrix one), or block the rows and sum in another order beyond a block's size; a greedy answer
then changes with the number of requests decoding beside it. The weight-only `int4` (the GGUF's
Q4_1 as written) and `int8` walk rows one by one; fp32 `none` takes a matrix-vector kernel for
one row, bf16 `none` and `onednn-bf16` block the rows, `onednn-fp32` differs on one layer shape
and not on another, and the dynamic int8 formats quantize the activations with one scale a
call, so a row's neighbours change it (which format differs at which batch, on each machine
kind: docs/EXPERIMENTS.md §15). Since it depends on the machine and on each shape, it is
measured: on every linear layer shape of one rank and on the LM head, with seeded random weights
(a kernel's path does not depend on the values), a batch of each size in `batch_rows` against the
one before (every row they share) and its last row against the same row alone, bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

import pd.worker.model.quant as quant
import pd.worker.model.tuning.knobs as knobs
from pd.worker.model.config import ModelConfig
from pd.worker.model.device import DTYPES
from pd.worker.model.smooth_quant import KINDS
from pd.worker.model.tuning.kernel_search import linear_shapes


def batch_rows(largest: int, also: Sequence[int] = ()) -> list[int]:
    """The batch sizes a format is checked at: `PROBE_ROWS` up to `largest`, and `also`."""
    return sorted({r for r in knobs.PROBE_ROWS if r <= largest} | {r for r in also if r >= 2})


def first_difference(layer: quant.Linear, x: torch.Tensor, rows: Sequence[int]) -> int | None:
    """The smallest batch of `x`'s first rows (of each size in `rows`, ascending) that `layer`
    computes otherwise than the batch before it (every row the two share) or whose last row it
    computes otherwise than alone, or None when all agree, bit for bit. Every row is compared,
    not a few: in bf16 a sum taken in another order rounds to other bits in a few outputs only
    (onednn-bf16 at 33 rows changed none of a batch's first and last rows in one draw)."""
    before = layer(x[:1])
    for m in sorted(rows):
        y = layer(x[:m])
        if not torch.equal(y[: len(before)], before) or not torch.equal(
            y[m - 1 :], layer(x[m - 1 : m])
        ):
            return m
        before = y
    return None


def _weight(out: int, inp: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out, inp, generator=gen) * inp**-0.5


def _input(rows: int, inp: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rows * 7919 + inp)
    return torch.randn(rows, inp, generator=gen).to(dtype)


def layers_differ(
    dtype: str,
    quantization: str,
    config: ModelConfig,
    tp: int,
    group_size: int,
    rows: Sequence[int],
) -> str | None:
    """Where `quantization` in `dtype` computes a row of one rank's linear layers otherwise in a
    batch than alone ("down at 33 rows"), or None when nowhere in `rows`."""
    t, cpu = DTYPES[dtype], torch.device("cpu")
    for i, s in enumerate(x for x in linear_shapes(config, tp) if x.name != "lm_head"):
        act_max = torch.ones(s.inp) if s.name in KINDS else None  # smooth-int8's calibration
        w = _weight(s.out, s.inp, i)
        layer = quant.make_linear(w, None, quantization, group_size, t, cpu, act_max)
        m = first_difference(layer, _input(max(rows), s.inp, t), rows)
        if m is not None:
            return f"{s.name} at {m} rows"
    return None


def head_differs(
    dtype: str,
    quantization: str,
    config: ModelConfig,
    group_size: int,
    rows: Sequence[int],
) -> str | None:
    """Where `quantization` in `dtype` computes a row of the LM head otherwise in a batch than
    alone ("lm_head at 2 rows"), or None when nowhere in `rows`."""
    t, cpu = DTYPES[dtype], torch.device("cpu")
    w = _weight(config.vocab_size, config.hidden_size, 99)
    layer = quant.make_linear(w, None, quantization, group_size, t, cpu)
    m = first_difference(layer, _input(max(rows), config.hidden_size, t), rows)
    return None if m is None else f"lm_head at {m} rows"
