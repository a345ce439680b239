"""One streamed request to an OpenAI-compatible endpoint, and what it measured.

TTFT is the time to the first chunk of a token: one that carries text or a finish reason (a
request whose only token is EOS has no text; a chat stream's opening role chunk is no token).
Each later such chunk adds an inter-token gap (a chunk carrying several tokens counts as one). Output tokens and cached
prompt tokens come from `usage` (asked with `stream_options.include_usage`), else output tokens
are the text chunks. A request fails with a kind: `http_<status>`, `timeout`, `connection`,
`no_sse` (a 200 that is not an event stream, or one without events), `stream_error` (an error
event, or a stream cut before `[DONE]`); `error_code` keeps the error body's `code`.

A request's `outcome` is `completed`, or names what a router with a concurrency budget answered
(docs/api.md, "Priority classes"): `refused` (429: its class's queue was full), `timed_out`
(408: it waited past its class's deadline), `preempted` (503 with code `preempted`); any other
failure is `failed` (the bench's own `--request-timeout`, a `timeout`, included).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from pd._compat import asyncio_timeout

OUTCOMES = ("completed", "refused", "timed_out", "preempted", "failed")


@dataclass
class RequestRecord:
    target: str
    rate: float | None  # None for closed loop and traces
    job_id: str
    turn: int
    planned_s: float  # when it was due, from the phase's start
    sent_s: float = 0.0  # when it was sent
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int = 0
    cached_tokens: int | None = None
    error: str | None = None  # the failure's kind; None when it completed
    detail: str = ""  # the failure's message
    text: str = ""  # the answer (multi-turn carries it into the next turn)
    priority_class: str | None = None  # sent as X-Priority-Class (--priority-mix)
    error_code: str | None = None  # the error body's (or error event's) `code`, if any

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def outcome(self) -> str:
        """One of `OUTCOMES` (the module's docstring)."""
        if self.error is None:
            return "completed"
        if self.error == "http_429":
            return "refused"
        if self.error == "http_408":
            return "timed_out"
        if self.error == "http_503" and self.error_code == "preempted":
            return "preempted"
        return "failed"

    @property
    def lag_s(self) -> float:
        return self.sent_s - self.planned_s

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first."""
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


async def stream_request(
    http: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    record: RequestRecord,
    *,
    chat: bool,
    headers: dict[str, str] | None = None,
    timeout_s: float | None = None,
) -> RequestRecord:
    """Send `body` (streamed, usage included) and fill `record` in."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    try:
        async with asyncio_timeout(timeout_s):
            await _read_stream(http, url + path, body, headers, record, t0, chat)
    except TimeoutError:
        record.error, record.detail = "timeout", f"no answer within {timeout_s} s"
    except aiohttp.ClientError as e:
        record.error, record.detail = "connection", f"{type(e).__name__}: {e}"
    if record.error is None:
        record.e2e_s = time.perf_counter() - t0
    return record


async def _read_stream(
    http: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str] | None,
    record: RequestRecord,
    t0: float,
    chat: bool,
) -> None:
    async with http.post(url, data=orjson.dumps(body), headers=_headers(headers)) as resp:
        if resp.status >= 400:
            record.error = f"http_{resp.status}"
            text = await resp.text()
            record.detail = text[:300]
            record.error_code = _error_code(text)
            return
        if not resp.headers.get("Content-Type", "").startswith("text/event-stream"):
            record.error, record.detail = "no_sse", resp.headers.get("Content-Type", "")
            return
        last = None
        chunks, events, done = 0, 0, False
        parts: list[str] = []
        async for line in resp.content:
            if not line.startswith(b"data: "):
                continue
            events += 1
            data = line[6:].strip()
            if data == b"[DONE]":
                done = True
                break
            event = orjson.loads(data)
            if "error" in event:
                record.error = "stream_error"
                record.detail = str(event["error"].get("message", event["error"]))[:300]
                record.error_code = _code_of(event)
                return
            text, finished = _token(event, chat)
            if text or finished:
                now = time.perf_counter() - t0
                if last is None:
                    record.ttft_s = now
                else:
                    record.itl_s.append(now - last)
                last = now
                chunks += 1
                parts.append(text)
            usage = event.get("usage")
            if usage:
                record.prompt_tokens = usage.get("prompt_tokens")
                record.output_tokens = usage.get("completion_tokens") or 0
                details = usage.get("prompt_tokens_details") or {}
                record.cached_tokens = details.get("cached_tokens")
        if events == 0:
            record.error, record.detail = "no_sse", "the stream carried no events"
        elif not done:
            record.error, record.detail = "stream_error", "the stream ended before [DONE]"
        record.text = "".join(parts)
        if not record.output_tokens:
            record.output_tokens = chunks


def _token(event: dict[str, Any], chat: bool) -> tuple[str, bool]:
    """The chunk's text, and whether it carries a finish reason."""
    choices = event.get("choices") or []
    if not choices:
        return "", False
    choice = choices[0]
    if chat:
        text = (choice.get("delta") or {}).get("content") or ""
    else:
        text = choice.get("text") or ""
    return text, choice.get("finish_reason") is not None


def _error_code(text: str) -> str | None:
    """The `error.code` of an OpenAI-style error body, if it is one."""
    try:
        body = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    return _code_of(body)


def _code_of(body: Any) -> str | None:
    error = body.get("error") if isinstance(body, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None


def _headers(extra: dict[str, str] | None) -> dict[str, str]:
    return {"Content-Type": "application/json", **(extra or {})}
