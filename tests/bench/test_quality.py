"""`pd-bench quality` (issue 40, item 5): its measures on hand-made inputs and its shipped sets
(a run against a real worker: tests/e2e/test_quality.py)."""

from __future__ import annotations

import math

from pd.bench.quality import (
    AGREEMENT_TOKENS,
    continuation_logprob,
    leading_equal,
    perplexity,
    prompt_part,
    shipped,
)


def test_leading_equal_counts_the_shared_start_of_the_first_32():
    a = [f"t{i}" for i in range(40)]
    assert leading_equal(a, a) == AGREEMENT_TOKENS
    assert leading_equal(a, a[:5] + ["x"] + a[6:]) == 5
    assert leading_equal(a[:10], a[:10]) == AGREEMENT_TOKENS  # both ended at the same token
    assert leading_equal(a[:10], a[:12]) == 10  # one went on
    assert leading_equal([], ["x"]) == 0


def test_a_choice_is_scored_by_the_tokens_after_the_context():
    offsets, logprobs = [0, 9, 18, 19, 24], [None, -1.0, -0.5, -2.0, -0.25]
    assert continuation_logprob(offsets, logprobs, 18) == -2.75
    assert math.isclose(perplexity(logprobs), math.exp((1.0 + 0.5 + 2.0 + 0.25) / 4))


def test_the_echoed_prompt_is_kept_and_the_generated_token_dropped():
    # "Hello world" echoed, then " again" generated (max_tokens 1): its offset is the prompt's end.
    lp = {
        "tokens": ["Hello", " world", " again"],
        "token_logprobs": [None, -1.5, -0.5],
        "text_offset": [0, 5, 11],
        "top_logprobs": [None, {}, {}],
    }
    assert prompt_part(lp, len("Hello world")) == {
        "tokens": ["Hello", " world"],
        "token_logprobs": [None, -1.5],
        "text_offset": [0, 5],
    }


def test_the_shipped_sets_are_as_the_issue_asks():
    prompts = shipped("quality_prompts.json")
    kinds = {p["kind"] for p in prompts["prompts"]}
    assert len(prompts["prompts"]) >= 64 and kinds == {"chat", "completion"}
    readme = {
        "kind": "chat",
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
    }
    assert readme in prompts["prompts"]
    mc = shipped("quality_mc.json")
    assert "CC0" in mc["licence"] and len(mc["items"]) >= 200
    for item in mc["items"]:
        assert len(item["choices"]) == 4 == len(set(item["choices"])), item
        assert 0 <= item["answer"] < 4
    # The right answer is not always in one place (a model that prefers a position gains nothing).
    assert {i["answer"] for i in mc["items"]} == {0, 1, 2, 3}
