"""SSE <-> JSON in the router: a relayed chat stream read back (its text and usage, or nothing
when it is not whole); a stream collected into one answer and an answer sent as a stream, every
field the worker sent kept (OpenAI's streaming semantics: choices and tool calls by index)."""

from __future__ import annotations

import orjson
import pytest

from pd.router.sse import SSECollector, StreamError, answer_to_sse, stream_text


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


# ------------------------------------------------------------------ one answer from a stream


def collect(data: bytes, chat: bool = True) -> dict:
    c = SSECollector(chat)
    for i in range(0, len(data), 7):  # events split across reads
        c.feed(data[i : i + 7])
    assert c.done
    return c.result()


def delta(d: dict, **choice) -> bytes:
    head = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    return event({**head, "choices": [{"index": 0, "delta": d, "logprobs": None, **choice}]})


def test_a_collected_stream_keeps_every_field_the_worker_sent():
    top = {"system_fingerprint": "fp_1", "service_tier": "default", "pd_new": {"a": [1]}}
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    data = (
        event(
            {
                "id": "c",
                "object": "chat.completion.chunk",
                "created": 1,
                "model": "m",
                **top,
                "choices": [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            }
        )
        + delta({"reasoning_content": "let me "}, finish_reason=None, stop_reason=None)
        + delta({"reasoning_content": "think"})
        # Some servers repeat the role in every chunk: it is a name, never concatenated.
        + delta(
            {"role": "assistant", "content": "Hi"},
            logprobs={"content": [{"token": "Hi", "logprob": -0.1, "top_logprobs": []}]},
        )
        + delta(
            {"content": " there"},
            finish_reason="stop",
            stop_reason="\n",
            matched_stop=2,
            logprobs={"content": [{"token": " there", "logprob": -0.2, "top_logprobs": []}]},
        )
        + event(
            {
                "id": "c",
                "object": "chat.completion.chunk",
                "created": 1,
                "model": "m",
                "choices": [],
                "usage": usage,
            }
        )
        + DONE
    )
    assert collect(data) == {
        "id": "c",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        **top,
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "Hi there",
                    "reasoning_content": "let me think",
                },
                "logprobs": {
                    "content": [
                        {"token": "Hi", "logprob": -0.1, "top_logprobs": []},
                        {"token": " there", "logprob": -0.2, "top_logprobs": []},
                    ]
                },
                "finish_reason": "stop",
                "stop_reason": "\n",
                "matched_stop": 2,
            }
        ],
        "usage": usage,
    }


def test_tool_call_deltas_merge_by_their_index():
    def call(**c) -> dict:
        return {"tool_calls": [c]}

    fn = {"name": "get", "arguments": ""}
    data = (
        delta({"role": "assistant", "content": None})
        + delta(call(index=0, id="call_0", type="function", function=fn))
        + delta(call(index=0, function={"arguments": '{"q": '}))
        # The second call starts while the first is unfinished; this server repeats id and type.
        + delta(call(index=1, id="call_1", type="function", function={"name": "put"}))
        + delta(call(index=1, id="call_1", type="function", function={"arguments": "{}"}))
        + delta(call(index=0, function={"arguments": "1}"}), finish_reason="tool_calls")
        + DONE
    )
    (choice,) = collect(data)["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {
        "role": "assistant",
        "content": None,  # as the stream said (OpenAI's own answer with tool calls)
        "tool_calls": [  # in their index order, as a non-streamed message has them
            {
                "id": "call_0",
                "type": "function",
                "function": {"name": "get", "arguments": '{"q": 1}'},
            },
            {"id": "call_1", "type": "function", "function": {"name": "put", "arguments": "{}"}},
        ],
    }


def test_completion_choices_merge_by_index_and_their_logprobs_lists_concatenate():
    def piece(i: int, text: str, n: int, **extra) -> bytes:
        lp = {
            "tokens": [text],
            "token_logprobs": [-n],
            "top_logprobs": [{text: -n}],
            "text_offset": [n],
        }
        choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": None, **extra}
        return event(
            {
                "id": "c",
                "object": "text_completion",
                "created": 1,
                "model": "m",
                "choices": [choice],
            }
        )

    data = (
        piece(1, "b", 0)
        + piece(0, "a", 0)
        + piece(0, "A", 1, finish_reason="length")
        + piece(1, "B", 1, finish_reason="stop", stop_reason=50256)
        + DONE
    )
    answer = collect(data, chat=False)
    assert answer["object"] == "text_completion" and answer["usage"] is None
    a, b = answer["choices"]
    assert (a["index"], a["text"], a["finish_reason"]) == (0, "aA", "length")
    assert (b["index"], b["text"], b["finish_reason"], b["stop_reason"]) == (1, "bB", "stop", 50256)
    assert a["logprobs"] == {
        "tokens": ["a", "A"],
        "token_logprobs": [0, -1],
        "top_logprobs": [{"a": 0}, {"A": -1}],
        "text_offset": [0, 1],
    }


def test_a_stream_with_an_error_event_or_no_done_is_no_answer():
    c = SSECollector(True)
    c.feed(delta({"content": "x"}))
    assert not c.done
    with pytest.raises(StreamError):
        c.feed(event({"error": {"message": "boom", "code": "engine_error"}}))


# ------------------------------------------------------------------ an answer as a stream


ANSWER = {
    "id": "a",
    "object": "chat.completion",
    "created": 1,
    "model": "m",
    "system_fingerprint": "fp_1",
    "pd_new": [1, 2],
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": None,
                "reasoning_content": "hmm",
                "tool_calls": [
                    {
                        "id": "call_0",
                        "type": "function",
                        "function": {"name": "f", "arguments": "{}"},
                    },
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "g", "arguments": "[]"},
                    },
                ],
            },
            "logprobs": {"content": [{"token": "x", "logprob": -0.5, "top_logprobs": []}]},
            "finish_reason": "tool_calls",
            "stop_reason": None,
            "matched_stop": 7,
        }
    ],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
}


def test_an_answer_as_sse_carries_every_field_in_its_delta():
    events = [orjson.loads(e[6:]) for e in answer_to_sse(ANSWER, True, True).split(b"\n\n")[:-2]]
    first, last = events
    top = {
        "id": "a",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "system_fingerprint": "fp_1",
        "pd_new": [1, 2],
    }
    assert {k: first[k] for k in top} == top and {k: last[k] for k in top} == top
    (choice,) = first["choices"]
    message = ANSWER["choices"][0]["message"]
    assert choice["delta"] == {
        **message,
        "tool_calls": [{"index": i, **c} for i, c in enumerate(message["tool_calls"])],
    }
    assert {k: v for k, v in choice.items() if k != "delta"} == {
        k: v for k, v in ANSWER["choices"][0].items() if k != "message"
    }
    assert first["usage"] is None and last["choices"] == [] and last["usage"] == ANSWER["usage"]
    assert "usage" not in orjson.loads(answer_to_sse(ANSWER, True, False).split(b"\n\n")[0][6:])


def test_an_answer_survives_the_way_to_sse_and_back():
    assert collect(answer_to_sse(ANSWER, True, True)) == ANSWER
    completion = {
        "id": "a",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "pd_new": True,
        "choices": [
            {
                "index": 0,
                "text": "hi",
                "logprobs": None,
                "finish_reason": "stop",
                "stop_reason": "\n",
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }
    assert collect(answer_to_sse(completion, False, True), chat=False) == completion
