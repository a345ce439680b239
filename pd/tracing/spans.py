"""The span side of pd's tracer: ids and the W3C trace context (`traceparent`), `Span` (the
no-op one, a sampled-out one that still carries its context, a recording one), what an ended
span becomes (`FinishedSpan`) and where it goes (`SpanExporter`; `InMemoryExporter` for tests).
No third-party import (pd/tracing/__init__.py says why)."""

from __future__ import annotations

import logging
import os
import random
import re
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple, Protocol

if TYPE_CHECKING:
    from types import TracebackType

log = logging.getLogger("pd.tracing")

ROLES = ("router", "prefill", "decode", "both")
# The standard variables that turn export on without --otlp-endpoint, the first the full URL.
ENDPOINT_ENV = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
EXPORT_DELAY_MS = 500  # the export thread's schedule: a span reaches the collector within ~1 s
EXPORT_WAKE_SPANS = 512  # ... or sooner, once this many are queued
MAX_QUEUED_SPANS = 4096  # ended spans waiting for export; more are dropped (and counted)
MAX_EXPORT_BATCH = 2048  # spans in one POST
EXPORT_TIMEOUT_S = 5.0  # one POST (connect, send, answer)
WARN_EVERY_S = 60.0  # export failures and drops are logged at most this often
SpanKindName = Literal["internal", "server", "client"]
AttributeValue = (
    str | bool | int | float | Sequence[str] | Sequence[bool] | Sequence[int] | Sequence[float]
)
Attributes = Mapping[str, AttributeValue]

_NO_TRACE_ID = "0" * 32
_NO_SPAN_ID = "0" * 16
_EPOCH_MINUS_MONOTONIC_NS = time.time_ns() - time.monotonic_ns()
# OTLP's SpanKind and Status.StatusCode values (opentelemetry/proto/trace/v1/trace.proto)
_KINDS: dict[str, int] = {"internal": 1, "server": 2, "client": 3, "producer": 4, "consumer": 5}
_KIND_NAMES = {v: k for k, v in _KINDS.items()}
_UNSET, _ERROR = 0, 2

_random = random.Random(os.urandom(32))  # ids: never the process-wide generator's sequence
_bits = _random.getrandbits
_LOW64 = (1 << 64) - 1
_time_ns = time.time_ns


def _new_id(bits: int) -> int:
    """A random id of `bits` bits, never 0 (W3C: all zeros is invalid)."""
    while not (n := _bits(bits)):
        pass
    return n


def epoch_ns(monotonic_s: float) -> int:
    """A `time.monotonic()` reading as epoch nanoseconds, the clock of span timestamps."""
    return int(monotonic_s * 1e9) + _EPOCH_MINUS_MONOTONIC_NS


# ------------------------------------------------------------------------------ W3C trace context

# version 00 is exactly these four fields; a later version may add more after a "-"
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")


def parse_traceparent(value: str, tracestate: str | None = None) -> Parent | None:
    """The `Parent` a W3C `traceparent` header names, or None when it is malformed (a bad
    length or digit, version ff, extra fields on version 00, an all-zero id)."""
    m = _TRACEPARENT.fullmatch(value.strip())
    if m is None:
        return None
    version, trace_hex, span_hex, flags, rest = m.groups()
    if version == "ff" or (version == "00" and rest is not None):
        return None
    trace_id, span_id = int(trace_hex, 16), int(span_hex, 16)
    if not trace_id or not span_id:
        return None
    state = tracestate.strip() if tracestate else ""
    return Parent(trace_id, span_id, bool(int(flags, 16) & 1), state or None)


def format_traceparent(trace_id: int, span_id: int, sampled: bool) -> str:
    """A version-00 W3C `traceparent` (flags 01 when sampled, else 00)."""
    return f"00-{trace_id:032x}-{span_id:016x}-{'01' if sampled else '00'}"


