"""The prompt's logprobs as the runner computes them: equal to a full forward's log_softmax at
every prompt position (fp32), chunked prefill or not, and no extra logits rows for requests that
do not ask."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from pd.protocol import GenerationOptions
from pd.worker.model.prompt_logprobs import prompt_logprobs
from tests.model_fixtures import forward_chunk, make_runner

PROMPT = [504, 3575, 282, 4649, 314, 7042, 30, 378, 3575, 282, 12050, 314, 253, 1345, 28, 216]


def test_logprob_rank_and_top_k_against_a_plain_computation():
    torch.manual_seed(0)
    logits = torch.randn(300, 97) * 3  # more rows than are log-softmaxed at once
    targets = torch.randint(0, 97, (300,)).tolist()
    got = prompt_logprobs(logits, targets, 3)
    lp = torch.log_softmax(logits, dim=-1)
    for row, (value, rank, top) in enumerate(got):
        order = lp[row].argsort(descending=True).tolist()
        assert value == pytest.approx(lp[row, targets[row]].item(), abs=1e-6)
        assert rank == order.index(targets[row]) + 1
        assert [t for t, _ in top] == order[:3]
    assert all(top == [] for _, _, top in prompt_logprobs(logits[:2], targets[:2], 0))


@dataclass
class Req:
    prompt_ids: list[int]
    params: GenerationOptions
    page_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    rules: None = None

    def token_slice(self, start: int, end: int) -> list[int]:
        return (self.prompt_ids + self.output_ids)[start:end]


@dataclass
class Batch:
    seqs: list[Req]
    num_cached: list[int]
    num_new: list[int]
    sample: list[bool]
    riders: list = field(default_factory=list)  # n > 1: none here


@pytest.mark.slow  # loads the real model
@pytest.mark.parametrize("chunk", [5, 16])
def test_chunked_prefill_gives_a_full_forwards_log_softmax_at_every_position(chunk):
    runner = make_runner()
    k = 4
    asks = Req(PROMPT, GenerationOptions(temperature=0, prompt_logprobs=k), [0, 1])
    plain = Req(PROMPT[:7], GenerationOptions(temperature=0), [2])  # batched beside it
    rows_asked: list[int] = []
    forward = runner.model.forward

    def counting(ids, meta, rows, eager=False):
        rows_asked.append(len(rows))
        return forward(ids, meta, rows, eager)

    runner.model.forward = counting  # type: ignore[method-assign]
    got: list = []
    for start in range(0, len(PROMPT), chunk):
        n = min(chunk, len(PROMPT) - start)
        last = start + n == len(PROMPT)
        seqs, cached, new, sample = [asks], [start], [n], [last]
        if start == 0:
            seqs, cached, new, sample = [asks, plain], [0, 0], [n, 7], [last, True]
        out = runner.execute(Batch(seqs, cached, new, sample))
        for i, first, entries in out.prompt_logprobs:
            assert i == 0 and first == len(got)
            got.extend(entries)
    assert len(got) == len(PROMPT) - 1
    # The rows: the sampled ones, plus one per position of `asks` that predicts a prompt token.
    assert sum(rows_asked) == 2 + len(PROMPT) - 1

    full = torch.log_softmax(forward_chunk(runner, [3, 4], PROMPT, 0), dim=-1)  # [T, V]
    worst = 0.0
    for p, (value, rank, top) in enumerate(got):
        row, target = full[p], PROMPT[p + 1]
        worst = max(worst, abs(value - row[target].item()))
        assert rank == int((row > row[target]).sum()) + 1
        top_vals, top_ids = row.topk(k)
        assert [t for t, _ in top] == top_ids.tolist()
        worst = max(worst, max(abs(v - e) for (_, v), e in zip(top, top_vals.tolist())))
    print(f"max |prompt logprob - full forward| = {worst:.2e}")
    assert worst < 1e-4

    rows_asked.clear()
    runner.execute(Batch([plain], [0], [7], [True]))
    assert rows_asked == [1]  # a request that does not ask costs no row
