"""The field table (`pd.protocol.FIELDS`): every field served, accepted or refused by name, unknown
ones refused as OpenAI refuses them (or accepted and logged once), and docs/api.md in step."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from pd.protocol import ACCEPTED, FIELDS, REFUSED, SERVED, APIError, parse_request

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
BASE = {CHAT: {"messages": [{"role": "user", "content": "hi"}]}, COMPLETIONS: {"prompt": "hi"}}


def paths_of(name: str) -> list[str]:
    endpoint = FIELDS[name].endpoint
    return [p for p, e in ((CHAT, "chat"), (COMPLETIONS, "completions")) if endpoint in ("both", e)]


REFUSED_CASES = [(n, p) for n, r in FIELDS.items() if r.status == REFUSED for p in paths_of(n)]


@pytest.mark.parametrize("name, path", REFUSED_CASES)
def test_each_refused_field_is_a_400_naming_it_unless_it_asks_for_nothing(name, path):
    with pytest.raises(APIError) as e:
        parse_request(path, {**BASE[path], name: "on"})
    assert e.value.status == 400 and e.value.code == "unsupported_parameter", e.value.message
    assert e.value.param == name and name in e.value.message
    for noop in FIELDS[name].noop:  # echo: false, tools: [], response_format: {"type": "text"}
        parse_request(path, {**BASE[path], name: noop})
    parse_request(path, {**BASE[path], name: None})  # null is absent


@pytest.mark.parametrize(
    "name, value",
    [("store", True), ("metadata", {"k": "v"}), ("service_tier", "auto"),
     ("prompt_cache_key", "k"), ("request_id", "r-1"), ("safety_identifier", "u")],
)  # fmt: skip
def test_accepted_fields_change_nothing_and_pass(name, value):
    assert FIELDS[name].status == ACCEPTED
    req = parse_request(CHAT, {**BASE[CHAT], name: value})
    assert req.options == parse_request(CHAT, BASE[CHAT]).options


def test_unknown_fields_are_refused_as_openai_does_or_accepted_and_logged_once(caplog):
    for path in (CHAT, COMPLETIONS):
        with pytest.raises(APIError, match="Unrecognized request argument supplied: tempreature"):
            parse_request(path, {**BASE[path], "tempreature": 0.5})
    with pytest.raises(APIError) as e:  # a field of the other endpoint is unknown here
        parse_request(CHAT, {**BASE[CHAT], "suffix": "x"})
    assert e.value.code == "unknown_parameter" and e.value.param == "suffix"
    with caplog.at_level(logging.WARNING, "pd.protocol"):
        for _ in range(3):
            parse_request(CHAT, {**BASE[CHAT], "x_custom": 1}, ignore_unknown_fields=True)
    assert sum("x_custom" in r.message for r in caplog.records) == 1
    with pytest.raises(APIError, match="not supported"):  # refused fields stay refused
        parse_request(CHAT, {**BASE[CHAT], "use_beam_search": True}, ignore_unknown_fields=True)


def test_stream_options_need_stream_and_their_own_fields_are_checked():
    body = {**BASE[CHAT], "stream_options": {"include_usage": True}}
    with pytest.raises(APIError, match="only allowed with 'stream': true"):
        parse_request(CHAT, body)
    assert parse_request(CHAT, {**body, "stream": True}).include_usage
    for options, code in [
        ({"continuous_usage_stats": True}, "unsupported_parameter"),
        ({"include_usage": True, "made_up": 1}, "unknown_parameter"),
    ]:
        with pytest.raises(APIError) as e:
            parse_request(CHAT, {**BASE[CHAT], "stream": True, "stream_options": options})
        assert e.value.code == code


def test_every_field_the_parsers_read_is_served_in_the_table():
    # A served field the parsers never read would be accepted and ignored: spot-check the set.
    served = {n for n, r in FIELDS.items() if r.status == SERVED}
    read = {"temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
            "logprobs", "top_logprobs", "max_tokens", "max_completion_tokens", "ignore_eos",
            "skip_special_tokens", "cache_salt", "stream", "stream_options", "n"}  # fmt: skip
    assert read <= served


def test_docs_api_md_lists_every_field_with_its_status():
    doc = (Path(__file__).parent.parent / "docs" / "api.md").read_text()
    rows = dict(re.findall(r"^\| `([a-z_]+)` \| (served|accepted|refused) \|", doc, re.M))
    assert rows == {n: r.status for n, r in FIELDS.items()}
