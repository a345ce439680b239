"""A tool call's name and arguments from its JSON text while it is being written (vLLM's way,
with `partial_json_parser`), such that the argument pieces streamed concatenate to exactly the
arguments of the finished call.

The finished call's arguments are `json.dumps(arguments, ensure_ascii=False)` (what vLLM answers).
Meanwhile the partial text is parsed with partial strings, objects and arrays allowed (partial
numbers, booleans and nulls are left out until they end), serialized the same way, and cut back
to what cannot change: the closing quotes and brackets the parse added, and a trailing lone
surrogate (half of an escaped pair the next piece may complete). What is left is a prefix of the
final serialization, since a partial value only grows at its end.
"""

from __future__ import annotations

import json
import re
from typing import Any

import partial_json_parser  # type: ignore[import-untyped]  # (ships no types)
from partial_json_parser.core.options import Allow  # type: ignore[import-untyped]

_WHOLE_STRINGS = Allow.OBJ | Allow.ARR  # strings only once their closing quote is written
_PARTIAL_STRINGS = Allow.STR | Allow.OBJ | Allow.ARR
_ARGUMENT_KEYS = ("arguments", "parameters")  # Hermes, Mistral; Llama 3, tool_choice required
# A backslash escape not yet complete at the end of the text: left out of the partial parse.
_OPEN_ESCAPE = re.compile(r"\\(u[0-9a-fA-F]{0,3})?$")


def dumps(value: Any) -> str:
    return _escape_surrogates(json.dumps(value, ensure_ascii=False))


# A lone surrogate (an escaped pair's half the model never completed) cannot be sent as UTF-8:
# it stays escaped, as the model wrote it.
_SURROGATE = re.compile("[\ud800-\udfff]")


def _escape_surrogates(text: str) -> str:
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def _partial(text: str, allow: Allow) -> Any:
    try:
        return partial_json_parser.loads(text, allow)
    except (ValueError, RecursionError):  # nothing parseable yet, or no JSON at all
        return None


def name_of(text: str) -> str | None:
    """The call's function name once it is written whole, else None."""
    call = _partial(text, _WHOLE_STRINGS)
    name = call.get("name") if isinstance(call, dict) else None
    return name if isinstance(name, str) and name else None


def _arguments(call: Any) -> Any:
    if isinstance(call, dict):
        for key in _ARGUMENT_KEYS:
            if key in call:
                return call[key]
    return None


def stable_arguments(text: str) -> str:
    """The part of the arguments' serialization that the rest of the text cannot change ("" when
    they have not begun)."""
    text = _OPEN_ESCAPE.sub("", text)
    call = _partial(text, _PARTIAL_STRINGS)
    if not isinstance(call, dict) or not any(k in call for k in _ARGUMENT_KEYS):
        return ""
    out = json.dumps(_arguments(call), ensure_ascii=False)
    end = len(out)
    while end and (out[end - 1] in '"]}' or "\ud800" <= out[end - 1] <= "\udfff"):
        end -= 1
    return _escape_surrogates(out[:end])


def final_arguments(text: str) -> str:
    """The finished call's arguments: `{}` when it has none; what its text parses to (a
    truncated one: as far as it got)."""
    stripped = text.strip()
    try:
        call, _ = json.JSONDecoder().raw_decode(stripped)
    except (ValueError, RecursionError):
        call = _partial(_OPEN_ESCAPE.sub("", stripped), _PARTIAL_STRINGS)
    args = _arguments(call)
    if args is None:
        return "{}"
    return dumps(args)
