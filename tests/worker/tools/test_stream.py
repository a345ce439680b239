"""Tool-call parsing of a model's output, whole and streamed (pure Python, no model): each format,
what is content, what is held back, and argument pieces that concatenate to the final arguments."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pd.worker.tools.calling import ToolCalling, detect_format
from pd.worker.tools.segments import segmenter
from pd.worker.tools.stream import ToolStream


def make(fmt: str, **kw: Any) -> ToolStream:
    return ToolStream(segmenter(fmt), **kw)


def whole(fmt: str, text: str, **kw: Any) -> dict[str, Any]:
    s = make(fmt, **kw)
    s.whole(text)
    return s.message()


def streamed(fmt: str, pieces: list[str], **kw: Any) -> tuple[list[dict[str, Any]], ToolStream]:
    s = make(fmt, **kw)
    deltas = []
    for p in pieces:
        deltas += s.feed(p)
    deltas += s.finish()
    return deltas, s


def assembled(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """What a client builds from the deltas (the openai SDK's way: calls merged by index)."""
    content, calls = "", {}
    for d in deltas:
        content += d.get("content") or ""
        for c in d.get("tool_calls", ()):
            into = calls.setdefault(c["index"], {"function": {"arguments": ""}})
            for key in ("id", "type"):
                if key in c:
                    into[key] = c[key]
            fn = c.get("function", {})
            if "name" in fn:
                into["function"]["name"] = fn["name"]
            into["function"]["arguments"] += fn.get("arguments", "")
    if not calls:
        return {"content": content}
    return {"content": content or None, "tool_calls": [calls[i] for i in sorted(calls)]}


def without_ids(message: dict[str, Any]) -> dict[str, Any]:
    calls = [{k: v for k, v in c.items() if k != "id"} for c in message.get("tool_calls", ())]
    return {**message, **({"tool_calls": calls} if calls else {})}


def check_stream_matches_whole(fmt: str, text: str, **kw: Any) -> dict[str, Any]:
    """Streamed one character at a time and in random pieces, the deltas build the message the
    whole text gives; each call's first delta has its id, type and name (arguments ""), the next
    ones only argument pieces."""
    expect = whole(fmt, text, **kw)
    rng = random.Random(0)
    for pieces in (list(text), _random_pieces(text, rng), [text]):
        deltas, s = streamed(fmt, pieces, **kw)
        assert without_ids(assembled(deltas)) == without_ids(expect), pieces
        assert without_ids(s.message()) == without_ids(expect)
        seen: set[int] = set()
        for d in deltas:
            assert set(d) in ({"content"}, {"tool_calls"}), d
            for c in d.get("tool_calls", ()):
                if c["index"] not in seen:
                    seen.add(c["index"])
                    assert c["id"].startswith("call_") and c["type"] == "function", c
                    assert c["function"]["arguments"] == "" and c["function"]["name"], c
                else:
                    assert set(c) == {"index", "function"} and set(c["function"]) == {"arguments"}
    return expect


def _random_pieces(text: str, rng: random.Random) -> list[str]:
    if len(text) < 2:
        return [text]
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, len(text) // 3)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def call(name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def calls_of(message: dict[str, Any]) -> list[tuple[str, Any]]:
    return [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message["tool_calls"]
    ]


# ----------------------------------------------------------------------------------- formats


def test_hermes_calls_after_content():
    text = (
        "Let me check.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET \\"x\\" \\u00e9"}}\n'
        "</tool_call>"
    )
    message = check_stream_matches_whole("hermes", text)
    assert message["content"] == "Let me check."  # the whitespace before the call is dropped
    assert calls_of(message) == [
        ("get_weather", {"city": "Paris", "days": [1, 2]}),
        ("get_time", {"tz": 'CET "x" é'}),
    ]
    assert message["tool_calls"][0]["function"]["arguments"] == (
        '{"city": "Paris", "days": [1, 2]}'
    )
    assert len({c["id"] for c in message["tool_calls"]}) == 2


def test_hermes_without_a_call_is_the_text_as_it_is():
    for text in ["Plain answer.\n\n", "a <tool_c", "x < y and <tool>", "", "  "]:
        assert check_stream_matches_whole("hermes", text) == {"content": text}


