"""Constraints as vLLM users expect them: ECMA-262's regex classes and closed JSON schemas,
rewritten before llguidance reads them (pure functions, no tokenizer)."""

from __future__ import annotations

import pytest

from pd.worker.text.strict_schema import ecma_regex, strict


@pytest.mark.parametrize(
    "pattern, expected",
    [
        (r"\d{3}-\d{4}", r"[0-9]{3}-[0-9]{4}"),
        (r"\w+", r"[A-Za-z0-9_]+"),
        (r"[\d.]+", r"[0-9.]+"),
        (r"[^\w]", r"[^A-Za-z0-9_]"),
        (r"\D", r"[^0-9]"),
        (r"[\W-]", r"[[^A-Za-z0-9_]-]"),
        (r"\\d", r"\\d"),  # an escaped backslash, then a 'd'
        (r"[]\d]", r"[\]0-9]"),  # a leading ']' is a literal
        (r"\.\b\u0041", r"\.\b\u0041"),  # other escapes are kept as written
    ],
)
def test_ecma_classes_are_spelled_out(pattern, expected):
    assert ecma_regex(pattern) == expected


def test_ecma_space_is_ecma_262s():
    out = ecma_regex(r"\s")
    for kept in (r"\t", r"\n", r"\xA0", r"\x{2028}", r"\x{FEFF}"):
        assert kept in out
    assert "85" not in out  # NEL is Unicode white space, not ECMA's


def test_objects_and_tuples_are_closed_unless_the_schema_says_otherwise():
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "pattern": r"^\w+$"},
            "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
            "pair": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]},
            "open": {"type": "object", "properties": {}, "additionalProperties": True},
            "typed": {
                "type": "object",
                "properties": {},
                "additionalProperties": {"type": "integer"},
            },
            "by_name": {"type": "object", "patternProperties": {r"^\d+$": {"type": "string"}}},
            "more": {
                "type": "array",
                "prefixItems": [{"type": "integer"}],
                "items": {"type": "string"},
            },
        },
        "required": ["city"],
        "$defs": {"point": {"properties": {"x": {"type": "number"}}}},
        "anyOf": [{"properties": {"a": {"const": 1}}}],
        "enum": [{"properties": {"kept": 1}}],  # a value, not a schema
    }
    out = strict(schema)
    props = out["properties"]
    assert out["additionalProperties"] is False
    assert props["city"]["pattern"] == r"^[A-Za-z0-9_]+$"
    assert props["where"]["additionalProperties"] is False
    assert props["pair"]["items"] is False
    assert props["open"]["additionalProperties"] is True
    assert props["typed"]["additionalProperties"] == {"type": "integer"}
    assert "additionalProperties" not in props["by_name"]
    assert list(props["by_name"]["patternProperties"]) == [r"^[0-9]+$"]
    assert props["more"]["items"] == {"type": "string"}
    assert out["$defs"]["point"]["additionalProperties"] is False
    assert out["anyOf"][0]["additionalProperties"] is False
    assert out["enum"] == [{"properties": {"kept": 1}}]
    assert list(props) == list(schema["properties"])  # the declared order is kept
    assert "additionalProperties" not in schema  # the input is not edited
