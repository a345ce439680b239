"""One request's output as OpenAI's message fields: content and `tool_calls`, streamed or whole.

`ToolStream.feed(text)` turns each piece of the output into the deltas a chat stream sends
(`{"content": ...}`, or `{"tool_calls": [...]}` with one call's entry): a call's first delta
carries its index, id, type and name with `arguments: ""`, the next ones pieces of its arguments
(`arguments.py`: they concatenate to the finished call's arguments exactly). An answer that is not
streamed feeds its whole text once, through the same code, so both forms agree. Trailing
whitespace of the content is held back until more content follows (it is dropped when a call
does): an output without calls is its text as is.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

import pd.worker.tools.arguments as arguments
from pd.worker.tools.segments import Begin, Body, Content, End, Segment, Segmenter

log = logging.getLogger(__name__)

# A call's text longer than this is parsed again only at fixed lengths, each an eighth past the
# one before (partial parses of the whole text at every token would cost its length squared),
# and then only up to that length: what was streamed of a call depends on its text alone, never
# on how the text came in pieces, so a continuation that primes a stream with the text sent so
# far (docs/migration.md §3) stands exactly where the client is.
_REPARSE_CHARS = 4096


def parse_point(size: int) -> int:
    """The length a call's text of `size` characters is parsed up to while it streams."""
    if size <= _REPARSE_CHARS:
        return size
    point = _REPARSE_CHARS
    while point + point // 8 <= size:
        point += point // 8
    return point


@dataclass
class _Call:
    body: list[str] = field(default_factory=list)  # its JSON text, in pieces
    size: int = 0
    parsed_at: int = -1  # `size` at the last parse
    index: int | None = None  # set when its first delta is out (the name is known)
    sent: str = ""  # the arguments streamed so far

    @property
    def text(self) -> str:
        if len(self.body) > 1:
            self.body[:] = ["".join(self.body)]
        return self.body[0] if self.body else ""


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolStream:
    """Deltas and the final message of one output in one tool-call format.

    `named`: the function tool_choice names (the whole output is its arguments, as written);
    `max_calls`: 1 when `parallel_tool_calls` is false (later calls are dropped)."""

    def __init__(
        self, segmenter: Segmenter, named: str | None = None, max_calls: int | None = None
    ) -> None:
        self.segmenter = segmenter
        self.named = named
        self.max_calls = max_calls
        self.content: list[str] = []  # what was sent as content
        self.calls: list[dict[str, Any]] = []  # {"id", "type", "function": {"name", "arguments"}}
        self._ws = ""  # trailing whitespace of the content, held back
        self._call: _Call | None = None
        self._finished = False

    # --------------------------------------------------------------------------- streaming

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas a piece of the output amounts to (none while it is held back)."""
        return self._segments(self.segmenter.feed(text))

    @property
    def finished(self) -> bool:
        return self._finished

    def finish(self) -> list[dict[str, Any]]:
        """The deltas of what was held back, once the output has ended."""
        if self._finished:
            return []
        self._finished = True
        out = self._segments(self.segmenter.finish())
        if not self.calls and self._ws:
            out.append(self._content(self._ws))
            self._ws = ""
        return out

    def _segments(self, segments: list[Segment]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for seg in segments:
            if isinstance(seg, Content):
                text = self._ws + seg.text
                body = text.rstrip()
                self._ws = text[len(body) :]
                if body and not self.calls:
                    out.append(self._content(body))
            elif isinstance(seg, Begin):
                self._ws = ""
                full = self.max_calls is not None and len(self.calls) >= self.max_calls
                self._call = None if full else _Call()  # one too many: dropped
            elif isinstance(seg, Body) and self._call is not None:
                self._call.body.append(seg.text)
                self._call.size += len(seg.text)
                self._update(self._call, False, out)
            elif isinstance(seg, End) and self._call is not None:
                self._update(self._call, True, out)
                self._call = None
        return _merged(out)

    def _content(self, text: str) -> dict[str, Any]:
        self.content.append(text)
        return {"content": text}

    def _update(self, call: _Call, final: bool, out: list[dict[str, Any]]) -> None:
        point = call.size if final else parse_point(call.size)
        if point == call.parsed_at and not final:
            return
        call.parsed_at = point
        text = call.text if point == call.size else call.text[:point]
        if call.index is None:
            name = self.named or arguments.name_of(text)
            if name is None:
                return  # not yet (or never: a call without a name is dropped)
            call.index = len(self.calls)
            self.calls.append({"id": new_call_id(), "type": "function", "function": {"name": name}})
            out.append(
                _call_delta(call.index, id=self.calls[-1]["id"], type="function",
                            function={"name": name, "arguments": ""})
            )  # fmt: skip
        if self.named is not None:
            target = text  # the output is the arguments, as written
        elif final:
            target = arguments.final_arguments(text)
        else:
            target = arguments.stable_arguments(text)
        if target.startswith(call.sent):
            piece = target[len(call.sent) :]
            if piece:
                call.sent = target
                out.append(_call_delta(call.index, function={"arguments": piece}))
        elif final:  # a partial parse that was not a prefix after all: never seen; say so
            log.warning("tool call %d: streamed arguments %r are no prefix of %r", call.index,
                        call.sent[:80], target[:80])  # fmt: skip
        if final or self.named is not None:
            self.calls[call.index]["function"]["arguments"] = call.sent

    # ------------------------------------------------------------------------------ answers

    def whole(self, text: str) -> list[dict[str, Any]]:
        """Every delta of a complete output (an answer that is not streamed)."""
        return self.feed(text) + self.finish()

    def message(self) -> dict[str, Any]:
        """The assistant message's fields: `content` (the text before the first call; null when
        empty and there are calls) and `tool_calls` when there are any."""
        content = "".join(self.content)
        if not self.calls:
            return {"content": content}
        for call in self.calls:  # a call cut short (finish_reason length): as far as it got
            call["function"].setdefault("arguments", "")
        return {"content": content or None, "tool_calls": self.calls}

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """`tool_calls` when the output stopped with at least one call; the engine's otherwise
        (`length` stays `length`: a call may be cut short)."""
        return "tool_calls" if self.calls and engine_reason == "stop" else engine_reason


def _call_delta(index: int, **fields: Any) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, **fields}]}


def _merged(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive content pieces as one, and consecutive argument pieces of one call."""
    out: list[dict[str, Any]] = []
    for d in deltas:
        last = out[-1] if out else None
        if last is not None and "content" in d and "content" in last:
            last["content"] += d["content"]
            continue
        if last is not None and "tool_calls" in d and "tool_calls" in last:
            a, b = last["tool_calls"][0], d["tool_calls"][0]
            if a["index"] == b["index"] and set(b) == {"index", "function"} and set(a) == set(b):
                a["function"]["arguments"] += b["function"]["arguments"]
                continue
        out.append(d)
    return out
