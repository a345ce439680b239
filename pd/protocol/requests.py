"""The OpenAI requests pd serves, parsed and validated once (`parse_request`): completions and
chat, with their messages, prompts and continuation.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from pd.protocol.errors import bad_request
from pd.protocol.fields import check_fields
from pd.protocol.options import (
    MAX_CACHE_SALT_CHARS,
    MAX_CHOICES,
    MAX_MESSAGES,
    MAX_N,
    MAX_PROMPTS,
    MAX_TOKEN_ID,
    MAX_TOP_LOGPROBS,
    GenerationOptions,
    bounded,
    integer,
    is_token_ids,
    optional,
    parse_options,
    token_ids_field,
)
from pd.protocol.tools import ToolRequest, check_tool_message, parse_tools

PRIORITY_LIMIT = (1 << 31) - 1  # vLLM's priority is an int: a 32-bit one here


@dataclass
class _RequestBase:
    model: str | None
    options: GenerationOptions
    stream: bool
    include_usage: bool  # stream_options.include_usage
    user: str | None  # also a room key for sticky routing
    session_id: str | None
    kv_transfer_params: dict[str, Any] | None  # set by the router only; opaque here
    # vLLM's `cache_salt`: requests with different salts share no cached KV (enters the first
    # page's hash on the workers and the router's prefix index). None: the shared cache.
    cache_salt: str | None
    n: int  # choices per prompt, 1..MAX_N: the prompt is prefilled once and forked
    raw: dict[str, Any] = field(repr=False)  # the body as received
    # vLLM's `prompt_logprobs` as the client asked (None: not asked; options.prompt_logprobs
    # is what is computed).
    prompt_logprobs: int | None = None
    # The router's `pd_continuation.output_token_ids` (docs/migration.md §3): the output the
    # uninterrupted request had generated; this worker goes on from there. None: a new request.
    continuation: list[int] | None = None
    # vLLM's `priority` (lower first; None: not given, 0): the router's class
    # (pd/router/admission.py) and the order the workers take waiting requests in.
    priority: int | None = None

    @property
    def room_key(self) -> str | None:
        return self.user or self.session_id


def _parse_common(body: dict) -> dict[str, Any]:
    stream = bool(optional(body, "stream", bool, False))
    stream_options = optional(body, "stream_options", dict, {})
    include_usage = stream_options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise bad_request("'stream_options.include_usage' must be a boolean", "stream_options")
    kvp = optional(body, "kv_transfer_params", dict)
    salt = optional(body, "cache_salt", str)
    if salt is not None and not 1 <= len(salt) <= MAX_CACHE_SALT_CHARS:
        raise bad_request(
            f"'cache_salt' must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters",
            param="cache_salt",
        )
    n = integer(body, "n", 1, 1, MAX_N) or 1
    return dict(
        model=optional(body, "model", str),
        stream=stream,
        include_usage=include_usage,
        user=optional(body, "user", str),
        session_id=optional(body, "session_id", str),
        kv_transfer_params=kvp,
        cache_salt=salt,
        n=n,
        raw=body,
        continuation=parse_continuation(body.get("pd_continuation"), n),
        priority=integer(body, "priority", None, -PRIORITY_LIMIT, PRIORITY_LIMIT),
    )


def parse_continuation(value: Any, n: int = 1) -> list[int] | None:
    """`pd_continuation` (set by the router only: docs/migration.md §3): its output token ids,
    or None when absent. Whether the ids fit this worker (vocabulary, context) and agree with
    `kv_transfer_params` is the worker's check."""
    if value is None:
        return None
    param = "pd_continuation"
    if not isinstance(value, dict):
        raise bad_request("'pd_continuation' must be an object", param)
    # (`pd_sig`: the router's signature, pd/signing.py checks it)
    unknown = sorted(k for k in value if k not in ("output_token_ids", "pd_sig"))
    if unknown:
        raise bad_request(f"'pd_continuation' has unknown keys: {', '.join(unknown)}", param)
    ids: Any = value.get("output_token_ids")
    if not is_token_ids(ids):
        raise bad_request(
            f"'pd_continuation.output_token_ids' must be a list of token ids (0..{MAX_TOKEN_ID})",
            param,
        )
    if n != 1:
        raise bad_request(f"'pd_continuation' continues one choice: n must be 1, not {n}", param)
    return [int(t) for t in ids]