class Parent:
    """A span of another process, read from a W3C `traceparent`: a parent or a link target."""

    __slots__ = ("_trace_id", "_span_id", "_sampled", "_tracestate")

    def __init__(
        self, trace_id: int, span_id: int, sampled: bool = True, tracestate: str | None = None
    ) -> None:
        self._trace_id = trace_id
        self._span_id = span_id
        self._sampled = sampled
        self._tracestate = tracestate

    @property
    def trace_id_hex(self) -> str:
        return format(self._trace_id, "032x")

    @property
    def span_id_hex(self) -> str:
        return format(self._span_id, "016x")

    @property
    def sampled(self) -> bool:
        return self._sampled

    @property
    def tracestate(self) -> str | None:
        """The W3C `tracestate` that came with it (passed on to children's headers)."""
        return self._tracestate

    def __repr__(self) -> str:
        return f"Parent({self.trace_id_hex}, {self.span_id_hex}, sampled={self._sampled})"


# ------------------------------------------------------------------------------ spans


class SpanContext(NamedTuple):
    """Which span: a finished span's own, its parent's, or a link's."""

    trace_id: int
    span_id: int
    is_remote: bool = False  # read from another process's headers
    sampled: bool = True
    trace_state: str | None = None


class Event(NamedTuple):
    name: str
    timestamp: int  # epoch ns
    attributes: Mapping[str, AttributeValue]


class Link(NamedTuple):
    context: SpanContext


class Span:
    """The span of tracing that is off: every method does nothing (`NO_SPAN` is the one)."""

    __slots__ = ()
    # no trace: tracing off (the recording and the sampled-out kinds below set their own)
    _trace_id: int = 0
    _span_id: int = 0
    _sampled: bool = False
    _tracestate: str | None = None

    @property
    def recording(self) -> bool:
        """Whether attributes and events are kept (False: off, or not sampled): guard costly
        attribute values with it."""
        return False

    @property
    def trace_id_hex(self) -> str:
        return format(self._trace_id, "032x") if self._trace_id else _NO_TRACE_ID

    @property
    def span_id_hex(self) -> str:
        return format(self._span_id, "016x") if self._span_id else _NO_SPAN_ID

    def set(self, key: str, value: AttributeValue) -> None:
        pass

    def set_many(self, attributes: Attributes) -> None:
        pass

    def event(
        self, name: str, attributes: Attributes | None = None, at_ns: int | None = None
    ) -> None:
        pass

    def error(self, message: str) -> None:
        """Status ERROR, with `message`."""

    def end(self, end_ns: int | None = None) -> None:
        """End the span (now, or at `end_ns` epoch nanoseconds); a second call does nothing."""

    def __enter__(self) -> Span:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        pass


NO_SPAN = Span()


class _SampledOut(Span):
    """A span of a trace that is not sampled: records nothing, but carries its trace on (its
    headers say flags 00, so the workers drop the trace too)."""

    __slots__ = ("_trace_id", "_span_id", "_tracestate")
    _sampled = False

    def __init__(self, trace_id: int, span_id: int, tracestate: str | None) -> None:
        self._trace_id = trace_id
        self._span_id = span_id
        self._tracestate = tracestate


