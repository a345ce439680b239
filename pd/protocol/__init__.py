"""The protocol shared by router and workers, defined once, torch-free.

- `errors`: OpenAI-style errors (`APIError` -> `{"error": {"message", "type", "code", "param"}}`).
- `body`: a request body at the edge (JSON depth, content type, header bytes).
- `options`: `GenerationOptions` and the per-field checks and bounds.
- `constraints`: structured outputs (`Constraint`).
- `tools`: tool calling on the wire (`ToolRequest`).
- `requests`: the parsed OpenAI requests (`CompletionRequest`, `ChatCompletionRequest`).
- `fields`: the field table (`FIELDS`): every request field served, accepted or refused.
- `wire`: router <-> worker: `WorkerLoad` (`/health`), `KVTransferParams` (DESIGN.md §3).
- `names`: pd's headers, SSE lines and internal request fields, each declared once.

Validation happens here, at the edge; everything past `parse_*` may trust its types. The names
below are the package's face; its modules import each other, never this file.
"""

from __future__ import annotations

from pd.protocol.body import (
    MAX_JSON_DEPTH,
    header_bytes,
    json_too_deep,
    parse_json_body,
    require_json,
)
from pd.protocol.constraints import Constraint
from pd.protocol.errors import APIError, bad_request, error_body
from pd.protocol.fields import (
    ACCEPTED,
    FIELDS,
    REFUSED,
    SERVED,
    unknown_fields,
    unknown_parameter,
    unsupported_parameter,
)
from pd.protocol.options import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_MESSAGES,
    MAX_N,
    MAX_PROMPTS,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKEN_ID,
    MAX_TOKENIZE_CHARS,
    MAX_TOP_LOGPROBS,
    GenerationOptions,
)
from pd.protocol.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_continuation,
    parse_request,
)
from pd.protocol.wire import KVTransferParams, WorkerLoad

__all__ = [
    "ACCEPTED",
    "APIError",
    "ChatCompletionRequest",
    "CompletionRequest",
    "Constraint",
    "FIELDS",
    "GenerationOptions",
    "KVTransferParams",
    "MAX_ALLOWED_TOKEN_IDS",
    "MAX_BAD_WORDS",
    "MAX_BAD_WORD_CHARS",
    "MAX_JSON_DEPTH",
    "MAX_LOGIT_BIAS",
    "MAX_MESSAGES",
    "MAX_N",
    "MAX_PROMPTS",
    "MAX_STOP",
    "MAX_STOP_CHARS",
    "MAX_STOP_TOKEN_IDS",
    "MAX_TOKENIZE_CHARS",
    "MAX_TOKEN_ID",
    "MAX_TOP_LOGPROBS",
    "REFUSED",
    "SERVED",
    "WorkerLoad",
    "bad_request",
    "error_body",
    "header_bytes",
    "json_too_deep",
    "parse_continuation",
    "parse_json_body",
    "parse_request",
    "require_json",
    "unknown_fields",
    "unknown_parameter",
    "unsupported_parameter",
]
