"""OpenAI-style errors: `APIError` -> `{"error": {"message", "type", "code", "param"}}`, and a
short description of a client's bad value for their messages.
"""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error answered to an HTTP client as an OpenAI-style JSON body."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.code, self.param)


def error_body(
    message: str,
    type: str = "invalid_request_error",
    code: str | None = None,
    param: str | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "code": code, "param": param}}


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, "invalid_request_error", code, param)


def clip(value: Any, limit: int = 60) -> str:
    """A short, cheap description of a bad value (it may be megabytes of a client's JSON)."""
    if isinstance(value, (list, dict)):
        return f"a {type(value).__name__} of {len(value)}"
    if isinstance(value, str) and len(value) > limit:
        return repr(value[:limit]) + "..."
    return repr(value)
