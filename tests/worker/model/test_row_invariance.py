"""The judge that keeps a format out of `auto` when it computes a row otherwise in a batch than
alone (tuning/row_invariance.py), on torch's real kernels and on made-up ones."""

from __future__ import annotations

import torch

from pd.worker.model.config import ModelConfig
from pd.worker.model.tuning.row_invariance import (
    batch_rows,
    first_difference,
    head_differs,
    layers_differ,
)

CFG = ModelConfig("t", "llama", 256, 64, 128, 2, 4, 2, 16, 1e4, 1e-5, 128, True)
ROWS = batch_rows(64, (40,))


def test_the_batches_straddle_the_kernels_blocks_up_to_the_largest():
    assert batch_rows(64, (40,)) == [2, 3, 5, 8, 16, 17, 32, 33, 40, 64]
    assert batch_rows(8, (1, 8)) == [2, 3, 5, 8]


class _Gemv:
    """A layer that sums one row alone in another order than a batch's rows (as a matrix-vector
    kernel does): the same values, other bits."""

    def __init__(self, w: torch.Tensor, from_rows: int = 2) -> None:
        self.w, self.from_rows = w, from_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < self.from_rows:
            return (x[:, None, :] * self.w[None]).flip(-1).sum(-1)
        return x @ self.w.t()


def test_a_kernel_with_a_path_of_its_own_for_one_row_is_caught_at_its_first_batch():
    torch.manual_seed(0)
    w, x = torch.randn(48, 256), torch.randn(64, 256)
    assert first_difference(_Gemv(w), x, ROWS) == 2
    assert first_difference(_Gemv(w, from_rows=17), x, ROWS) == 17  # blocks past 16 rows
    exact = lambda x: torch.stack([(r * w).sum(-1) for r in x])  # noqa: E731  a row at a time
    assert first_difference(exact, x, ROWS) is None


def test_a_difference_in_one_middle_row_only_is_caught():
    """As bf16 rounding shows a sum taken in another order: a few outputs of a few rows."""
    torch.manual_seed(0)
    w, x = torch.randn(48, 256), torch.randn(64, 256)

    def blocked(x: torch.Tensor) -> torch.Tensor:
        y = torch.stack([(r * w).sum(-1) for r in x])  # each row on its own
        if x.shape[0] > 32:  # another block size: one output of row 7 rounds otherwise
            y[7, 3] = torch.nextafter(y[7, 3], torch.tensor(float("inf")))
        return y

    assert first_difference(blocked, x, ROWS) == 33


def test_the_models_own_int4_blocks_compute_every_row_alone_and_dynamic_int8_does_not():
    # int4 (the GGUF's Q4_1 as written) and int8: weight-only, each row on its own
    for dtype in ("float32", "bfloat16"):
        assert layers_differ(dtype, "int4", CFG, 1, 32, ROWS) is None
        assert head_differs(dtype, "int8", CFG, 32, ROWS) is None
    if "fbgemm" in torch.backends.quantized.supported_engines:
        # one activation scale per call: a row's neighbours change it
        assert layers_differ("float32", "fbgemm-int8", CFG, 1, 32, ROWS) == "qkv at 2 rows"
        assert head_differs("float32", "fbgemm-int8", CFG, 32, ROWS) == "lm_head at 2 rows"
