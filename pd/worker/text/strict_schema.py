"""Constraints as vLLM users expect them, rewritten before llguidance compiles them.

Two places where llguidance's defaults differ from vLLM's default backend (xgrammar) and from
ECMA-262, the regex dialect JSON Schema names:

- **Regex classes.** llguidance's `\\d`, `\\w` and `\\s` are Unicode's (`\\d` matches "🯸"); in
  ECMA-262 and vLLM `\\d` is `[0-9]`, `\\w` is `[A-Za-z0-9_]` and `\\s` is ECMA's white space and
  line terminators. `ecma_regex` spells them out as those classes (and `\\D`, `\\W`, `\\S` as
  their complements), inside brackets too, for a `regex` constraint and every JSON Schema
  `pattern` / `patternProperties` key.
- **Closed objects and arrays.** A JSON schema admits any undeclared property unless it says
  `additionalProperties: false`; vLLM's default backend admits only the declared ones. `strict`
  closes every object schema that declares `properties` and says nothing of
  `additionalProperties`, `patternProperties` or `unevaluatedProperties`, and every array with
  `prefixItems` and no `items`. A schema that says otherwise keeps what it says. The grammar
  enforces this: nothing edits the output afterwards.

Pure functions over plain JSON values; docs/api.md says what each constraint means.
"""

from __future__ import annotations

from typing import Any

# ECMA-262's WhiteSpace and LineTerminator code points (`\s`), as regex-syntax escapes.
_ECMA_SPACE = (
    r"\t\n\x0B\x0C\r\x20\xA0\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}"
    r"\x{3000}\x{FEFF}"
)
_CLASS_BODY = {"d": "0-9", "w": "A-Za-z0-9_", "s": _ECMA_SPACE}

# Keywords whose value is a schema, a list of schemas, or a map of name -> schema.
_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
        "propertyNames", "unevaluatedProperties", "unevaluatedItems", "additionalItems")  # fmt: skip
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "$defs", "definitions", "dependentSchemas")
_OPEN_OBJECT = ("additionalProperties", "patternProperties", "unevaluatedProperties")
_OPEN_ARRAY = ("items", "additionalItems", "unevaluatedItems")


def ecma_regex(pattern: str) -> str:
    """`pattern` with `\\d \\w \\s \\D \\W \\S` as ECMA-262 means them, in llguidance's syntax
    (Rust regex-syntax). Every other escape, and everything else, is kept as written."""
    out: list[str] = []
    depth = 0  # inside a bracketed class (regex-syntax nests them)
    i, n = 0, len(pattern)
    while i < n:
        ch = pattern[i]
        if ch == "\\" and i + 1 < n:
            nxt = pattern[i + 1]
            body = _CLASS_BODY.get(nxt.lower())
            if body is None:
                out.append(pattern[i : i + 2])
            elif nxt.islower():
                out.append(body if depth else f"[{body}]")
            else:  # a complement: a nested class inside brackets, as regex-syntax allows
                out.append(f"[^{body}]")
            i += 2
            continue
        if ch == "[":
            depth += 1
            out.append(ch)
            i += 1
            if i < n and pattern[i] == "^":
                out.append("^")
                i += 1
            if i < n and pattern[i] == "]":  # a leading ']' is a literal one
                out.append("\\]")
                i += 1
            continue
        if ch == "]" and depth:
            depth -= 1
        out.append(ch)
        i += 1
    return "".join(out)


def strict(schema: Any) -> Any:
    """A copy of `schema` closed as vLLM's default backend reads it, its patterns in ECMA-262's
    classes (see the module's note). Values that are not schemas (`enum`, `const`, `default`,
    `examples`) are left alone."""
    if not isinstance(schema, dict):
        return schema  # a boolean schema, or something the compiler will refuse
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _ONE:
            out[key] = strict(value)
        elif key in _LIST and isinstance(value, list):
            out[key] = [strict(v) for v in value]
        elif key in _MAP and isinstance(value, dict):
            out[key] = {k: strict(v) for k, v in value.items()}
        elif key == "patternProperties" and isinstance(value, dict):
            out[key] = {ecma_regex(k): strict(v) for k, v in value.items()}
        elif key == "pattern" and isinstance(value, str):
            out[key] = ecma_regex(value)
        else:
            out[key] = value
    if isinstance(out.get("properties"), dict) and not any(k in out for k in _OPEN_OBJECT):
        out["additionalProperties"] = False
    if isinstance(out.get("prefixItems"), list) and not any(k in out for k in _OPEN_ARRAY):
        out["items"] = False
    return out
