"""OpenAI SSE <-> JSON answers: P's final answer as a stream, and D's stream as one answer."""

from __future__ import annotations

import re
from typing import Any

import orjson

from pd.protocol.names import SSE_DONE

_DONE_LINE = SSE_DONE.rstrip()  # b"data: [DONE]"
_DONE_PAYLOAD = _DONE_LINE[len(b"data: ") :]  # b"[DONE]"


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def answer_to_sse(answer: dict[str, Any], chat: bool, include_usage: bool) -> bytes:
    """A complete non-streaming answer as the SSE events a stream of it would carry: one chunk
    per choice with every field of the answer, a chat message's as its delta (each tool call
    with its index, as streams number them), then the usage chunk when asked."""
    head = {k: v for k, v in answer.items() if k not in ("choices", "usage")}
    head["object"] = "chat.completion.chunk" if chat else "text_completion"
    events = []
    for c in answer.get("choices") or ():
        if not isinstance(c, dict):
            continue
        if chat:
            choice = {"index": 0, "delta": _delta(c.get("message")), "logprobs": None}
            choice.update((k, v) for k, v in c.items() if k != "message")
        else:
            choice = {"index": 0, "text": "", "logprobs": None, **c}
        choice.setdefault("finish_reason", None)
        obj = {**head, "choices": [choice]}
        if include_usage:
            obj["usage"] = None
        events.append(_event(obj))
    if include_usage and answer.get("usage") is not None:
        head.pop("prompt_logprobs", None)  # a chat answer's (vLLM's place): in its first event
        events.append(_event({**head, "choices": [], "usage": answer["usage"]}))
    events.append(SSE_DONE)
    return b"".join(events)


def _delta(message: Any) -> dict[str, Any]:
    delta: dict[str, Any] = {"role": "assistant", "content": ""}
    if isinstance(message, dict):
        delta.update(message)
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            delta["tool_calls"] = [
                {"index": i, **call} if isinstance(call, dict) else call
                for i, call in enumerate(calls)
            ]
    return delta


# A chat chunk's content string, as OpenAI servers write it (ours, vLLM, SGLang): a regex over
# the whole stream and one JSON parse of the strings beat parsing every event
# (docs/BENCHMARKS.md, "With the prefix index and decode-local routing"). A string value cannot
# contain an unescaped quote, so the
# pattern cannot match inside the text itself.
_CONTENT = re.compile(rb'"delta":\{(?:"role":"[a-z]*",)?"content":("[^"\\]*(?:\\.[^"\\]*)*")')


