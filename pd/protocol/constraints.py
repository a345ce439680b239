"""Structured outputs: `Constraint` (what an output must match) and its parse from
`response_format`, `structured_outputs` and the `guided_*` fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import orjson

from pd.protocol.body import MAX_JSON_DEPTH, json_too_deep
from pd.protocol.errors import bad_request


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match (structured outputs). `kind` is one of `KINDS`; `spec`
    its text: a JSON schema (serialized), nothing (any JSON object), a regex, a JSON list of
    choices, or a Lark or GBNF grammar. Compiled by the workers (pd/worker/text/grammar.py)."""

    kind: str
    spec: str = ""

    KINDS: ClassVar[tuple[str, ...]] = ("json_schema", "json_object", "regex", "choice", "grammar")


_GUIDED = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "json_schema": "json_schema",  # SGLang
    "regex": "regex",  # SGLang
    "ebnf": "grammar",  # SGLang
}
_STRUCTURED_OUTPUTS = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
}


def parse_constraint(body: dict[str, Any]) -> Constraint | None:
    """The one structured-output constraint a body asks for (response_format, vLLM's
    structured_outputs and guided_*, SGLang's regex/ebnf/json_schema), or None; a 400 for a
    malformed one or for two at once."""
    found: list[tuple[str, Constraint]] = []
    fmt = body.get("response_format")
    if fmt is not None:
        kinds = ("text", "json_object", "json_schema")
        if not isinstance(fmt, dict) or fmt.get("type") not in kinds:
            raise bad_request(
                "'response_format' must be {'type': 'text' | 'json_object' | 'json_schema', ...}",
                param="response_format",
            )
        if fmt["type"] == "json_object":
            found.append(("response_format", Constraint("json_object")))
        elif fmt["type"] == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise bad_request(
                    "'response_format.json_schema.schema' must be a JSON schema object",
                    param="response_format",
                )
            found.append(("response_format", _schema_constraint(schema, "response_format")))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict) or not so or not set(so) <= set(_STRUCTURED_OUTPUTS):
            raise bad_request(
                "'structured_outputs' must set one of " + ", ".join(_STRUCTURED_OUTPUTS),
                param="structured_outputs",
            )
        for key, value in so.items():
            if value is not None and value is not False:
                kind = _STRUCTURED_OUTPUTS[key]
                found.append(("structured_outputs", _constraint(kind, value, "structured_outputs")))
    for name, kind in _GUIDED.items():
        value = body.get(name)
        if value is not None:
            found.append((name, _constraint(kind, value, name)))
    if len(found) > 1:
        names = ", ".join(sorted({n for n, _ in found}))
        raise bad_request(f"one structured-output constraint per request, got {names}")
    return found[0][1] if found else None


def _constraint(kind: str, value: Any, param: str) -> Constraint:
    if kind == "json_schema":
        if isinstance(value, str):
            text = value
            try:
                value = orjson.loads(text)
            except orjson.JSONDecodeError:
                raise bad_request(f"'{param}' must be a JSON schema", param=param) from None
            if json_too_deep(text, value):
                raise bad_request(
                    f"'{param}' nests deeper than {MAX_JSON_DEPTH} levels", param=param
                )
        if not isinstance(value, dict):
            raise bad_request(f"'{param}' must be a JSON schema object", param=param)
        return _schema_constraint(value, param)
    if kind == "json_object":
        if value is not True:
            raise bad_request(f"'{param}.json_object' must be true", param=param)
        return Constraint("json_object")
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)):
            raise bad_request(f"'{param}' choices must be a non-empty list of strings", param)
        return Constraint("choice", orjson.dumps(value).decode())
    if not isinstance(value, str) or not value:
        raise bad_request(f"'{param}' must be a non-empty string", param=param)
    return Constraint(kind, value)


def _schema_constraint(schema: dict[str, Any], param: str) -> Constraint:
    try:
        # Keys keep the declared order: properties are generated in that order.
        return Constraint("json_schema", orjson.dumps(schema).decode())
    except TypeError as e:  # e.g. integers past 64 bits
        raise bad_request(f"'{param}' is not a serializable JSON schema: {e}", param) from None
