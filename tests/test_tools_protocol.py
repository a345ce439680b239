"""`tools`, `tool_choice`, `parallel_tool_calls` and the history's tool messages as the router and
the workers parse them (`pd.protocol.tools` through `parse_request`): 400s as OpenAI error objects,
and the constraint `required` and a named function ask for."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pd.protocol import APIError, parse_request
from tests.api_bodies import JSON_VALUES

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"],
}


def tool(name: str, parameters: dict | None = None, **extra: Any) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": name, **extra}
    if parameters is not None:
        fn["parameters"] = parameters
    return {"type": "function", "function": fn}


TOOLS = [tool("get_weather", CITY, description="weather"), tool("ping")]


def parse(messages: list | None = None, **body: Any):
    return parse_request(CHAT, {"messages": messages or USER, **body})


def error(messages: list | None = None, **body: Any) -> APIError:
    with pytest.raises(APIError) as e:
        parse(messages, **body)
    assert e.value.status == 400 and e.value.type == "invalid_request_error", e.value.message
    assert set(e.value.body()["error"]) == {"message", "type", "code", "param"}
    return e.value


def test_tools_parse_with_auto_by_default():
    req = parse(tools=TOOLS)
    assert req.tools is not None and req.tools.choice == "auto" and req.tools.parallel
    assert req.tools.names == ["get_weather", "ping"]
    assert req.options.constraint is None  # auto and none constrain nothing
    assert parse(tools=TOOLS, tool_choice="none").tools.choice == "none"
    assert parse(tools=[]).tools is None and parse(tool_choice="none").tools is None
    assert parse(tools=TOOLS, parallel_tool_calls=False).tools.parallel is False


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"tools": {"a": 1}}, "'tools' must be a list"),
        ({"tools": [tool("f")] * 129}, "at most 128"),
        ({"tools": ["f"]}, "'tools[0]' must be"),
        ({"tools": [{"type": "code_interpreter"}]}, "function tools only"),
        ({"tools": [{"type": "function"}]}, "'tools[0].function' must be an object"),
        ({"tools": [{"type": "function", "function": {}}]}, "name' must be"),
        ({"tools": [tool("bad name")]}, "name' must be"),
        ({"tools": [tool("x" * 65)]}, "name' must be"),
        ({"tools": [tool("f"), tool("f")]}, "two tools are named 'f'"),
        ({"tools": [tool("f", description=3)]}, "description' must be a string"),
        ({"tools": [tool("f", parameters=[1])]}, "parameters' must be a JSON schema object"),
        ({"tools": [tool("f", strict="yes")]}, "strict' must be a boolean"),
        ({"tools": [tool("f", nope=1)]}, "unknown field 'nope'"),
        ({"tools": [{**tool("f"), "extra": 1}]}, "unknown field 'extra'"),
        ({"tools": TOOLS, "tool_choice": "always"}, "'tool_choice' must be"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "'tool_choice' must be"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "'nope', which is not in 'tools'"),
        ({"tool_choice": "required"}, "needs 'tools'"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "not in 'tools'"),
        ({"tools": TOOLS, "parallel_tool_calls": "no"}, "must be a boolean"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "cannot be combined"),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a+"}, "cannot be combined"),
    ],
)  # fmt: skip
def test_bad_tools_and_tool_choices_are_400s_naming_the_problem(body, needle):
    e = error(**body)
    assert needle in e.message
    assert e.param in ("tools", "tool_choice", "parallel_tool_calls"), e.param


def test_a_named_function_constrains_the_output_to_its_parameters():
    req = parse(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    c = req.options.constraint
    assert req.tools.choice == "function" and req.tools.name == "get_weather"
    assert c is not None and c.kind == "json_schema" and json.loads(c.spec) == CITY
    req = parse(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "ping"}})
    assert json.loads(req.options.constraint.spec) == {"type": "object", "properties": {}}


def test_required_constrains_the_output_to_an_array_of_calls():
    schema = json.loads(parse(tools=TOOLS, tool_choice="required").options.constraint.spec)
    good = [{"name": "get_weather", "parameters": {"city": "Paris"}},
            {"name": "ping", "parameters": {}}]  # fmt: skip
    jsonschema.validate(good, schema)
    for bad in (
        [],
        [{"name": "nope", "parameters": {}}],
        [{"name": "get_weather", "parameters": {}}],  # city is required
        [{"name": "ping"}],
        [{"name": "ping", "parameters": {}, "extra": 1}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    req = parse(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    one = json.loads(req.options.constraint.spec)
    jsonschema.validate(good[:1], one)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, one)


def test_required_hoists_the_tools_definitions_to_the_root():
    refs = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}},
            "$defs": {"P": {"type": "integer"}}}  # fmt: skip
    req = parse(tools=[tool("a", refs), tool("b", refs)], tool_choice="required")
    schema = json.loads(req.options.constraint.spec)
    assert schema["$defs"] == {"P": {"type": "integer"}}
    jsonschema.validate([{"name": "b", "parameters": {"p": 3}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "b", "parameters": {"p": "x"}}], schema)
    other = {**refs, "$defs": {"P": {"type": "string"}}}
    assert "differently" in error(tools=[tool("a", refs), tool("b", other)],
                                  tool_choice="required").message  # fmt: skip


def test_history_tool_messages_are_checked():
    call = {"id": "call_1", "type": "function",
            "function": {"name": "f", "arguments": '{"a": 1}'}}  # fmt: skip
    ok = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
          {"role": "tool", "tool_call_id": "call_1", "content": "42"}]  # fmt: skip
    req = parse(ok)
    assert req.messages[1]["content"] == "" and req.messages[1]["tool_calls"] == [call]
    for messages, needle in [
        ([*USER, {"role": "tool", "content": "42"}], "tool_call_id' must be a string"),
        ([*USER, {"role": "assistant", "tool_calls": {}}], "must be a list"),
        ([*USER, {"role": "assistant", "tool_calls": ["x"]}], "must be {'function'"),
        ([*USER, {"role": "assistant", "tool_calls": [{"function": {"name": "f",
          "arguments": "{nope"}}]}], "not valid JSON"),
        ([*USER, {"role": "assistant", "tool_calls": [{"function": {"name": "f",
          "arguments": 3}}]}], "must be a JSON string"),
        ([*USER, {"role": "assistant", "tool_calls": [{**call, "type": "custom"}]}],
         "type' must be 'function'"),
        ([*USER, {"role": "assistant", "tool_calls": [{**call, "id": 7}]}], "id' must be"),
        ([{"role": "user", "content": "x", "tool_calls": [call]}], "only allowed on assistant"),
        ([*USER, {"role": "tool", "tool_call_id": "c", "content": None}], "must be a string"),
    ]:  # fmt: skip
        e = error(messages)
        assert needle in e.message and e.param == "messages", e.message


_tool = st.one_of(
    st.builds(tool, st.sampled_from(["f", "g", "get_weather", "bad name", ""]),
              st.none() | st.just(CITY) | JSON_VALUES),
    JSON_VALUES,
)  # fmt: skip
_choice = st.one_of(
    st.sampled_from(["none", "auto", "required", "any"]),
    st.builds(lambda n: {"type": "function", "function": {"name": n}},
              st.sampled_from(["f", "g", "nope"])),
    JSON_VALUES,
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.lists(_tool, max_size=3) | JSON_VALUES, _choice | st.none(), st.none() | JSON_VALUES)
def test_any_tools_body_parses_or_is_a_400(tools, choice, parallel):
    body = {"tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel}
    try:
        req = parse_request(CHAT, {"messages": USER, **body})
    except APIError as e:
        assert e.status == 400 and e.message
        return
    if req.tools is not None and req.tools.constrained:
        assert req.options.constraint is not None
        json.loads(req.options.constraint.spec)