def stream_text(data: bytes) -> tuple[str, dict[str, Any] | None] | None:
    """The text a complete chat SSE stream carried and its usage (None when absent), or None
    when it carried an error event or did not end with [DONE]. The router reads back every chat
    stream it relays, to learn what the worker now has cached."""
    tail = data.rstrip()
    if not tail.endswith(_DONE_LINE) or b'data: {"error"' in data:
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
    """Feeds on a completion or chat SSE stream and builds the one JSON answer it amounts to,
    keeping every field (OpenAI's streaming semantics, generically): top-level fields and a
    choice's own take the last non-null value; choices merge by `index`; a chat delta merges
    into the choice's message (`_merge`); a completion's `text` is concatenated and logprobs'
    lists are. Past `limit` bytes fed (pd/router/answer_size.py) it drops what it holds and
    takes nothing more: `overflow` says so."""

    def __init__(self, chat: bool, limit: int | None = None) -> None:
        self.chat = chat
        self.done = False
        self.limit = limit
        self.size = 0  # bytes fed
        self.overflow = False
        self._buf = b""
        self._top: dict[str, Any] = {}  # every top-level field but the choices
        self._choices: dict[int, dict[str, Any]] = {}  # by index: its fields so far

    def feed(self, data: bytes) -> None:
        if self.overflow:
            return
        self.size += len(data)
        if self.limit is not None and self.size > self.limit:
            self.overflow = True
            self._buf, self._top, self._choices = b"", {}, {}
            return
        self._buf += data
        *events, self._buf = self._buf.replace(b"\r\n", b"\n").split(b"\n\n")
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    self._on_data(line[5:].strip())

    def _on_data(self, payload: bytes) -> None:
        """One event; ValueError when it is no JSON object (orjson's JSONDecodeError is one)."""
        if payload == _DONE_PAYLOAD:
            self.done = True
            return
        obj = orjson.loads(payload)
        if not isinstance(obj, dict):
            raise ValueError("an SSE event that is no JSON object")
        if "error" in obj:
            raise StreamError(obj)
        top = self._top
        for k, v in obj.items():
            if k == "choices":
                for c in v if isinstance(v, list) else ():
                    if isinstance(c, dict):
                        self._on_choice(c)
            elif v is not None or k not in top:
                top[k] = v

    def _on_choice(self, c: dict[str, Any]) -> None:
        index = c.get("index", 0)
        if type(index) is not int:
            index = 0
        into = self._choices.get(index)
        if into is None:
            into = self._choices[index] = {"index": index}
        for k, v in c.items():
            if k == "delta":
                if isinstance(v, dict):
                    message = into.get("message")
                    if not isinstance(message, _Merged):
                        message = into["message"] = _Merged()
                    _merge(message, v, by_index=True)
            elif k == "text" and isinstance(v, str):
                text = into.get("text")
                if isinstance(text, _Text):
                    text.append(v)
                else:
                    into["text"] = _Text((v,))
            elif k == "logprobs" and isinstance(v, dict):
                logprobs = into.get("logprobs")
                if not isinstance(logprobs, _Merged):
                    logprobs = into["logprobs"] = _Merged()
                _merge(logprobs, v, by_index=False)
            elif v is not None or k not in into:
                into[k] = v

    def result(self) -> dict[str, Any]:
        choices = [self._choice(self._choices[i]) for i in sorted(self._choices)]
        return {
            **self._top,
            "object": "chat.completion" if self.chat else "text_completion",
            "choices": choices or [self._choice({"index": 0})],
            "usage": self._top.get("usage"),
        }

    def _choice(self, fields: dict[str, Any]) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": fields["index"]}
        if self.chat:
            message = {"role": "assistant", "content": "", **_built(fields.get("message", {}))}
            message["role"] = message["role"] or "assistant"
            calls = message.get("tool_calls")
            if isinstance(calls, list):
                message["tool_calls"] = _tool_calls(calls)
            choice["message"] = message
        else:
            choice["text"] = _built(fields.get("text", ""))
        choice["logprobs"] = _built(fields.get("logprobs"))
        choice["finish_reason"] = fields.get("finish_reason")
        for k, v in fields.items():
            if k not in choice and k not in ("message", "text"):
                choice[k] = _built(v)
        return choice


class _Text(list):
    """A string streamed in pieces, joined once when the answer is built (not copied anew with
    every piece: a long answer would cost its length squared)."""

    __slots__ = ()


class _Merged(dict):
    """A dict merged from deltas (the only kind `_built` walks into: what was copied whole, as
    a logprob entry, holds no pieces)."""

    __slots__ = ()


# In a delta these are names, set whole (once, or repeated in every chunk by some servers): a
# role, a tool call's id, type and function name. Every other string is a piece of text.
_NAMES = frozenset(("role", "id", "type", "name"))


def _merge(into: _Merged, delta: dict[str, Any], by_index: bool) -> None:
    """Merge a delta into what came before it: strings concatenated (names set), dicts merged,
    lists extended (with `by_index`, an entry with an `index` merges into the one of that index:
    a tool call's first delta brings its id, type and function name, the next ones pieces of its
    arguments), anything else the last non-null value."""
    for k, v in delta.items():
        old = into.get(k)
        if v is None:
            into.setdefault(k, None)
        elif isinstance(v, str) and k not in _NAMES:
            if isinstance(old, _Text):
                old.append(v)
            else:
                into[k] = _Text((v,))
        elif isinstance(v, dict):
            if not isinstance(old, _Merged):
                old = into[k] = _Merged()
            _merge(old, v, by_index)
        elif isinstance(v, list):
            if not isinstance(old, list):
                old = into[k] = []
            for item in v:
                index = item.get("index") if by_index and isinstance(item, dict) else None
                if type(index) is not int:
                    old.append(item)
                    continue
                entry = next(
                    (e for e in old if isinstance(e, _Merged) and e["index"] == index), None
                )
                if entry is None:
                    entry = _Merged()
                    old.append(entry)
                _merge(entry, item, by_index)
        else:
            into[k] = v


def _built(v: Any) -> Any:
    """A merged value as plain JSON: its pieces of text joined."""
    if isinstance(v, _Text):
        return "".join(v)
    if isinstance(v, _Merged):
        return {k: _built(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_built(x) if isinstance(x, _Merged) else x for x in v]
    return v


def _tool_calls(calls: list[Any]) -> list[Any]:
    """Merged tool calls in their index order, without it: a non-streamed message's have none."""
    if not all(isinstance(c, dict) and type(c.get("index")) is int for c in calls):
        return calls
    return [{k: v for k, v in c.items() if k != "index"} for c in sorted(calls, key=_index)]


def _index(call: dict[str, Any]) -> int:
    return call["index"]