class _Recording(Span):
    """A sampled span: what it records is handed to its tracing's sink at `end()`."""

    __slots__ = (
        "_trace_id",
        "_span_id",
        "_tracestate",
        "_parent_id",
        "_remote",
        "_kind",
        "_name",
        "_start",
        "_end",
        "_attributes",
        "_events",
        "_links",
        "_status",
        "_message",
        "_sink",
    )
    _sampled = True

    def __init__(
        self,
        trace_id: int,
        span_id: int,
        tracestate: str | None,
        parent_id: int,
        remote: bool,
        kind: int,
        name: str,
        start_ns: int,
        attributes: dict[str, AttributeValue],
        links: list[SpanContext] | None,
        sink: _Sink,
    ) -> None:
        self._trace_id = trace_id
        self._span_id = span_id
        self._tracestate = tracestate
        self._parent_id = parent_id  # 0: a root
        self._remote = remote  # the parent came from another process
        self._kind = kind
        self._name = name
        self._start = start_ns
        self._end = 0  # 0: not ended
        self._attributes = attributes
        self._events: list[Event] | None = None
        self._links = links
        self._status = _UNSET
        self._message = ""
        self._sink = sink

    @property
    def recording(self) -> bool:
        return not self._end

    # Once ended, a span is not changed: the export thread may be encoding it.

    def set(self, key: str, value: AttributeValue) -> None:
        if not self._end:
            if type(value) is list:  # a snapshot, as the caller may go on changing the list
                value = tuple(value)
            self._attributes[key] = value

    def set_many(self, attributes: Attributes) -> None:
        if not self._end:
            self._attributes.update(attributes)

    def event(
        self, name: str, attributes: Attributes | None = None, at_ns: int | None = None
    ) -> None:
        if self._end:
            return
        e = Event(name, at_ns or _time_ns(), dict(attributes) if attributes else {})
        if self._events is None:
            self._events = [e]
        else:
            self._events.append(e)

    def error(self, message: str) -> None:
        if not self._end:
            self._status = _ERROR
            self._message = message

    def end(self, end_ns: int | None = None) -> None:
        if not self._end:
            self._end = end_ns or _time_ns()
            self._sink(self)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if isinstance(exc, Exception):
                self.event(
                    "exception",
                    {
                        "exception.type": type(exc).__name__,
                        "exception.message": str(exc),
                        "exception.stacktrace": "".join(
                            traceback.format_exception(type(exc), exc, tb)
                        ),
                    },
                )
                self.error(f"{type(exc).__name__}: {exc}")
            elif exc is not None:  # CancelledError (a client went away), GeneratorExit, ...
                self.event("cancelled", {"exception.type": type(exc).__name__})
        finally:
            self.end()

    def finished(self, resource: Mapping[str, AttributeValue]) -> FinishedSpan:
        """What it recorded, as a `FinishedSpan`."""
        return FinishedSpan(
            name=self._name,
            context=SpanContext(self._trace_id, self._span_id, False, True, self._tracestate),
            parent=(
                SpanContext(self._trace_id, self._parent_id, self._remote)
                if self._parent_id
                else None
            ),
            kind=_KIND_NAMES[self._kind],
            start_time=self._start,
            end_time=self._end,
            attributes=dict(self._attributes),
            events=tuple(self._events or ()),
            links=tuple(Link(c) for c in self._links or ()),
            status="error" if self._status == _ERROR else "unset",
            status_message=self._message,
            resource=resource,
        )


if TYPE_CHECKING:
    from collections.abc import Callable

    _Sink = Callable[[_Recording], None]


@dataclass(frozen=True)
class FinishedSpan:
    """An ended span as an `exporter` given to `setup_tracing` gets it (ids are ints)."""

    name: str
    context: SpanContext
    parent: SpanContext | None  # None: a root
    kind: str  # internal, server, client
    start_time: int  # epoch ns
    end_time: int
    attributes: dict[str, AttributeValue]
    events: tuple[Event, ...]
    links: tuple[Link, ...]
    status: Literal["unset", "error"]
    status_message: str
    resource: Mapping[str, AttributeValue]  # service.name, service.instance.id, pd.role, ...

    @property
    def trace_id_hex(self) -> str:
        return format(self.context.trace_id, "032x")

    @property
    def span_id_hex(self) -> str:
        return format(self.context.span_id, "016x")


class SpanExporter(Protocol):
    """What `setup_tracing(exporter=...)` takes: each span is handed over as it ends, in the
    thread that ends it (tests: `InMemoryExporter`)."""

    def export(self, spans: Sequence[FinishedSpan]) -> object: ...


class InMemoryExporter:
    """Keeps every finished span (tests): `setup_tracing(..., exporter=InMemoryExporter())`."""

    def __init__(self) -> None:
        self._spans: list[FinishedSpan] = []
        self._lock = threading.Lock()

    def export(self, spans: Sequence[FinishedSpan]) -> None:
        with self._lock:
            self._spans.extend(spans)

    def get_finished_spans(self) -> tuple[FinishedSpan, ...]:
        with self._lock:
            return tuple(self._spans)

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()
