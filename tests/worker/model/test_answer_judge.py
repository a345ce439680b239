"""The answer judge (tuning/answer_judge.py): its packing and counting on made-up rows, and on
the real model that reading an answer teacher-forced counts what greedy decoding gives."""

from __future__ import annotations

import pytest
import torch

from pd.worker.model.tuning.answer_judge import (
    Forced,
    _pack,
    forced_hidden,
    greedy_answers,
    leading_agreement,
    prompt_ids,
    shipped_prompts,
)
from tests.model_fixtures import default_checkpoint, make_runner


def test_sequences_pack_whole_into_forwards_of_a_budget():
    assert _pack([5, 5, 5, 12, 1], 10) == [[0, 1], [2], [3], [4]]
    assert _pack([30], 10) == [[0]]  # one at least, however long


def test_the_leading_agreement_stops_at_the_first_other_token():
    reference = [[3, 1, 4], [1, 5, 9]]
    # one forward of both prompts' rows; a head that reads the row's one-hot argmax
    best = [3, 1, 0, 1, 5, 9]
    hidden = torch.nn.functional.one_hot(torch.tensor(best), 10).float()
    forced = Forced([(hidden, [0, 1])])
    assert leading_agreement(forced, lambda h: h, reference) == [2, 3]


def test_the_shipped_prompts_are_64_chat_and_completion_with_readmes_first(monkeypatch):
    prompts = shipped_prompts()
    assert len(prompts) >= 64 and {p["kind"] for p in prompts} == {"chat", "completion"}
    assert prompts[0]["messages"][0]["content"] == "What is the capital of France?"
    monkeypatch.setenv("PD_ANSWER_JUDGE_PROMPTS", "8")
    few = shipped_prompts()
    assert len(few) == 8 and {p["kind"] for p in few} == {"chat", "completion"}


@pytest.mark.slow
def test_teacher_forced_agreement_is_greedy_agreement_where_rows_compute_alike():
    """A configuration read teacher-forced against its own greedy answers agrees on every token
    when a prompt's row is computed as a decode step's (`--deterministic`), alone or packed."""
    runner = make_runner(
        quantization="int4", keep_q4_1=True, num_pages=80, lm_head_quantization="int8",
        deterministic=True,
    )  # fmt: skip
    tok = default_checkpoint(True).tokenizer
    prompts = prompt_ids(tok.encode, tok.apply_chat_template)[:6]
    answers = greedy_answers(runner, prompts, 12, chunk=64)
    for budget in (0, 64):
        forced = forced_hidden(runner, prompts, answers, budget)
        assert leading_agreement(forced, runner.model.logits, answers) == [12] * len(prompts)
