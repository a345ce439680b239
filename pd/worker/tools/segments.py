"""Where the tool calls are in a model's output, as it streams: one segmenter per format.

A segmenter is fed the output's text piece by piece and says what each piece is: `Content` (text
before the first call, shown as the message's content), `Begin` (a call starts), `Body` (a piece
of the call's JSON, `{"name": ..., "arguments" | "parameters": {...}}`) and `End`. Text that may be
the start of a call's marker is held back until it is decided; text after the first call that is
no call is dropped (OpenAI's messages carry content before the calls only). `finish()` flushes
what is held and ends an open call.

Formats (vLLM's parser names): `hermes` (Hermes, Qwen2.5: `<tool_call>{...}</tool_call>`, any
number), `llama3_json` (Llama 3.x: the output is `{...}` or `<|python_tag|>{...}`, several
separated by `;`), `mistral` (`[TOOL_CALLS] [{...}, ...]`) and `array` (the output of `tool_choice`
required: a JSON array of calls, nothing else).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class Begin:
    pass


@dataclass(frozen=True)
class Body:
    text: str


@dataclass(frozen=True)
class End:
    pass


Segment = Content | Begin | Body | End


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class JsonEnd:
    """Finds where a JSON object or array written piece by piece ends: bracket depth outside
    strings (the text is the model's, not yet checked: a parser decides if it is JSON)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def feed(self, text: str) -> int:
        """The index in `text` just past the value's end, or -1 when it goes on."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return i + 1
        return -1

    def strings(self, text: str) -> None:
        """Only follow whether `text` leaves it inside a string (brackets not counted)."""
        for ch in text:
            if self.escaped:
                self.escaped = False
            elif self.in_string and ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = not self.in_string


class Segmenter(ABC):
    @abstractmethod
    def feed(self, text: str) -> list[Segment]: ...

    @abstractmethod
    def finish(self) -> list[Segment]: ...


class TaggedSegmenter(Segmenter):
    """Calls between a start and an end tag (Hermes: `<tool_call>` ... `</tool_call>`). An end
    tag inside a JSON string of the call is the call's text, not its end."""

    def __init__(self, start: str = "<tool_call>", end: str = "</tool_call>") -> None:
        self.start, self.end = start, end
        self.held = ""
        self.inside = False
        self.called = False  # a call has begun: text outside calls is dropped from now on
        self.json = JsonEnd()  # where the call's text is (in a string or not)

    def feed(self, text: str) -> list[Segment]:
        out: list[Segment] = []
        text = self.held + text
        while True:
            tag = self.end if self.inside else self.start
            at = text.find(tag)
            if at < 0:
                keep = held_back(text, tag)
                self._text(text[: len(text) - keep], out)
                self.held = text[len(text) - keep :]
                return out
            if self.inside:
                self.json.strings(text[:at])
                if self.json.in_string:  # the tag is text of the call
                    self.json.strings(tag)
                    self._text(text[: at + len(tag)], out, tracked=True)
                    text = text[at + len(tag) :]
                    continue
            self._text(text[:at], out, tracked=True)
            out.append(End() if self.inside else Begin())
            self.called = True
            self.inside = not self.inside
            self.json = JsonEnd()
            text = text[at + len(tag) :]

    def _text(self, text: str, out: list[Segment], tracked: bool = False) -> None:
        if text and self.inside:
            if not tracked:
                self.json.strings(text)
            out.append(Body(text))
        elif text and not self.called:
            out.append(Content(text))

    def finish(self) -> list[Segment]:
        out: list[Segment] = []
        self._text(self.held, out)
        self.held = ""
        if self.inside:
            self.inside = False
            out.append(End())
        return out


class JsonCallsSegmenter(Segmenter):
    """Calls written as bare JSON objects after an optional marker: Llama 3's (`{...}` at the
    start of the output or after `<|python_tag|>`, separated by `;`), Mistral's (`[TOOL_CALLS]`
    then an array of them) and tool_choice required's (an array, from the first character).

    `marker`: what starts the calls in the middle of the text (None: only at the start);
    `bare_start`: whether an output starting with `{` or `[` is calls without the marker."""

    def __init__(self, marker: str | None, bare_start: bool, separators: str) -> None:
        self.marker = marker
        self.bare_start = bare_start
        self.separators = separators  # skipped between calls, with whitespace
        self.state = "start" if bare_start else "content"  # -> "content" | "calls" | "done"
        self.held = ""
        self.call: JsonEnd | None = None  # the call being written
        self.depth = 0  # 1 inside the array the calls are elements of

    def feed(self, text: str) -> list[Segment]:
        out: list[Segment] = []
        text = self.held + text
        self.held = ""
        if self.state == "start":
            stripped = text.lstrip()
            if self.marker and stripped.startswith(self.marker):
                self.state, text = "calls", stripped[len(self.marker) :]
            elif not stripped or (self.marker and self.marker.startswith(stripped)):
                self.held = text  # undecided
                return out
            elif stripped[0] in "{[":
                self.state, text = "calls", stripped
            else:
                self.state = "content"
        if self.state == "content":
            at = text.find(self.marker) if self.marker else -1
            if at < 0:
                keep = held_back(text, self.marker) if self.marker else 0
                if text[: len(text) - keep]:
                    out.append(Content(text[: len(text) - keep]))
                self.held = text[len(text) - keep :]
                return out
            if text[:at]:
                out.append(Content(text[:at]))
            self.state, text = "calls", text[at + len(self.marker or "") :]
        if self.state == "calls":
            self._calls(text, out)
        return out

    def _calls(self, text: str, out: list[Segment]) -> None:
        i = 0
        while i < len(text):
            if self.call is not None:
                end = self.call.feed(text[i:])
                if end < 0:
                    out.append(Body(text[i:]))
                    return
                out.append(Body(text[i : i + end]))
                out.append(End())
                self.call = None
                i += end
                continue
            ch = text[i]
            if ch == "{":
                self.call = JsonEnd()
                out.append(Begin())
                continue  # the brace is the body's first character
            if ch == "[" and self.depth == 0:
                self.depth = 1
            elif ch == "]" or not (ch.isspace() or ch in self.separators):
                self.state = "done"  # the array closed, or what follows is no call
                return
            i += 1

    def finish(self) -> list[Segment]:
        out: list[Segment] = []
        if self.held and self.state in ("start", "content"):
            out.append(Content(self.held))
        self.held = ""
        if self.call is not None:
            self.call = None
            out.append(End())
        return out


class NamedSegmenter(Segmenter):
    """tool_choice names a function: the whole output is that call's arguments."""

    def __init__(self) -> None:
        self.begun = False

    def feed(self, text: str) -> list[Segment]:
        out: list[Segment] = []
        if not self.begun:
            self.begun = True
            out.append(Begin())
        if text:
            out.append(Body(text))
        return out

    def finish(self) -> list[Segment]:
        return [*self.feed(""), End()]


def segmenter(family: str) -> Segmenter:
    """A fresh segmenter for one output in `family`'s format."""
    if family == "hermes":
        return TaggedSegmenter()
    if family == "llama3_json":
        return JsonCallsSegmenter("<|python_tag|>", bare_start=True, separators=";")
    if family == "mistral":
        return JsonCallsSegmenter("[TOOL_CALLS]", bare_start=False, separators=",")
    if family == "array":
        return JsonCallsSegmenter(None, bare_start=True, separators=",")
    if family == "named":
        return NamedSegmenter()
    raise ValueError(f"unknown tool-call format {family!r}")