def test_text_that_may_open_a_tag_is_held_back_until_decided():
    s = make("hermes")
    assert s.feed("Sure <tool") == [{"content": "Sure"}]
    assert s.feed("box>") == [{"content": " <toolbox>"}]  # it was no tag
    s = make("hermes")
    assert s.feed("Sure <tool") == [{"content": "Sure"}]
    first = s.feed('_call>{"name": "f"')
    assert first[0]["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}
    assert s.feed("after the call") == []  # nothing: still inside the call
    assert s.message()["content"] == "Sure"


def test_only_whitespace_before_a_call_is_null_content():
    message = check_stream_matches_whole(
        "hermes", '\n\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\n'
    )
    assert message["content"] is None and calls_of(message) == [("f", {})]


def test_llama3_json_calls_bare_or_after_the_python_tag():
    text = '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {"b": "x"}}'
    message = check_stream_matches_whole("llama3_json", text)
    assert message["content"] is None
    assert calls_of(message) == [("f", {"a": 1}), ("g", {"b": "x"})]
    message = check_stream_matches_whole(
        "llama3_json", 'I will call it. <|python_tag|>{"name": "f", "arguments": {"a": 2.5}}'
    )
    assert message["content"] == "I will call it." and calls_of(message) == [("f", {"a": 2.5})]
    assert check_stream_matches_whole("llama3_json", "  Paris <|python") == {
        "content": "  Paris <|python"
    }


def test_mistral_calls_after_the_marker():
    text = (
        'Calling. [TOOL_CALLS] [{"name": "f", "arguments": {"q": [true, null]}}, '
        '{"name": "g", "arguments": {}}]'
    )
    message = check_stream_matches_whole("mistral", text)
    assert message["content"] == "Calling."
    assert calls_of(message) == [("f", {"q": [True, None]}), ("g", {})]
    assert check_stream_matches_whole("mistral", "[no calls]") == {"content": "[no calls]"}


def test_the_required_array_and_a_named_call():
    text = '[{"name":"f","parameters":{"city":"Rome"}},{"name":"g","parameters":{}}]'
    message = check_stream_matches_whole("array", text)
    assert calls_of(message) == [("f", {"city": "Rome"}), ("g", {})]
    message = check_stream_matches_whole("named", '{"city":"Rome"}', named="f")
    assert message["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"city":"Rome"}'}


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = '[{"name":"f","parameters":{}},{"name":"g","parameters":{}}]'
    message = check_stream_matches_whole("array", text, max_calls=1)
    assert calls_of(message) == [("f", {})]


def test_a_call_cut_short_keeps_what_parsed_and_its_finish_reason():
    s = make("hermes")
    s.whole('<tool_call>{"name": "f", "arguments": {"city": "Par')
    message = s.message()
    assert calls_of(message) == [("f", {"city": "Par"})]
    assert s.finish_reason("length") == "length" and s.finish_reason("stop") == "tool_calls"
    s = make("hermes")
    s.whole('<tool_call>{"name": "f", "argu')  # the arguments never began
    assert calls_of(s.message()) == [("f", {})]
    s = make("hermes")
    s.whole('<tool_call>{"nam')  # no name: no call
    assert s.message() == {"content": ""} and s.finish_reason("stop") == "stop"
    s = make("array")
    s.whole('[{"name":"f","parameters":{"a":12')
    assert calls_of(s.message()) == [("f", {})]  # the number may have gone on: left out


def test_detect_format_from_the_chat_template():
    assert detect_format(None) == "hermes"
    assert detect_format("{{ messages }}") == "hermes"  # no tools: pd's default tool prompt
    assert detect_format("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert detect_format("{% if tools %}[TOOL_CALLS]{% endif %}") == "mistral"
    assert detect_format("{% for t in tools %}<|python_tag|>{% endfor %}") == "llama3_json"
    assert ToolCalling("{{ tools }}", "mistral").format == "mistral"
    with pytest.raises(ValueError):
        ToolCalling(None, "pythonic")


# ------------------------------------------------------------------------------ properties

_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**6), 10**6)
    | st.floats(allow_nan=False, allow_infinity=False, width=32)
    | st.text(st.characters(codec="utf-8"), max_size=8)
    | st.sampled_from(['"', "\\", "\n", "é😀", "</tool_call>", "}", "]"]),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(st.characters(codec="utf-8"), max_size=5), inner, max_size=3),
    max_leaves=10,
)
_args = st.dictionaries(st.text(st.characters(codec="utf-8"), max_size=6), _values, max_size=4)


def _text_of(fmt: str, body: str) -> str:
    return {
        "hermes": f"Sure.\n<tool_call>\n{body}\n</tool_call>",
        "llama3_json": f"<|python_tag|>{body}",
        "mistral": f"[TOOL_CALLS] [{body}]",
        "array": f"[{body}]",
    }[fmt]


@settings(max_examples=150, deadline=None)
@given(
    st.sampled_from(["hermes", "llama3_json", "mistral", "array"]),
    _args,
    st.sampled_from([None, 2]),
    st.booleans(),
    st.randoms(use_true_random=False),
)
def test_argument_pieces_concatenate_to_the_final_arguments(fmt, args, indent, ascii_, rng):
    key = "parameters" if fmt in ("llama3_json", "array") else "arguments"
    body = json.dumps({"name": "f", key: args}, indent=indent, ensure_ascii=ascii_)
    deltas, s = streamed(fmt, _random_pieces(_text_of(fmt, body), rng))
    final = s.message()["tool_calls"][0]["function"]["arguments"]
    assert json.loads(final) == args
    assert final == json.dumps(args, ensure_ascii=False)
    pieces = [c["function"]["arguments"] for d in deltas for c in d.get("tool_calls", ())]
    assert "".join(pieces) == final


@pytest.mark.parametrize("fmt", ["hermes", "named"])
def test_a_continuation_primed_with_the_sent_text_loses_no_argument_text(fmt):
    """A call with 12 KB of arguments, streamed token by token, its stream cut at every 10%:
    the second leg is primed with the text the first leg had fed (its deltas went out; the
    continuation's are dropped, as the worker does with `given_text`) and goes on. The client's
    arguments, both legs together, are exactly the whole call's (they lost text past 4 KB)."""
    rng = random.Random(7)
    args = {"notes": [f"line {i}: " + "x" * rng.randint(5, 60) for i in range(300)]}
    body = json.dumps(args)
    assert len(body) > 12_000
    if fmt == "named":
        text, kw = body, {"named": "record"}
    else:
        text, kw = f'<tool_call>\n{{"name": "record", "arguments": {body}}}\n</tool_call>', {}
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]  # ~ one token each
    single, _ = streamed(fmt, pieces, **kw)
    assert assembled(single)["tool_calls"][0]["function"]["arguments"] == body
    for tenth in range(1, 10):
        cut = len(pieces) * tenth // 10
        first = make(fmt, **kw)
        deltas = [d for p in pieces[:cut] for d in first.feed(p)]
        second = make(fmt, **kw)
        second.feed("".join(pieces[:cut]))  # primed: what the client has already
        deltas += [d for p in pieces[cut:] for d in second.feed(p)] + second.finish()
        got = assembled(deltas)["tool_calls"]
        assert len(got) == 1 and got[0]["function"]["arguments"] == body, tenth
