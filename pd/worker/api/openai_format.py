"""OpenAI response bodies (JSON answers and SSE chunks) for completions and chat completions."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from pd.protocol.names import SSE_IDS
from pd.worker.api.echo import PromptPart
from pd.worker.engine import Delta
from pd.worker.tools import ToolStream

# SSE_KEEPALIVE is written when a stream has been silent this long (a request that waits for
# the batch or for pages, or prefills): proxies and the router's idle watch see it alive.
KEEPALIVE_S = 5.0


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
    # The prompt's part (echo, prompt_logprobs: echo.py), built at the first delta, when the
    # prompt's logprobs are complete; None when the request asks for neither.
    prompt_part: Callable[[], PromptPart] | None = None
    prompt: PromptPart | None = None
    offsets: list[int] = field(default_factory=list)  # text_offset of each entry of `logprobs`
    chars: int = 0  # characters of the choice's text so far (the echoed prompt's included)
    _prompt_sent: bool = False  # the stream's first chunk carried the prompt's part
    index: int = 0  # the choice's (n > 1, lists of prompts: choices.py combines builders)
    # Chat with tools (tool_choice other than none): the text parsed into content and tool_calls.
    tools: ToolStream | None = None
    # X-PD-Token-Ids (docs/migration.md §1): an event with new tokens opens with their ids
    # (`: pd-ids <index> <id> ...`), for the router.
    announce_ids: bool = False
    # A stream: each delta goes out as it comes, so nothing is kept for a final answer (the
    # text and logprobs of a long stream with top_logprobs would pile up for nothing).
    streaming: bool = False
    started: bool = False  # the first delta was added

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.id

    def add(self, delta: Delta) -> None:
        if not self.started:  # the first delta: the prompt's part goes first (built, or ahead)
            self.started = True
            if self.prompt is None and self.prompt_part is not None:
                self.prompt = self.prompt_part()
            self.chars = len(self.prompt.text) if self.prompt is not None else 0
        if self.streaming:  # this delta's offsets only (its chunk reads them)
            self.offsets = [self.chars] * len(delta.logprobs)
        else:
            self.offsets.extend(self.chars for _ in delta.logprobs)
            self.text.append(delta.text)
            self.logprobs.extend(delta.logprobs)
        self.chars += len(delta.text)
        self.completion_tokens += len(delta.token_ids)
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

    def _logprobs(self, entries: list, offsets: list[int]) -> dict | None:
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
                None if top is None else {self.token_text(t): logprob for t, logprob in top}
                for _, _, top in entries
            ],
            "text_offset": offsets,
        }

    def prompt_fields(self, body: dict[str, Any]) -> None:
        """vLLM's prompt_logprobs of a chat answer: in the body (as vLLM puts them); a
        completion's are in its choice."""
        if self.chat and self.prompt is not None and self.prompt.prompt_logprobs is not None:
            body["prompt_logprobs"] = self.prompt.prompt_logprobs

    # ----------------------------------------------------------------------------- bodies

    def final(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.response_id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [self.choice()],
            "usage": self.usage(),
        }
        self.prompt_fields(body)
        if extra:
            body.update(extra)
        return body

    def choice(self) -> dict[str, Any]:
        """The choice of a JSON answer (a completion's with the prompt's part: echo,
        prompt_logprobs; a chat's with tools parsed into content and tool_calls)."""
        text = "".join(self.text)
        prompt = self.prompt or PromptPart()
        choice: dict[str, Any] = {"index": self.index}
        finish_reason = self.finish_reason
        if self.chat and self.tools is not None:
            if not self.tools.finished:
                self.tools.whole(text)
            choice["message"] = {"role": "assistant", **self.tools.message()}
            finish_reason = self.tools.finish_reason(finish_reason)
        elif self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = prompt.text + text
        choice["logprobs"] = self._logprobs(
            prompt.entries + self.logprobs, prompt.offsets + self.offsets
        )
        choice["finish_reason"] = finish_reason
        if not self.chat and prompt.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt.prompt_logprobs
        return choice

    def chunk(self, delta: Delta | None, role: bool = False) -> bytes:
        """One SSE event for a delta (or the chat stream's opening role chunk), after `add`
        took it; the first delta's carries the prompt's part (echo, prompt_logprobs)."""
        prompt = PromptPart()
        if delta is not None and not self._prompt_sent and self.prompt is not None:
            prompt, self._prompt_sent = self.prompt, True
        top: dict[str, Any] = {}  # a chat's prompt_logprobs go in the body (as vLLM's)
        if prompt.prompt_logprobs is not None and self.chat:
            top["prompt_logprobs"] = prompt.prompt_logprobs
        if self.tools is not None and delta is not None and not role:
            return self._ids(delta) + self._tool_chunks(delta, top)
        choice: dict[str, Any] = {"index": self.index}
        if self.chat:
            choice["delta"] = (
                # With tools, OpenAI's streams open with a null content (calls may follow).
                {"role": "assistant", "content": None if self.tools is not None else ""}
                if role or delta is None
                else {"content": delta.text}
            )
        else:
            choice["text"] = prompt.text + delta.text if delta else ""
        choice["logprobs"] = (
            self._logprobs(
                prompt.entries + delta.logprobs,
                prompt.offsets + self.offsets[len(self.offsets) - len(delta.logprobs) :],
            )
            if delta
            else None
        )
        choice["finish_reason"] = delta.finish_reason if delta else None
        if prompt.prompt_logprobs is not None and not self.chat:
            choice["prompt_logprobs"] = prompt.prompt_logprobs
        return self._ids(delta) + self._event(choice, top)

    def _ids(self, delta: Delta | None) -> bytes:
        """The `: pd-ids` line of an event with new tokens, when announced (else nothing)."""
        if not self.announce_ids or delta is None or not delta.token_ids:
            return b""
        return SSE_IDS + f"{self.index} {' '.join(map(str, delta.token_ids))}\n".encode()

    def _tool_chunks(self, delta: Delta, top: dict[str, Any]) -> bytes:
        """The events of a delta parsed for tool calls: one per content or call piece (none
        while its text is held back), the logprobs and finish reason on the last; `top` (the
        prompt's logprobs) goes with the first."""
        assert self.tools is not None
        deltas = self.tools.feed(delta.text)
        if delta.finish_reason:
            deltas += self.tools.finish()
        offsets = self.offsets[len(self.offsets) - len(delta.logprobs) :]
        logprobs = self._logprobs(delta.logprobs, offsets)
        finish_reason = self.tools.finish_reason(delta.finish_reason)
        if not deltas and (
            finish_reason or logprobs is not None or top or (self.announce_ids and delta.token_ids)
        ):  # (the router's streams: an event per token, its ids before it)
            deltas = [{}]
        last = len(deltas) - 1
        return b"".join(
            self._event(
                {
                    "index": self.index,
                    "delta": d,
                    "logprobs": logprobs if i == last else None,
                    "finish_reason": finish_reason if i == last else None,
                },
                top if i == 0 else {},
            )
            for i, d in enumerate(deltas)
        )

    def _event(self, choice: dict[str, Any], top: dict[str, Any] | None = None) -> bytes:
        body = {
            "id": self.response_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        if top:
            body.update(top)
        return sse(body)

    def usage_chunk(self, usage: dict[str, Any] | None = None) -> bytes:
        return sse(
            {
                "id": self.response_id,
                "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": usage or self.usage(),
            }
        )
