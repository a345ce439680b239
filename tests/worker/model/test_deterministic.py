"""`--deterministic` on the real model: a sequence's logits come out the same bits whatever the
step computes them in (one chunk, chunks of any size, decode steps, beside other sequences
decoding), and the worker refuses formats whose rows differ in a batch."""

from __future__ import annotations

import pytest
import torch

from pd.config import WorkerConfig
from pd.kvcache.paged_metadata import build_paged_metadata
from pd.worker.model.runner import ModelRunner
from pd.worker.model.tuning.deterministic import check_row_invariant
from pd.worker.model.tuning.row_invariance import batch_rows, layers_differ
from tests.model_fixtures import default_checkpoint, make_runner

N = 24  # tokens of the sequence under test
PAGES = list(range(2))  # its pages (16 tokens each)
OTHER_PAGES = 8  # pages of each other sequence


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    # The GGUF's own blocks and their rule's int8 head: rows the same in any batch (checked).
    return make_runner(
        quantization="int4", keep_q4_1=True, num_pages=300, lm_head_quantization="int8",
        deterministic=True,
    )  # fmt: skip


def _logits(runner: ModelRunner, chunk: int, others: int, n: int = N) -> torch.Tensor:
    """[n, V]: the sequence's logits, prefilled `chunk` tokens a step, with `others` sequences
    decoding a token each step (their rows before its own)."""
    seq = torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    cached = [20 + i for i in range(others)]  # at most 74 tokens: 5 pages
    rows = []
    pages = list(range(-(-n // 16))) if n > N else PAGES
    base = len(pages)  # the others' pages follow its own
    for start in range(0, n, chunk):
        tokens = seq[start : start + chunk]
        batch = [
            (
                list(range(base + OTHER_PAGES * i, base + OTHER_PAGES * (i + 1))),
                cached[i],
                [seq[i % n]],
            )
            for i in range(others)
        ] + [(pages, start, tokens)]
        meta = build_paged_metadata([(p, c, len(t)) for p, c, t in batch], runner.page_size, "cpu")
        ids = torch.tensor([x for *_, t in batch for x in t])
        rows.append(runner.model.forward(ids, meta, torch.arange(len(ids)))[-len(tokens) :])
        cached = [c + 1 for c in cached]
    return torch.cat(rows)


@pytest.mark.slow
def test_a_sequences_logits_are_the_same_bits_in_any_step(runner):
    reference = _logits(runner, N, 0)  # the whole sequence in one chunk, alone
    for chunk, others in ((7, 0), (1, 0), (13, 5), (1, 31)):
        got = _logits(runner, chunk, others)
        same = int((got == reference).all(dim=1).sum())
        assert same == N, f"chunks of {chunk} beside {others}: {same} of {N} rows the same"
    # longer than a block of rows (UNIFORM_ROWS: each block reads the keys up to its last row)
    reference = _logits(runner, 150, 0, n=150)
    for chunk in (70, 33):
        same = int((_logits(runner, chunk, 3, n=150) == reference).all(dim=1).sum())
        assert same == 150, f"150 tokens in chunks of {chunk}: {same} rows the same"


@pytest.mark.slow
def test_a_format_whose_rows_differ_is_refused():
    """A split computes one row in int4 and two in int8: never the same in a batch."""
    cfg = default_checkpoint(True).config
    with pytest.raises(ValueError, match=r"--deterministic: float32 .*int4@1\+int8.* at 2 rows"):
        check_row_invariant(
            dtype="float32", quantization="int4@1+int8", lm_head_quantization="int8",
            config=cfg, tp=1, group_size=32, chunk_size=64, max_running=8,
        )  # fmt: skip
    # the formats the runner above uses pass the same check
    assert layers_differ("float32", "int4", cfg, 1, 32, batch_rows(64, (64, 8))) is None


def test_deterministic_refuses_what_computes_rows_otherwise():
    for flags in ({"compile": True}, {"background_compile": "on"}, {"cuda_graph_max_batch": 8}):
        with pytest.raises(ValueError, match="--deterministic runs the eager steps"):
            WorkerConfig(deterministic=True, **flags)  # type: ignore[arg-type]
    WorkerConfig(deterministic=True)
