"""`--deterministic`'s check on the weight formats: a worker that promises batch-invariant answers
starts only on linear layers and an LM head that compute a row the same bits in a batch of any
size it can run (row_invariance.py), measured here whatever chose them (the search, a pinned
flag, the fixed rule). The attention half of the promise is the torch backend's `uniform` mode
(attention/torch_backend.py); the rest of a step (norms, rotary, activations, logprobs) works
row by row (tests/worker/model/test_deterministic.py)."""

from __future__ import annotations

import time

from pd.worker.model.config import ModelConfig
from pd.worker.model.device import DTYPES
from pd.worker.model.quant import head_quantization
from pd.worker.model.tuning.row_invariance import batch_rows, head_differs, layers_differ

# What to suggest when the chosen formats fail: the GGUF's own Q4_1 blocks as written, whose
# rows came out the same at every batch on both machine kinds measured (EXPERIMENTS.md
# section 15), with the int8 head of its rule.
SUGGESTION = "--quantization int4 (the GGUF's own blocks)"


def check_row_invariant(
    *,
    dtype: str,
    quantization: str,
    lm_head_quantization: str,
    config: ModelConfig,
    tp: int,
    group_size: int,
    chunk_size: int,
    max_running: int,
) -> float:
    """Raise ValueError naming where the layers' or the LM head's format computes a row
    otherwise in a batch than alone, at the batch sizes this worker can run (up to a prefill
    chunk or `max_running` rows); else the seconds the check took. Runs torch ops: call it on
    the worker's torch thread."""
    start = time.perf_counter()
    largest = max(chunk_size, max_running)
    rows = batch_rows(largest, (chunk_size, max_running))
    head = lm_head_quantization
    if head == "auto":
        head = head_quantization(quantization, DTYPES[dtype])
    where = layers_differ(dtype, quantization, config, tp, group_size, rows) or head_differs(
        dtype, head, config, group_size, rows
    )
    if where is not None:
        raise ValueError(
            f"--deterministic: {dtype} linear layers {quantization}, LM head {head} compute a "
            f"row otherwise in a batch than alone on this machine ({where}); try {SUGGESTION}"
        )
    return time.perf_counter() - start
