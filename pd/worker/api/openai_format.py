"""OpenAI response bodies (JSON answers and SSE chunks) for completions and chat completions."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from pd.worker.engine import Delta
from pd.worker.tools import ToolStream

SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


@dataclass
class ResponseBuilder:
    """Accumulates a request's deltas and renders them in its endpoint's format."""

    chat: bool
    model: str
    prompt_tokens: int
    token_text: Any  # callable: token id -> its text, for logprobs
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    text: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    logprobs: list = field(default_factory=list)
    wants_logprobs: bool = False
    finish_reason: str | None = None
    # Prompt tokens the prefix cache served (read when the usage is rendered: known at admission).
    cached_tokens: Callable[[], int] = lambda: 0
    # Chat with tools (tool_choice other than none): the text parsed into content and tool_calls.
    tools: ToolStream | None = None

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.id

    def add(self, delta: Delta) -> None:
        self.text.append(delta.text)
        self.completion_tokens += len(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        if delta.finish_reason:
            self.finish_reason = delta.finish_reason

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens()},
        }

    # ----------------------------------------------------------------------------- logprobs

    def _logprobs(self, entries: list) -> dict | None:
        if not self.wants_logprobs:
            return None
        if self.chat:
            content = []
            for token, lp, top in entries:
                text = self.token_text(token)
                content.append(
                    {
                        "token": text,
                        "logprob": lp,
                        "bytes": list(text.encode()),
                        "top_logprobs": [
                            {
                                "token": self.token_text(t),
                                "logprob": logprob,
                                "bytes": list(self.token_text(t).encode()),
                            }
                            for t, logprob in (top or [])
                        ],
                    }
                )
            return {"content": content}
        return {
            "tokens": [self.token_text(t) for t, _, _ in entries],
            "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [
                {self.token_text(t): logprob for t, logprob in (top or [])} for _, _, top in entries
            ],
        }

    # ----------------------------------------------------------------------------- bodies

    def final(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        text = "".join(self.text)
        choice: dict[str, Any] = {"index": 0}
        finish_reason = self.finish_reason
        if self.chat and self.tools is not None:
            if not self.tools.finished:
                self.tools.whole(text)
            choice["message"] = {"role": "assistant", **self.tools.message()}
            finish_reason = self.tools.finish_reason(finish_reason)
        elif self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = self._logprobs(self.logprobs)
        choice["finish_reason"] = finish_reason
        body = {
            "id": self.response_id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self.usage(),
        }
        if extra:
            body.update(extra)
        return body

    def chunk(self, delta: Delta | None, role: bool = False) -> bytes:
        """One SSE event for a delta (or the chat stream's opening role chunk)."""
        if self.tools is not None and delta is not None and not role:
            return self._tool_chunks(delta)
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["delta"] = (
                # With tools, OpenAI's streams open with a null content (calls may follow).
                {"role": "assistant", "content": None if self.tools is not None else ""}
                if role or delta is None
                else {"content": delta.text}
            )
        else:
            choice["text"] = delta.text if delta else ""
        choice["logprobs"] = self._logprobs(delta.logprobs) if delta else None
        choice["finish_reason"] = delta.finish_reason if delta else None
        return self._event(choice)

    def _tool_chunks(self, delta: Delta) -> bytes:
        """The events of a delta parsed for tool calls: one per content or call piece (none
        while its text is held back), the logprobs and finish reason on the last."""
        assert self.tools is not None
        deltas = self.tools.feed(delta.text)
        if delta.finish_reason:
            deltas += self.tools.finish()
        logprobs = self._logprobs(delta.logprobs)
        finish_reason = self.tools.finish_reason(delta.finish_reason)
        if not deltas and (finish_reason or logprobs is not None):
            deltas = [{}]
        last = len(deltas) - 1
        return b"".join(
            self._event(
                {
                    "index": 0,
                    "delta": d,
                    "logprobs": logprobs if i == last else None,
                    "finish_reason": finish_reason if i == last else None,
                }
            )
            for i, d in enumerate(deltas)
        )

    def _event(self, choice: dict[str, Any]) -> bytes:
        return sse(
            {
                "id": self.response_id,
                "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [choice],
            }
        )

    def usage_chunk(self) -> bytes:
        return sse(
            {
                "id": self.response_id,
                "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": self.usage(),
            }
        )
