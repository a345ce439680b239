"""Every list a client sends is bounded (docs/security.md): at its bound a request parses, past it
it is a 400 naming the field and the bound; 100,000 stop strings among them. Router and workers
parse with these same functions."""

from __future__ import annotations

import pytest

from pd.protocol import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORDS,
    MAX_MESSAGES,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
)

BASE = {"prompt": "hi", "max_tokens": 4}


@pytest.mark.parametrize(
    "field, at, past, needle",
    [
        ("stop", ["x"] * MAX_STOP, [f"s{i}" for i in range(100_000)], f"at most {MAX_STOP} strings"),
        ("stop", ["y" * MAX_STOP_CHARS], ["y" * (MAX_STOP_CHARS + 1)], f"at most {MAX_STOP_CHARS} characters"),
        ("bad_words", ["w"] * MAX_BAD_WORDS, ["w"] * (MAX_BAD_WORDS + 1), f"at most {MAX_BAD_WORDS} words"),
        ("bad_words", ["w" * MAX_BAD_WORD_CHARS], ["w" * (MAX_BAD_WORD_CHARS + 1)], "characters long"),
        ("stop_token_ids", [1] * MAX_STOP_TOKEN_IDS, [1] * (MAX_STOP_TOKEN_IDS + 1), "token ids"),
        ("allowed_token_ids", [1] * MAX_ALLOWED_TOKEN_IDS, [1] * (MAX_ALLOWED_TOKEN_IDS + 1), "token ids"),
    ],
)  # fmt: skip
def test_request_lists_are_bounded(field, at, past, needle):
    CompletionRequest.parse({**BASE, field: at})
    with pytest.raises(APIError) as e:
        CompletionRequest.parse({**BASE, field: past})
    assert e.value.status == 400 and e.value.param == field and needle in str(e.value)


def test_messages_are_bounded():
    messages = [{"role": "user", "content": "hi"}] * MAX_MESSAGES
    ChatCompletionRequest.parse({"messages": messages})
    with pytest.raises(APIError, match=f"at most {MAX_MESSAGES} messages") as e:
        ChatCompletionRequest.parse({"messages": [*messages, messages[0]]})
    assert e.value.status == 400


def test_the_bounds_are_above_what_clients_send():
    """OpenAI's documented limits (4 stop strings, 300 logit_bias entries, 128 tools) and
    lm-eval's requests (a few `until` strings) parse."""
    CompletionRequest.parse({**BASE, "stop": ["\n\n", "Question:", "</s>", "<|im_end|>"]})
    CompletionRequest.parse({**BASE, "logit_bias": {str(t): 1 for t in range(300)}})


def test_a_seed_that_would_overflow_for_some_choice_is_a_400():
    top = (1 << 63) - 1
    CompletionRequest.parse({**BASE, "seed": top})
    CompletionRequest.parse({**BASE, "seed": top - 3, "n": 4})
    CompletionRequest.parse({**BASE, "seed": -(1 << 63)})
    for body in ({"seed": top - 2, "n": 4}, {"seed": top + 1}, {"seed": -(1 << 63) - 1}):
        with pytest.raises(APIError, match="seed") as e:
            CompletionRequest.parse({**BASE, **body})
        assert e.value.status == 400 and e.value.param == "seed"
