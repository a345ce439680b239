"""Hypothesis strategies for OpenAI request bodies, valid and not, and the checks every answer
must pass: what the property-based tests of the router and the worker send.

Bodies mix the fields clients send (right and wrong types, out-of-range numbers, unicode, nesting,
long strings, token-id lists with negative and 64-bit ids, unknown fields) so that most are 4xx
and a good share are served. Raw bodies that are not JSON objects come too.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp.test_utils import TestClient
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

PATHS = ("/v1/completions", "/v1/chat/completions")

# Bodies that once got a 5xx from the router or a worker (issue 19): tried in every run.
KNOWN_CASES = [
    ("/v1/completions", b'{"prompt": [123], "max_tokens": 2}'),
    ("/v1/completions", b'{"prompt": [4294967296], "max_tokens": 2}'),
    ("/v1/completions", b'{"prompt": [[5, 6]], "max_tokens": 2}'),
    ("/v1/completions", b'{"prompt": [5, 6], "max_tokens": 0, "echo": true, "logprobs": 1}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], '
     b'"kv_transfer_params": {"pd_version": 1, "prompt_token_ids": "x"}}'),
    # Well-formed ones, served whatever the generated bodies are (Hypothesis draws constants
    # from the modules loaded, so those shift with every change to pd).
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 2}'),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 2, "stream": true, "n": 2}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], '
     b'"max_tokens": 2}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], '
     b'"max_tokens": 2, "stream": true, "logprobs": true, "top_logprobs": 2}'),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 2, "logprobs": 1, "echo": true}'),
]  # fmt: skip

# Numbers at and past the edges the parsers check (int32, int64, float range).
_ints = st.one_of(
    st.integers(-3, 40),
    st.sampled_from([0, 1, 2**31 - 1, 2**31, 2**32, 2**63, 2**64 + 1, -(2**63)]),
    st.integers(),
)
_floats = st.one_of(
    st.floats(-3, 3, allow_nan=False), st.floats(allow_nan=False, allow_infinity=False)
)
_text = st.one_of(st.text(max_size=40), st.sampled_from(["", " ", "<|im_start|>", "\x00", "é😀"]))
_long_text = st.integers(1, 400_000).map(lambda n: "word " * (n // 5) + "x")
_json = st.recursive(
    st.none() | st.booleans() | _ints | _floats | _text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_text, inner, max_size=4),
    max_leaves=12,
)
JSON_VALUES = _json  # any JSON value, for other property tests
_token_ids = st.lists(_ints, min_size=0, max_size=40) | st.lists(
    st.integers(0, 49151), min_size=1, max_size=300
)
_prompt = st.one_of(
    _text,
    _long_text,
    _token_ids,
    st.lists(_text, max_size=3),  # batches
    st.lists(_token_ids, max_size=2),
    _json,
)
_content = st.one_of(
    _text,
    _long_text,
    st.none(),
    st.lists(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": _text})
        | _json,
        max_size=3,
    ),
    _json,
)
_message = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer"]),
         "content": _content},
    ),
    st.fixed_dictionaries({"role": _text | _json, "content": _content}),
    _json,
)  # fmt: skip
_messages = st.lists(_message, min_size=0, max_size=4) | _json

_TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}  # fmt: skip
_NAMED = {"type": "function", "function": {"name": "f"}}

# Field -> values: mostly plausible ones, then anything.
_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from(["stub-model", "default", "nope"]) | _json,
    "max_tokens": st.integers(1, 8) | _ints | _json,
    "max_completion_tokens": st.integers(1, 8) | _json,
    "temperature": st.sampled_from([0, 0.7, 1.0]) | _floats | _json,
    "top_p": _floats | _json,
    "top_k": _ints | _json,
    "min_p": _floats,
    "seed": _ints | _json,
    "stream": st.booleans() | _json,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans() | _json}) | _json,
    "stop": _text | st.lists(_text, max_size=3) | _json,
    "stop_token_ids": _token_ids | _json,
    "logprobs": st.booleans() | st.integers(-1, 7) | _json,
    "top_logprobs": st.integers(-1, 7) | _json,
    "presence_penalty": _floats,
    "frequency_penalty": _floats,
    "repetition_penalty": _floats,
    "ignore_eos": st.booleans() | _json,
    "n": _ints,
    "echo": st.booleans(),
    "prompt_logprobs": st.integers(-1, 3) | _json,
    "user": _text | _json,
    "session_id": _text | _json,
    "cache_salt": _text | _json,
    "kv_transfer_params": _json
    | st.fixed_dictionaries({"do_remote_decode": st.booleans(), "max_tokens": _ints}),
    "pd_continuation": st.fixed_dictionaries({"output_token_ids": _token_ids}) | _json,
    "tools": st.just([_TOOL]) | st.lists(st.just(_TOOL) | _json, max_size=2) | _json,
    "tool_choice": st.sampled_from(["none", "auto", "required", _NAMED]) | _json,
    "parallel_tool_calls": st.booleans() | _json,
    "unknown_field": _json,
}


def with_known_cases(test: Any) -> Any:
    """A @given test that also tries every body of `KNOWN_CASES`, first."""
    for case in KNOWN_CASES:
        test = example(case)(test)
    return test


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    """(path, raw body): a JSON object of generated fields, or now and then raw bytes."""
    path = draw(st.sampled_from(PATHS))
    kind = draw(st.integers(0, 19))
    if kind == 0:  # not a JSON object
        raw = draw(st.binary(max_size=64) | _json.map(lambda v: json.dumps(v).encode()))
        return path, raw
    body: dict[str, Any] = {}
    if path.endswith("chat/completions"):
        if kind != 1:
            body["messages"] = draw(_messages)
    elif kind != 1:
        body["prompt"] = draw(_prompt)
    names = draw(st.lists(st.sampled_from(sorted(_FIELDS)), max_size=6, unique=True))
    for name in names:
        body[name] = draw(_FIELDS[name])
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = draw(st.integers(1, 8))  # keep what is served short
    # json, not orjson: it writes integers of any size and lone surrogates (as escapes).
    return path, json.dumps(body).encode()


def assert_openai_answer(status: int, raw: bytes, content_type: str) -> None:
    """Never a 5xx; a 4xx carries an OpenAI error object; a 200 is JSON or an SSE stream."""
    assert status < 500, (status, raw[:300])
    if status >= 400:
        body = orjson.loads(raw)
        error = body["error"]
        assert set(error) == {"message", "type", "code", "param"}, body
        assert isinstance(error["message"], str) and error["message"], body
        assert isinstance(error["type"], str), body
        return
    assert status == 200, status
    if content_type.startswith("text/event-stream"):
        events = [e for e in raw.split(b"\n\n") if e.strip()]
        assert events and events[-1] == b"data: [DONE]", raw[-300:]
        for e in events[:-1]:
            payload = orjson.loads(e.removeprefix(b"data: "))
            assert "error" not in payload, payload
    else:
        assert "choices" in orjson.loads(raw)


# CI runs a bounded number of examples, the same ones every run (a random draw of 150 once
# served 4 bodies, under the tests' "a good share was served" floor of 5: a flake, not a bug);
# PD_FUZZ_EXAMPLES=5000 searches longer, on fresh random draws.
EXAMPLES = int(os.environ.get("PD_FUZZ_EXAMPLES", "150"))
DERANDOMIZE = "PD_FUZZ_EXAMPLES" not in os.environ


def fuzz(
    loop: asyncio.AbstractEventLoop,
    client: TestClient,
    after_each: Callable[[], Awaitable[None]] | None = None,
) -> dict[int, int]:
    """Send `EXAMPLES` generated bodies (the known cases first) through `client` on `loop`,
    holding each answer to `assert_openai_answer` (and `after_each`, e.g. a page check); the
    answers counted by status."""
    seen: dict[int, int] = {}

    async def send(path: str, raw: bytes) -> None:
        resp = await client.post(path, data=raw, headers={"Content-Type": "application/json"})
        data = await resp.read()
        seen[resp.status] = seen.get(resp.status, 0) + 1
        assert_openai_answer(resp.status, data, resp.headers.get("Content-Type", ""))
        if after_each is not None:
            await after_each()

    @settings(
        max_examples=EXAMPLES,
        derandomize=DERANDOMIZE,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(bodies())
    @with_known_cases
    def check(case: tuple[str, bytes]) -> None:
        loop.run_until_complete(send(*case))

    check()
    print("answers by status:", seen)
    return seen
