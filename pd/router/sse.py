"""OpenAI SSE <-> JSON answers: P's final answer as a stream, and D's stream as one answer."""

from __future__ import annotations

import re
from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def answer_to_sse(answer: dict[str, Any], chat: bool, include_usage: bool) -> bytes:
    """A complete non-streaming answer (one choice) as the SSE events a stream would carry."""
    head: dict[str, Any] = {k: answer[k] for k in ("id", "created", "model") if k in answer}
    events = []
    for c in answer.get("choices") or ():
        if chat:
            message = c.get("message") or {}
            choice = {
                "index": c.get("index", 0),
                "delta": {
                    "role": message.get("role", "assistant"),
                    "content": message.get("content") or "",
                },
                "logprobs": c.get("logprobs"),
                "finish_reason": c.get("finish_reason"),
            }
        else:
            choice = {
                "index": c.get("index", 0),
                "text": c.get("text", ""),
                "logprobs": c.get("logprobs"),
                "finish_reason": c.get("finish_reason"),
            }
        obj = {
            **head,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "choices": [choice],
        }
        if include_usage:
            obj["usage"] = None
        events.append(_event(obj))
    if include_usage and answer.get("usage") is not None:
        obj = {
            **head,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "choices": [],
            "usage": answer["usage"],
        }
        events.append(_event(obj))
    events.append(DONE)
    return b"".join(events)


# A chat chunk's content string, as OpenAI servers write it (ours, vLLM, SGLang): a regex over
# the whole stream and one JSON parse of the strings beat parsing every event (a few us for a
# 32-chunk stream, against ~30). A string value cannot contain an unescaped quote, so the
# pattern cannot match inside the text itself.
_CONTENT = re.compile(rb'"delta":\{(?:"role":"[a-z]*",)?"content":("[^"\\]*(?:\\.[^"\\]*)*")')


def stream_text(data: bytes) -> tuple[str, dict[str, Any] | None] | None:
    """The text a complete chat SSE stream carried and its usage (None when absent), or None
    when it carried an error event or did not end with [DONE]. The router reads back every chat
    stream it relays, to learn what the worker now has cached."""
    tail = data.rstrip()
    if not tail.endswith(b"data: [DONE]") or b'data: {"error"' in data:
        return None
    strings = _CONTENT.findall(data)
    try:
        text = "".join(orjson.loads(b"[" + b",".join(strings) + b"]"))
    except orjson.JSONDecodeError:
        return None
    usage = None
    at = data.rfind(b'"usage":{')
    if at >= 0:  # the usage event, when the stream has one: parse that event alone
        begin = data.rfind(b"data: ", 0, at) + 6
        stop = data.find(b"\n", at)
        try:
            usage = orjson.loads(data[begin : stop if stop >= 0 else None]).get("usage")
        except orjson.JSONDecodeError:
            usage = None
    return text, usage


class StreamError(Exception):
    """The upstream stream carried an error event or broke off."""

    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(str(body))
        self.body = body


class SSECollector:
    """Feeds on a completion or chat SSE stream and builds the one JSON answer it amounts to."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.done = False
        self._buf = b""
        self._head: dict[str, Any] = {}
        self._text: list[str] = []
        self._role = "assistant"
        self._finish: str | None = None
        self._logprobs: dict[str, Any] | None = None
        self._usage: dict[str, Any] | None = None

    def feed(self, data: bytes) -> None:
        self._buf += data
        *events, self._buf = self._buf.replace(b"\r\n", b"\n").split(b"\n\n")
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    self._on_data(line[5:].strip())

    def _on_data(self, payload: bytes) -> None:
        if payload == b"[DONE]":
            self.done = True
            return
        obj = orjson.loads(payload)
        if "error" in obj:
            raise StreamError(obj)
        if not self._head:
            self._head = {k: obj[k] for k in ("id", "created", "model") if k in obj}
        if obj.get("usage"):
            self._usage = obj["usage"]
        for c in obj.get("choices") or ():
            if self.chat:
                delta = c.get("delta") or {}
                self._role = delta.get("role") or self._role
                if delta.get("content"):
                    self._text.append(delta["content"])
            elif c.get("text"):
                self._text.append(c["text"])
            if c.get("finish_reason") is not None:
                self._finish = c["finish_reason"]
            if c.get("logprobs"):
                self._merge_logprobs(c["logprobs"])

    def _merge_logprobs(self, lp: dict[str, Any]) -> None:
        if self._logprobs is None:
            self._logprobs = {k: list(v) for k, v in lp.items() if isinstance(v, list)}
            return
        for k, v in lp.items():
            if isinstance(v, list):
                self._logprobs.setdefault(k, []).extend(v)

    def result(self) -> dict[str, Any]:
        text = "".join(self._text)
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": self._role, "content": text},
                "logprobs": self._logprobs,
                "finish_reason": self._finish,
            }
            kind = "chat.completion"
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": self._logprobs,
                "finish_reason": self._finish,
            }
            kind = "text_completion"
        return {**self._head, "object": kind, "choices": [choice], "usage": self._usage}
