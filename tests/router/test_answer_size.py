"""The byte bound of a non-streamed answer (pd/router/answer_size.py, --max-answer-bytes): a
request expected to exceed it is a 400 before any worker hears of it; an answer that grows past
it is a 400 and its worker's stream is closed; a stream is relayed whatever its size."""

from __future__ import annotations

import pytest

from pd.protocol import parse_request
from pd.router.answer_size import check_expected, expected_bytes
from pd.router.sse import SSECollector
from tests.router.conftest import CHAT, COMPLETION, wait_for

CHAT_PATH, COMPLETION_PATH = "/v1/chat/completions", "/v1/completions"


UNBOUNDED_CHAT = {k: v for k, v in CHAT.items() if k != "max_tokens"}


def chat(**fields):
    return parse_request(CHAT_PATH, {**UNBOUNDED_CHAT, **fields})


def test_the_expected_size_grows_with_choices_tokens_and_alternatives():
    assert expected_bytes(chat(), 1, 10) is None  # no max_tokens: unknown in advance
    one = expected_bytes(chat(max_tokens=100), 1, 10)
    assert one is not None
    assert expected_bytes(chat(max_tokens=100, n=4), 1, 10) == 4 * one
    assert expected_bytes(chat(max_tokens=100), 3, 10) == 3 * one  # prompts
    plain = expected_bytes(chat(max_tokens=100, logprobs=True), 1, 10)
    top = expected_bytes(chat(max_tokens=100, logprobs=True, top_logprobs=20), 1, 10)
    assert one < plain < top  # type: ignore[operator]
    echo = parse_request(COMPLETION_PATH, {"prompt": "x", "max_tokens": 1, "echo": True})
    no_echo = parse_request(COMPLETION_PATH, {"prompt": "x", "max_tokens": 1})
    assert expected_bytes(echo, 1, 1000) > expected_bytes(no_echo, 1, 1000)  # type: ignore[operator]


def test_the_issues_case_is_refused_and_everyday_requests_are_not():
    """n=16 choices of 8k tokens with 20 alternatives each (~1 GiB in the router before):
    refused; what lm-eval and chat clients send: served."""
    limit = 32 << 20
    with pytest.raises(Exception) as e:
        check_expected(chat(max_tokens=8192, n=16, logprobs=True, top_logprobs=20), 1, 50, limit)
    assert e.value.status == 400 and e.value.code == "answer_too_large"  # type: ignore[attr-defined]
    assert "stream=true" in str(e.value)
    for req in (
        chat(max_tokens=4096),
        chat(max_tokens=1024, n=16),
        chat(max_tokens=1024, logprobs=True, top_logprobs=20),
        parse_request(
            COMPLETION_PATH,
            {"prompt": "x", "max_tokens": 0, "echo": True, "logprobs": 5},
        ),
        chat(max_tokens=8192, n=16, logprobs=True, top_logprobs=20, stream=True),
    ):
        check_expected(req, 1, 4096, limit)


def test_the_collector_drops_everything_past_its_limit():
    c = SSECollector(False, limit=100)
    c.feed(b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n')
    assert not c.overflow
    c.feed(b'data: {"choices": [{"index": 0, "text": "' + b"b" * 100 + b'"}]}\n\n')
    assert c.overflow and c.size > 100
    c.feed(b"data: [DONE]\n\n")  # taken no more
    assert not c.done and c.result()["choices"] == [{"index": 0, "text": "", "logprobs": None,
                                                   "finish_reason": None}]  # fmt: skip


async def test_a_request_expected_too_large_never_reaches_a_worker(stub, router):
    w = await stub("both")
    client = await router(worker=[w], max_answer_bytes=4096)
    body = {**COMPLETION, "max_tokens": 500, "n": 4, "logprobs": 5}
    resp = await client.post(COMPLETION_PATH, json=body)
    error = (await resp.json())["error"]
    assert resp.status == 400 and error["code"] == "answer_too_large", error
    assert "--max-answer-bytes" in error["message"]
    assert not w.requests
    # The same as a stream is relayed, never held.
    resp = await client.post(COMPLETION_PATH, json={**body, "stream": True})
    assert resp.status == 200 and (await resp.read()).endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("mode", ["pd", "both"])
async def test_an_answer_that_grows_past_the_limit_is_a_400_and_its_stream_closed(
    stub, router, mode
):
    kw = dict(chunks=400, chunk_delay=0.001)
    if mode == "pd":
        p, w = await stub("prefill"), await stub("decode", **kw)
        client = await router(prefill=[p], decode=[w], max_answer_bytes=8192)
    else:
        w = await stub("both", **kw)
        client = await router(worker=[w], max_answer_bytes=8192)
    body = UNBOUNDED_CHAT  # no max_tokens: not known in advance
    resp = await client.post(CHAT_PATH, json=body)
    error = (await resp.json())["error"]
    assert resp.status == 400 and error["code"] == "answer_too_large", error
    await wait_for(lambda: w.cancelled == 1, 5)  # the worker's request was let go
    assert w.completed == 0
    resp = await client.post(CHAT_PATH, json={**body, "stream": True})
    assert resp.status == 200 and len(await resp.read()) > 8192
