"""Reading a relayed chat stream back: its text and usage, or nothing when it is not whole."""

from __future__ import annotations

import orjson

from pd.router.sse import stream_text


def event(obj: dict) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def chunk(content: str, role: bool = False, **extra) -> bytes:
    delta = {"role": "assistant", "content": content} if role else {"content": content}
    return event({"id": "c", "choices": [{"index": 0, "delta": delta, **extra}]})


DONE = b"data: [DONE]\n\n"


def test_text_and_usage_of_a_whole_stream():
    usage = {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 4}}
    data = (
        chunk("", role=True)
        + chunk('He said "hi\\" \u00e9\n')  # quotes, a backslash, unicode, a newline
        + chunk(" ok", logprobs={"content": [{"token": "ok", "logprob": -0.1}]})
        + chunk('"content":"fake"')  # text that looks like the pattern
        + event({"id": "c", "choices": [], "usage": usage})
        + DONE
    )
    assert stream_text(data) == ('He said "hi\\" \u00e9\n ok"content":"fake"', usage)
    assert stream_text(chunk("x") + DONE) == ("x", None)


def test_a_stream_cut_short_or_ending_in_an_error_is_not_read():
    assert stream_text(chunk("x")) is None  # no [DONE]
    err = event({"error": {"message": "boom", "code": "stream_broken"}})
    assert stream_text(chunk("x") + err + DONE) is None
    assert stream_text(b"") is None
