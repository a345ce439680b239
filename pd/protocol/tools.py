"""Tool calling on the wire: `tools`, `tool_choice` and `parallel_tool_calls` validated, the
history's tool messages checked, and the constraint a `required` or named `tool_choice` asks for.

Torch-free and called from the request parsers (requests.py), so the router, P and D derive the same
`ToolRequest` and the same constraint from one body (P samples the first token under it, D
replays that token into its own matcher). As vLLM does it: a named function constrains the whole
output to that function's `parameters` schema (the output is the call's arguments); `required`
constrains it to a JSON array of `{"name": <one of the tools>, "parameters": <its schema>}`
(at least one call; at most one when `parallel_tool_calls` is false). `auto` lets the model
choose (the worker parses what it writes); `none` never returns a call.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import orjson

from pd.protocol.body import MAX_JSON_DEPTH, json_too_deep
from pd.protocol.constraints import Constraint
from pd.protocol.errors import bad_request

MAX_TOOLS = 128  # as OpenAI
# OpenAI's rule for a function name (letters, digits, underscores, dashes, at most 64), plus the
# dots and colons MCP clients put in theirs.
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_FUNCTION_KEYS = frozenset(("name", "description", "parameters", "strict"))
CHOICES = ("none", "auto", "required")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools, as validated. `choice` is "none", "auto", "required" or
    "function" (then `name` is the one function it must call)."""

    tools: tuple[dict[str, Any], ...]  # each {"type": "function", "function": {"name", ...}}
    choice: str = "auto"
    name: str | None = None
    parallel: bool = True  # parallel_tool_calls: false allows one call at most

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    @property
    def constrained(self) -> bool:
        """The output is constrained to tool calls (`required` or a named function)."""
        return self.choice in ("required", "function")

    def parameters(self, name: str) -> dict[str, Any]:
        for t in self.tools:
            if t["function"]["name"] == name:
                return t["function"].get("parameters") or EMPTY_PARAMETERS
        raise KeyError(name)

    def constraint(self) -> Constraint | None:
        """What the output must match: None unless `constrained`."""
        if self.choice == "function":
            assert self.name is not None
            return _schema(self.parameters(self.name))
        if self.choice != "required":
            return None
        defs: dict[str, dict[str, Any]] = {}
        items = []
        for name in self.names:
            params = dict(self.parameters(name))
            for key in ("$defs", "definitions"):  # refs point at the root: hoist them there
                for def_name, schema in (params.pop(key, None) or {}).items():
                    if defs.setdefault(key, {}).setdefault(def_name, schema) != schema:
                        raise bad_request(
                            f"tools define '{key}/{def_name}' differently: with tool_choice "
                            "'required' their definitions share one schema",
                            param="tools",
                        )
            items.append(
                {
                    "type": "object",
                    "properties": {"name": {"const": name}, "parameters": params},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
            )
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not self.parallel:
            array["maxItems"] = 1
        return _schema({**array, **defs})


def _schema(schema: dict[str, Any]) -> Constraint:
    try:
        # Keys keep the declared order: arguments are generated in that order.
        return Constraint("json_schema", orjson.dumps(schema).decode())
    except TypeError as e:  # e.g. integers past 64 bits
        message = f"'tools' holds a schema that is not serializable: {e}"
        raise bad_request(message, "tools") from None


def parse_tools(body: dict[str, Any]) -> ToolRequest | None:
    """The request's `ToolRequest`, or None when it has no tools and asks for no call; a 400
    (OpenAI's error object) for malformed tools, a bad tool_choice or one naming no tool."""
    raw_tools = body.get("tools")
    tools = _tools(raw_tools) if raw_tools is not None else ()
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request(
            "'parallel_tool_calls' must be a boolean", "parallel_tool_calls", "invalid_type"
        )
    choice, name = _choice(body.get("tool_choice"), tools)
    if not tools:
        return None
    return ToolRequest(tools, choice, name, parallel is not False)


def _tools(value: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise bad_request(f"'tools' must be a list of at most {MAX_TOOLS} tools", param="tools")
    seen: set[str] = set()
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_request(
                f"'{where}' must be {{'type': 'function', 'function': {{...}}}} (function tools "
                "only)",
                param="tools",
            )
        if set(tool) - {"type", "function"}:
            extra = sorted(set(tool) - {"type", "function"})[0]
            raise bad_request(f"'{where}' has an unknown field '{extra[:64]}'", param="tools")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise bad_request(f"'{where}.function' must be an object", param="tools")
        unknown = sorted(set(fn) - _FUNCTION_KEYS)
        if unknown:
            message = f"'{where}.function' has an unknown field '{unknown[0][:64]}'"
            raise bad_request(message, param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise bad_request(
                f"'{where}.function.name' must be 1 to 64 letters, digits, '_', '-', '.' or ':'",
                param="tools",
            )
        if name in seen:
            raise bad_request(f"'{where}': two tools are named '{name}'", param="tools")
        seen.add(name)
        for key, kind, label in (
            ("description", str, "a string"),
            ("parameters", dict, "a JSON schema object"),
            ("strict", bool, "a boolean"),
        ):
            if fn.get(key) is not None and not isinstance(fn[key], kind):
                raise bad_request(f"'{where}.function.{key}' must be {label}", param="tools")
    return tuple(value)


def _choice(value: Any, tools: tuple[dict[str, Any], ...]) -> tuple[str, str | None]:
    if value is None:
        return "auto", None
    if isinstance(value, str):
        if value not in CHOICES:
            raise bad_request(
                "'tool_choice' must be 'none', 'auto', 'required' or "
                "{'type': 'function', 'function': {'name': ...}}",
                param="tool_choice",
            )
        if value == "required" and not tools:
            raise bad_request("'tool_choice' 'required' needs 'tools'", param="tool_choice")
        return value, None
    fn = value.get("function") if isinstance(value, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not (isinstance(value, dict) and value.get("type") == "function" and isinstance(name, str)):
        raise bad_request(
            "'tool_choice' must be 'none', 'auto', 'required' or "
            "{'type': 'function', 'function': {'name': ...}}",
            param="tool_choice",
        )
    if name not in [t["function"]["name"] for t in tools]:
        raise bad_request(
            f"'tool_choice' names the function '{name[:64]}', which is not in 'tools'",
            param="tool_choice",
        )
    return "function", name


# ------------------------------------------------------------------------------ the history


def check_tool_message(i: int, message: dict[str, Any]) -> None:
    """A history message's tool fields: a `tool` message's `tool_call_id`, an assistant's
    `tool_calls` (each `{"id", "type": "function", "function": {"name", "arguments"}}`, the
    arguments a string of JSON, as OpenAI sends them, or an object). A 400 naming the message
    otherwise."""
    where = f"'messages[{i}]"
    if message["role"] == "tool":
        if not isinstance(message.get("tool_call_id"), str):
            raise bad_request(f"{where}.tool_call_id' must be a string", param="messages")
        return
    calls = message.get("tool_calls")
    if calls is None:
        return
    if message["role"] != "assistant":
        raise bad_request(f"{where}.tool_calls' is only allowed on assistant messages", "messages")
    if not isinstance(calls, list):
        raise bad_request(f"{where}.tool_calls' must be a list", param="messages")
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"{at}' must be {{'function': {{'name', 'arguments'}}}}", "messages")
        if call.get("id") is not None and not isinstance(call["id"], str):
            raise bad_request(f"{at}.id' must be a string", param="messages")
        if call.get("type") not in (None, "function"):
            raise bad_request(f"{at}.type' must be 'function'", param="messages")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                parsed = orjson.loads(args)
            except orjson.JSONDecodeError:
                why = f"{at}.function.arguments' is not valid JSON"
                raise bad_request(why, param="messages") from None
            if json_too_deep(args, parsed):
                why = f"{at}.function.arguments' nests deeper than {MAX_JSON_DEPTH} levels"
                raise bad_request(why, param="messages")
        elif not isinstance(args, dict):
            raise bad_request(
                f"{at}.function.arguments' must be a JSON string (or an object)", param="messages"
            )
