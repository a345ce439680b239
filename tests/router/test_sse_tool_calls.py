"""The worker's tool-call output through the router's SSE code: D's stream collected into one
answer (`SSECollector`) equals the worker's own non-streamed answer, and P's final answer sent as
a stream (`answer_to_sse`) collects back to itself."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from pd.router.sse import SSECollector, answer_to_sse
from pd.worker.api.openai_format import ResponseBuilder
from pd.worker.engine import Delta
from pd.worker.tools.segments import segmenter
from pd.worker.tools.stream import ToolStream

OUTPUTS = {
    "hermes": (
        "I'll look.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    ),
    "array": '[{"name":"get_weather","parameters":{"city":"Rome"}}]',
    "plain": "No call here <tool",
}


def builder(fmt: str) -> ResponseBuilder:
    tools = ToolStream(segmenter("hermes" if fmt == "plain" else fmt))
    return ResponseBuilder(
        chat=True, model="m", prompt_tokens=3, token_text=str, tools=tools, id="x", created=1
    )


def pieces(text: str, size: int) -> list[Delta]:
    parts = [text[i : i + size] for i in range(0, len(text), size)]
    return [
        Delta(p, [i], [], "stop" if i == len(parts) - 1 else None) for i, p in enumerate(parts)
    ]


def strip_ids(answer: dict[str, Any]) -> dict[str, Any]:
    for choice in answer["choices"]:
        for call in choice["message"].get("tool_calls") or ():
            assert call.pop("id").startswith("call_")
    return answer


@pytest.mark.parametrize("fmt", sorted(OUTPUTS))
@pytest.mark.parametrize("size", [1, 7, 1000])
def test_a_collected_stream_is_the_workers_own_answer(fmt, size):
    text = OUTPUTS[fmt]
    stream = builder(fmt)
    data = stream.chunk(None, role=True)
    for d in pieces(text, size):
        stream.add(d)
        data += stream.chunk(d)
    data += b"data: [DONE]\n\n"
    collector = SSECollector(chat=True)
    collector.feed(data)
    assert collector.done
    collected = collector.result()

    whole = builder(fmt)
    for d in pieces(text, size):
        whole.add(d)
    expect = whole.final()
    assert strip_ids(collected)["choices"] == strip_ids(expect)["choices"]
    message = expect["choices"][0]["message"]
    if fmt == "plain":
        assert message == {"role": "assistant", "content": text}
        assert expect["choices"][0]["finish_reason"] == "stop"
    else:
        assert message["tool_calls"] and expect["choices"][0]["finish_reason"] == "tool_calls"
        assert message["content"] == ("I'll look." if fmt == "hermes" else None)
    # Every event is a chat chunk whose delta is content or one call's entry.
    for event in data.split(b"\n\n")[1:-2]:
        delta = orjson.loads(event.removeprefix(b"data: "))["choices"][0]["delta"]
        assert set(delta) <= {"content", "tool_calls"}
        assert len(delta.get("tool_calls", [None])) == 1


def test_a_final_answer_with_calls_as_a_stream_collects_back_to_itself():
    whole = builder("hermes")
    for d in pieces(OUTPUTS["hermes"], 5):
        whole.add(d)
    answer = whole.final()
    collector = SSECollector(chat=True)
    collector.feed(answer_to_sse(answer, chat=True, include_usage=True))
    got = collector.result()
    assert got["choices"] == answer["choices"] and got["usage"] == answer["usage"]


def test_logprobs_ride_on_the_events_of_their_delta_once_each():
    stream = builder("hermes")
    stream.wants_logprobs = True
    text = OUTPUTS["hermes"]
    data = stream.chunk(None, role=True)
    deltas = pieces(text, 3)
    for d in deltas:
        d.logprobs.append((d.token_ids[0], -0.5, None))
        stream.add(d)
        data += stream.chunk(d)
    events = [orjson.loads(e.removeprefix(b"data: ")) for e in data.split(b"\n\n")[1:-1]]
    tokens = [e["choices"][0]["logprobs"] for e in events if e["choices"][0]["logprobs"]]
    assert sum(len(lp["content"]) for lp in tokens) == len(deltas)  # held-back text's too
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