@dataclass
class CompletionRequest(_RequestBase):
    prompt: str | list[int] = ""  # text, or token ids (with `batch`: its first prompt)
    echo: bool = False
    # A list of 2..MAX_PROMPTS prompts (None: one prompt, `prompt`): answered as one choice list,
    # choice `prompt_index * n + choice_index` (vLLM's order).
    batch: list[str | list[int]] | None = None

    @classmethod
    def parse(cls, body: dict[str, Any]) -> CompletionRequest:
        if "prompt" not in body:
            raise bad_request("'prompt' is required", param="prompt", code="missing_field")
        prompt = body["prompt"]
        batch: list[str | list[int]] | None = None
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) > MAX_PROMPTS:
                raise bad_request(
                    f"'prompt' may be a list of at most {MAX_PROMPTS} prompts, got {len(prompt)}",
                    param="prompt",
                )
            batch = [_one_prompt(p) for p in prompt]
            prompt = batch[0]
            if len(batch) == 1:
                batch = None  # a batch of one: answered as a single prompt
        else:
            prompt = _one_prompt(prompt)
        n = integer(body, "n", 1, 1, MAX_N) or 1
        if batch is not None and len(batch) * n > MAX_CHOICES:
            raise bad_request(
                f"{len(batch)} prompts x n={n} is {len(batch) * n} choices; at most "
                f"{MAX_CHOICES} a request",
                param="n",
            )
        logprobs = integer(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
        echo = bool(optional(body, "echo", bool, False))
        asked = _prompt_logprobs(body)
        computed = asked
        if echo and logprobs is not None:  # the echoed prompt's logprobs, as vLLM computes them
            computed = max(asked or 0, logprobs)
        options = parse_options(
            body,
            ("max_tokens",),
            16,  # OpenAI's default for completions
            logprobs is not None,
            logprobs or 0,
            computed,
            echo,
        )
        return cls(
            prompt=prompt,
            options=options,
            echo=echo,
            prompt_logprobs=asked,
            batch=batch,
            **_parse_common(body),
        )


def _prompt_logprobs(body: dict) -> int | None:
    """vLLM's `prompt_logprobs`: alternatives per prompt position, 0..MAX_TOP_LOGPROBS."""
    return integer(body, "prompt_logprobs", None, 0, MAX_TOP_LOGPROBS)


def _one_prompt(prompt: Any) -> str | list[int]:
    """One prompt of a completions request: a non-empty text or list of token ids."""
    if isinstance(prompt, list):
        prompt = token_ids_field(prompt, "prompt")
        if not prompt:
            raise bad_request("'prompt' must not be empty", param="prompt")
    elif not isinstance(prompt, str):
        raise bad_request(
            "'prompt' must be a string, a list of token ids, or a list of those",
            param="prompt",
            code="invalid_type",
        )
    elif not prompt:
        raise bad_request("'prompt' must not be empty", param="prompt")
    return prompt


_ROLES = ("system", "user", "assistant", "tool", "developer")


def _parse_messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise bad_request("'messages' must be a non-empty list", param="messages")
    bounded(value, "messages", MAX_MESSAGES, "messages")
    messages = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise bad_request(f"'messages[{i}]' must be an object", param="messages")
        role = m.get("role")
        if role not in _ROLES:
            raise bad_request(
                f"'messages[{i}].role' must be one of {', '.join(_ROLES)}", param="messages"
            )
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text"):
                    raise bad_request(
                        f"'messages[{i}].content' supports only text parts", param="messages"
                    )
                if not isinstance(part.get("text"), str):
                    raise bad_request(f"'messages[{i}]' text part needs 'text'", param="messages")
                parts.append(part["text"])
            content = "".join(parts)
        elif content is None and role == "assistant":
            content = ""
        elif not isinstance(content, str):
            raise bad_request(f"'messages[{i}].content' must be a string", param="messages")
        if role == "tool" or m.get("tool_calls") is not None:
            check_tool_message(i, m)
        messages.append({**m, "content": content})
    return messages


@dataclass
class ChatCompletionRequest(_RequestBase):
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: ToolRequest | None = None  # tools, tool_choice, parallel_tool_calls (tools.py)

    @classmethod
    def parse(cls, body: dict[str, Any]) -> ChatCompletionRequest:

        if "messages" not in body:
            raise bad_request("'messages' is required", param="messages", code="missing_field")
        messages = _parse_messages(body["messages"])
        logprobs = bool(optional(body, "logprobs", bool, False))
        if not logprobs and body.get("top_logprobs") is not None:
            raise bad_request("'top_logprobs' requires 'logprobs': true", param="top_logprobs")
        top_logprobs = integer(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS) if logprobs else 0
        assert top_logprobs is not None  # it has a default
        if body.get("echo") not in (None, False):  # vLLM echoes the last message: not here
            raise bad_request(
                "'echo' is served on /v1/completions only", param="echo", code="unsupported_value"
            )
        asked = _prompt_logprobs(body)
        options = parse_options(
            body, ("max_completion_tokens", "max_tokens"), None, logprobs, top_logprobs, asked
        )
        tools = parse_tools(body)
        if tools is not None and tools.constrained:  # the output is the call(s): constrained
            if options.constraint is not None:
                raise bad_request(
                    f"'tool_choice' {tools.choice!r} constrains the output to tool calls: it "
                    "cannot be combined with another structured-output constraint",
                    param="tool_choice",
                )
            options = replace(options, constraint=tools.constraint())
        return cls(
            messages=messages,
            options=options,
            tools=tools,
            prompt_logprobs=asked,
            **_parse_common(body),
        )


def parse_request(
    path: str, body: dict[str, Any], *, ignore_unknown_fields: bool = False
) -> CompletionRequest | ChatCompletionRequest:
    """Parse a body for `/v1/completions` or `/v1/chat/completions`: every field checked against
    `FIELDS` first (refused and unknown fields are 400s), then each served one validated."""
    chat = path.endswith("/chat/completions")
    check_fields(body, chat, ignore_unknown_fields)
    if chat:
        return ChatCompletionRequest.parse(body)
    return CompletionRequest.parse(body)
