"""The compiled decode step (`--compile`: `compile_decode`): the compiled step gives the eager step's logits (fp32), for one sequence and
for batches, across page boundaries, after the warm-up that compiles every graph it needs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pd.kvcache.paged_metadata import build_paged_metadata
from pd.worker.model.compiled_decode import compile_decode
from pd.worker.model.runner import ModelRunner
from pd.worker.model.runner_config import RunnerConfig
from tests.model_fixtures import default_checkpoint, forward_chunk

PAGE = 16


def decode_step(runner, seqs: list[tuple[list[int], int]], tokens: list[int]) -> torch.Tensor:
    meta = build_paged_metadata([(p, n, 1) for p, n in seqs], PAGE, "cpu")
    ids = torch.tensor(tokens)
    return runner.model.forward(ids, meta, torch.arange(len(tokens)))


def test_compiled_decode_equals_eager():
    ckpt = default_checkpoint()
    config = dataclasses.replace(ckpt.config, num_layers=3)  # compiles in seconds, not minutes
    runner = ModelRunner(
        config, ckpt.weights, RunnerConfig(
            tp=1, dtype=torch.float32, device="cpu", num_pages=32,
            page_size=PAGE, max_model_len=512,
        ),
    )  # fmt: skip
    model = runner.model
    took = compile_decode(model, PAGE, runner.num_pages)  # its warm-up zeroes pages it used
    assert model.compiled_decode is not None and took > 0
    compiled, model.compiled_decode = model.compiled_decode, None
    prompts = [list(range(1, 20)), list(range(40, 70)), [5, 6, 7]]
    pages = [list(range(0, 6)), list(range(6, 12)), list(range(12, 18))]
    for p, ids in zip(pages, prompts):
        forward_chunk(runner, p, ids, 0, all_logits=False)

    def run(steps: int) -> list[torch.Tensor]:
        out = []
        for i in range(steps):  # 1 sequence, then all 3 (contexts cross page boundaries)
            live = [0] if i < 4 else [0, 1, 2]
            seqs = [(pages[s], len(prompts[s]) + i) for s in live]
            out.append(decode_step(runner, seqs, [(7 * i + s) % 500 + 1 for s in live]))
        return out

    eager = run(8)  # writes each step's K/V; the compiled run rewrites the same values
    compiled_calls = 0

    def counting(*args):
        nonlocal compiled_calls
        compiled_calls += 1
        return compiled(*args)

    model.compiled_decode = counting
    again = run(8)
    assert compiled_calls == 8  # every step was a pure decode step, so every one compiled
    for e, c in zip(eager, again):
        torch.testing.assert_close(c, e, atol=2e-3, rtol=1e-4)


def test_compile_refuses_what_it_cannot_compile():
    ckpt = default_checkpoint()
    config = dataclasses.replace(ckpt.config, num_layers=1)
    runner = ModelRunner(
        config, ckpt.weights, RunnerConfig(
            tp=1, dtype=torch.float32, device="cpu", num_pages=4,
            page_size=PAGE, max_model_len=64,
        ),
    )  # fmt: skip
    with pytest.raises(ValueError, match="warms up on 9 KV pages"):
        compile_decode(runner.model, PAGE, runner.num_pages)
    runner.model.ranks[0].attn = object()  # type: ignore[assignment]  # e.g. FlashInfer's
    with pytest.raises(ValueError, match="torch attention backend"):
        compile_decode(runner.model, PAGE, runner.num_pages)
    assert runner.model.compiled_decode is None


def test_two_compiled_models_in_one_process_keep_their_own_graphs():
    """The compiled step's guards say nothing of the model, so each model compiles its own copy
    of the code: two models of other depths and pool sizes in one process each give their
    eager logits (with one shared code object the second ran the first's graph and failed on
    the pool's size)."""
    ckpt = default_checkpoint()
    runners = []
    for layers, pages in ((1, 24), (2, 40)):
        config = dataclasses.replace(ckpt.config, num_layers=layers)
        runner = ModelRunner(
            config, ckpt.weights, RunnerConfig(
                tp=1, dtype=torch.float32, device="cpu", num_pages=pages,
                page_size=PAGE, max_model_len=512,
            ),
        )  # fmt: skip
        compile_decode(runner.model, PAGE, runner.num_pages)
        runners.append(runner)
    for runner in runners:
        forward_chunk(runner, [0, 1], list(range(1, 20)), 0, all_logits=False)
        compiled = decode_step(runner, [([0, 1], 19)], [7])
        graph, runner.model.compiled_decode = runner.model.compiled_decode, None
        eager = decode_step(runner, [([0, 1], 19)], [7])  # rewrites the same K/V slot
        runner.model.compiled_decode = graph
        torch.testing.assert_close(compiled, eager, atol=2e-3, rtol=1e-4)
