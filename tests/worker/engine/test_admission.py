"""Capacity: the one check that a request fits the context and the KV cache."""

import pytest

from pd.protocol import APIError
from pd.worker.engine import Capacity

CAP = Capacity(max_model_len=100, page_size=4, num_pages=20)  # KV holds 80 tokens


def test_budget_is_what_was_asked_or_up_to_the_context():
    assert CAP.max_tokens_for(10, 5) == 5
    assert Capacity(100, 4, 1000).max_tokens_for(10, None) == 90


@pytest.mark.parametrize(
    "prompt_len, asked, param, needle",
    [
        (100, 1, "messages", "context length is 100"),  # the prompt alone fills the context
        (150, None, "messages", "the prompt has 150 tokens"),
        (60, 41, "max_tokens", "101 were asked for"),  # over the context by one
        (60, 30, None, "exceed this worker's KV cache (80 tokens)"),  # fits the context, not the KV
        (10, None, None, "KV cache"),  # None resolves to the context, which the KV cannot hold
    ],
)
def test_what_does_not_fit_is_a_400(prompt_len, asked, param, needle):
    with pytest.raises(APIError) as e:
        CAP.max_tokens_for(prompt_len, asked)
    assert e.value.status == 400 and e.value.code == "context_length_exceeded"
    assert e.value.param == param and needle in e.value.message


def test_the_last_token_that_fits():
    assert CAP.max_tokens_for(60, 20) == 20  # 80 tokens = 20 pages exactly


def test_n_choices_must_fit_the_kv_cache_together():
    """The prompt's full pages once, then each choice's partial page and max_tokens."""
    assert CAP.max_tokens_for(8, 16, n=4) == 16  # 2 shared pages + 4 x 4 = 18 of 20
    assert CAP.max_tokens_for(10, 14, n=4) == 14  # 2 shared + 4 x ceil((2 + 14) / 4) = 18
    with pytest.raises(APIError) as e:
        CAP.max_tokens_for(10, 16, n=4)  # 2 + 4 x 5 = 22 pages
    assert e.value.status == 400 and e.value.param == "n" and "4 choices" in e.value.message
