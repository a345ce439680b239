"""Property-based tests of the parsers router and workers share (pd/protocol/,
pd/signing.py): JSON nested to any depth (in the body and in strings parsed again), lists of any
length around their bounds, and odd bytes. Each input parses or is a 400 (an APIError), never
another exception, and a list is refused exactly when it is past its bound."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pd.protocol import (
    MAX_BAD_WORDS,
    MAX_JSON_DEPTH,
    MAX_LOGIT_BIAS,
    MAX_MESSAGES,
    MAX_STOP,
    MAX_STOP_TOKEN_IDS,
    APIError,
    header_bytes,
    parse_json_body,
    parse_request,
)
from pd.signing import KV_PARAMS, Guard
from tests.api_bodies import JSON_VALUES

CHAT, COMPLETION = "/v1/chat/completions", "/v1/completions"
SETTINGS = settings(
    max_examples=150,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def nest(depth: int, kinds: list[bool], leaf: bytes = b"1") -> bytes:
    """`depth` containers around `leaf`: a list or an object per level, as `kinds` says."""
    out = leaf
    for i in range(depth):
        out = b"[" + out + b"]" if kinds[i % len(kinds)] else b'{"k": ' + out + b"}"
    return out


def is_400(e: APIError) -> bool:
    return e.status == 400 and isinstance(e.message, str) and bool(e.message)


@SETTINGS
@given(st.integers(0, 3000), st.lists(st.booleans(), min_size=1, max_size=5))
def test_a_body_nested_to_any_depth_parses_or_is_a_400(depth, kinds):
    raw = b'{"prompt": "hi", "metadata": ' + nest(depth, kinds) + b"}"
    try:
        body = parse_json_body(raw)
    except APIError as e:
        assert is_400(e) and depth + 1 > MAX_JSON_DEPTH, (depth, e)
        return
    assert depth + 1 <= MAX_JSON_DEPTH and body["prompt"] == "hi"


@SETTINGS
@given(st.integers(0, 600))
def test_tool_call_arguments_nested_to_any_depth_are_parsed_or_a_400(depth):
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "f", "arguments": nest(depth, [True, False]).decode()}}]},
        {"role": "tool", "tool_call_id": "c", "content": "x"},
    ]  # fmt: skip
    try:
        parse_request(CHAT, {"messages": history})
    except APIError as e:
        assert is_400(e) and depth > MAX_JSON_DEPTH, (depth, e)
        return
    assert depth <= MAX_JSON_DEPTH, depth


@SETTINGS
@given(st.binary(max_size=256))
def test_odd_bytes_parse_or_are_a_400(raw):
    try:
        body = parse_json_body(raw)
    except APIError as e:
        assert is_400(e)
        return
    assert isinstance(body, dict)
    for path in (CHAT, COMPLETION):
        try:
            parse_request(path, body)
        except APIError as e:
            assert is_400(e)


@SETTINGS
@given(JSON_VALUES, st.sampled_from([CHAT, COMPLETION]), st.sampled_from(
    ["stop", "bad_words", "stop_token_ids", "logit_bias", "tools", "messages", "prompt",
     "response_format", "structured_outputs", "n", "seed", "pd_continuation"]))  # fmt: skip
def test_any_json_in_any_field_parses_or_is_a_400(value, path, field):
    body = {"messages": [{"role": "user", "content": "hi"}]} if path == CHAT else {"prompt": "x"}
    try:
        parse_request(path, {**body, field: value})
    except APIError as e:
        assert is_400(e), e


BOUNDS = {
    "stop": (MAX_STOP, lambda n: [f"s{i}" for i in range(n)]),
    "bad_words": (MAX_BAD_WORDS, lambda n: [f"w{i}" for i in range(n)]),
    "stop_token_ids": (MAX_STOP_TOKEN_IDS, lambda n: list(range(n))),
    "logit_bias": (MAX_LOGIT_BIAS, lambda n: {str(i): 1.0 for i in range(n)}),
    "messages": (MAX_MESSAGES, lambda n: [{"role": "user", "content": "hi"}] * n),
}


@settings(max_examples=60, derandomize=True, deadline=None, database=None)
@given(st.sampled_from(sorted(BOUNDS)), st.integers(-3, 3) | st.integers(4, 50_000))
def test_a_list_is_refused_exactly_past_its_bound(field, offset):
    bound, make = BOUNDS[field]
    n = max(1, bound + offset)
    body = {"prompt": "x"} if field != "messages" else {}
    path = CHAT if field == "messages" else COMPLETION
    try:
        parse_request(path, {**body, field: make(n)})
    except APIError as e:
        assert is_400(e) and n > bound and e.param == field, (field, n, e)
        return
    assert n <= bound, (field, n)


@SETTINGS
@given(st.text(max_size=64))
def test_any_header_text_becomes_bytes(value):
    """aiohttp hands header bytes over as latin-1 or surrogate-escaped text; compared as bytes
    they never raise."""
    assert isinstance(header_bytes(value), bytes)


@SETTINGS
@given(JSON_VALUES, JSON_VALUES, st.sampled_from(["127.0.0.1", "192.0.2.1", None, "::1", "x"]))
def test_the_guard_accepts_or_is_a_403_whatever_it_is_sent(payload, sig, remote):
    try:
        Guard(b"token").check(KV_PARAMS, remote, payload, sig)
    except APIError as e:
        assert e.status == 403
        return
    assert remote in ("127.0.0.1", "::1") and sig is None


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH, MAX_JSON_DEPTH + 1, 254, 255, 256, 100_000])
def test_depths_around_the_encoders_limit(depth):
    """orjson's encoder stops at 255 levels: deeper input is refused before it could reach it."""
    raw = b'{"metadata": ' + nest(depth - 1, [True]) + b"}"
    try:
        parse_json_body(raw)
    except APIError as e:
        assert is_400(e) and depth > MAX_JSON_DEPTH
        return
    assert depth <= MAX_JSON_DEPTH
    orjson.dumps(parse_json_body(raw))
