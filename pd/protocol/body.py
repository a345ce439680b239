"""A request body at the edge: JSON parsed with a depth bound, the content type required, header
values as the client's bytes.
"""

from __future__ import annotations

from typing import Any

import orjson

from pd.protocol.errors import APIError, bad_request

MAX_JSON_DEPTH = 64  # containers nested in a body, or in JSON a server parses from a string


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """Decode a request body; anything but a JSON object, or one nested deeper than
    MAX_JSON_DEPTH, is a 400."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    if json_too_deep(raw, body):
        raise bad_request(
            f"request body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json"
        )
    return body


def require_json(method: str, has_body: bool, content_type: str) -> None:
    """A POST with a body must say `application/json` (a 415 otherwise, as vLLM answers): a
    browser's form or text POST from another site never reaches a handler (CSRF)."""
    if method == "POST" and has_body and content_type != "application/json":
        raise APIError(
            415,
            f"a request body must be JSON: send 'Content-Type: application/json', not "
            f"{content_type!r}",
            code="unsupported_media_type",
        )


def json_too_deep(raw: bytes | str, value: Any, most: int = MAX_JSON_DEPTH) -> bool:
    """Whether `value`, parsed from `raw`, nests more than `most` objects and arrays. Most
    bodies hold fewer brackets than that (counted in C); the others are walked without
    recursion, skipping lists of scalars (a prompt's ids) in C."""
    opens = (
        raw.count("[") + raw.count("{")
        if isinstance(raw, str)
        else (raw.count(b"[") + raw.count(b"{"))
    )
    if opens <= most or not isinstance(value, (dict, list)):
        return False
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        x, depth = stack.pop()
        if depth > most:
            return True
        items = list(x.values()) if isinstance(x, dict) else x
        kinds = set(map(type, items))
        if dict in kinds or list in kinds:
            stack.extend((y, depth + 1) for y in items if isinstance(y, (dict, list)))
    return False


def header_bytes(value: str) -> bytes:
    """A header value as the bytes the client sent (aiohttp decodes them as UTF-8 with
    surrogateescape): compared and hashed as bytes, never a UnicodeEncodeError."""
    try:
        return value.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return value.encode("utf-8", "backslashreplace")
