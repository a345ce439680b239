"""OpenTelemetry tracing, optional (the `otel` extra): one trace per request across processes.

`setup_tracing(...)` returns a `Tracing`; `NO_TRACING` (tracing off) hands out one shared no-op
`Span`, so callers write the same code either way:

    with tracing.start("router.request", tracing.parent_from_headers(request.headers),
                       kind="server") as span:
        span.set("pd.request_id", rid)
        async with session.post(url, headers=tracing.headers(span)) as r: ...

A span used as a context manager ends on the way out, an exception (status ERROR) and a
cancellation (an event "cancelled") included. Parents and links are explicit (a `Span`, or the
`Parent` read from a W3C `traceparent` header): nothing rides on contextvars. Spans of work
timed elsewhere (the engine's steps) are made after the fact with `start_ns=` and `end(end_ns)`,
in epoch nanoseconds (`epoch_ns(time.monotonic())` converts the engine's clock).

opentelemetry is imported only by `setup_tracing` when export is asked for: this module imports
without it. Each `setup_tracing` builds its own TracerProvider (never the global one), so tests
run several in one process.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from types import TracebackType

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span as OtelSpan
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger("pd.tracing")

OTEL_EXTRA_HINT = "pip install 'pd[otel]'"
ROLES = ("router", "prefill", "decode", "both")
# The standard variables that turn export on without --otlp-endpoint (the exporter reads them).
ENDPOINT_ENV = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
EXPORT_DELAY_MS = 500  # the batch processor's schedule: a span reaches the collector within ~1 s
OTLP_ENDPOINT_HELP = (
    "OpenTelemetry: send traces over OTLP/HTTP to this collector, e.g. http://localhost:4318 "
    "(spans go to URL/v1/traces); off by default, and OTEL_EXPORTER_OTLP_ENDPOINT or "
    f"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT turn it on too; needs {OTEL_EXTRA_HINT} (docs/tracing.md)"
)
OTLP_SAMPLE_RATIO_HELP = (
    "the share of new traces recorded, in [0, 1]; a request that arrives with a sampled "
    "W3C traceparent is always recorded"
)

SpanKindName = Literal["internal", "server", "client"]
AttributeValue = (
    str | bool | int | float | Sequence[str] | Sequence[bool] | Sequence[int] | Sequence[float]
)
Attributes = Mapping[str, AttributeValue]

_NO_TRACE_ID = "0" * 32
_NO_SPAN_ID = "0" * 16
_EPOCH_MINUS_MONOTONIC_NS = time.time_ns() - time.monotonic_ns()


def epoch_ns(monotonic_s: float) -> int:
    """A `time.monotonic()` reading as epoch nanoseconds, the clock of span timestamps."""
    return int(monotonic_s * 1e9) + _EPOCH_MINUS_MONOTONIC_NS


def otel_available() -> bool:
    """Whether the `otel` extra (the OpenTelemetry SDK and its OTLP/HTTP exporter) is installed."""
    try:
        return all(
            importlib.util.find_spec(name) is not None
            for name in ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http")
        )
    except ImportError:  # a parent package is missing (or blocked in sys.modules)
        return False


def otlp_flags_error(endpoint: str | None, sample_ratio: float) -> str:
    """Why --otlp-endpoint / --otlp-sample-ratio are refused, or ""."""
    if not 0.0 <= sample_ratio <= 1.0:
        return "--otlp-sample-ratio must be in [0, 1]"
    if endpoint is None:
        return ""
    if not endpoint.startswith(("http://", "https://")):
        return f"--otlp-endpoint {endpoint!r} must be an http:// or https:// URL"
    if not otel_available():
        return f"--otlp-endpoint needs the OpenTelemetry packages: {OTEL_EXTRA_HINT}"
    return ""


class Parent:
    """A span of another process, read from a W3C `traceparent`: a parent or a link target."""

    __slots__ = ("_otel_span",)

    def __init__(self, otel_span: OtelSpan) -> None:
        self._otel_span = otel_span  # a NonRecordingSpan holding the remote SpanContext

    @property
    def trace_id_hex(self) -> str:
        return format(self._otel_span.get_span_context().trace_id, "032x")

    @property
    def span_id_hex(self) -> str:
        return format(self._otel_span.get_span_context().span_id, "016x")

    @property
    def sampled(self) -> bool:
        return self._otel_span.get_span_context().trace_flags.sampled


class Span:
    """The span of tracing that is off: every method does nothing (`NO_SPAN` is the one)."""

    __slots__ = ()

    @property
    def recording(self) -> bool:
        """Whether attributes and events are kept (False: off, or not sampled): guard costly
        attribute values with it."""
        return False

    @property
    def trace_id_hex(self) -> str:
        return _NO_TRACE_ID

    @property
    def span_id_hex(self) -> str:
        return _NO_SPAN_ID

    @property
    def _otel_span(self) -> OtelSpan | None:
        return None

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


class Tracing:
    """Tracing that is off: `start` returns `NO_SPAN`, nothing is read from or written to
    headers (`NO_TRACING` is the one). `setup_tracing` returns the recording kind."""

    enabled: bool = False

    def start(
        self,
        name: str,
        parent: Span | Parent | None = None,
        *,
        start_ns: int | None = None,
        attributes: Attributes | None = None,
        links: Iterable[Span | Parent] = (),
        kind: SpanKindName = "internal",
    ) -> Span:
        """A new span, child of `parent` (None: a new trace), linked to `links` (a migrated
        stream's leg to the leg it continues), started now or at `start_ns` (epoch ns)."""
        return NO_SPAN

    def parent_from_headers(self, headers: Mapping[str, str]) -> Parent | None:
        """The W3C `traceparent` (and `tracestate`) of an incoming request, if valid. Give a
        case-insensitive mapping (aiohttp's `request.headers`) or lowercase keys."""
        return None

    def headers(self, span: Span) -> dict[str, str]:
        """`traceparent` (and `tracestate`) naming `span`, for an outgoing request."""
        return {}

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Export what is queued and stop; blocks up to `timeout_s` (a collector that is down
        is given up on then: the export goes on in a daemon thread)."""


NO_TRACING = Tracing()


class _OtelSpan(Span):
    __slots__ = ("_span", "_ended")

    def __init__(self, span: OtelSpan) -> None:
        self._span = span
        self._ended = False

    @property
    def recording(self) -> bool:
        return self._span.is_recording()

    @property
    def trace_id_hex(self) -> str:
        return format(self._span.get_span_context().trace_id, "032x")

    @property
    def span_id_hex(self) -> str:
        return format(self._span.get_span_context().span_id, "016x")

    @property
    def _otel_span(self) -> OtelSpan | None:
        return self._span

    def set(self, key: str, value: AttributeValue) -> None:
        self._span.set_attribute(key, value)

    def set_many(self, attributes: Attributes) -> None:
        self._span.set_attributes(attributes)

    def event(
        self, name: str, attributes: Attributes | None = None, at_ns: int | None = None
    ) -> None:
        self._span.add_event(name, attributes, at_ns)

    def error(self, message: str) -> None:
        # the extra is installed: this span came from it
        from opentelemetry.trace import StatusCode

        self._span.set_status(StatusCode.ERROR, message)

    def end(self, end_ns: int | None = None) -> None:
        if not self._ended:
            self._ended = True
            self._span.end(end_ns)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if isinstance(exc, Exception):
                self._span.record_exception(exc)
                self.error(f"{type(exc).__name__}: {exc}")
            elif exc is not None:  # CancelledError (a client went away), GeneratorExit, ...
                self._span.add_event("cancelled", {"exception.type": type(exc).__name__})
        finally:
            self.end()


class _OtelTracing(Tracing):
    enabled = True

    def __init__(self, provider: TracerProvider) -> None:
        # the extra is installed: setup_tracing checked
        from opentelemetry import trace
        from opentelemetry.context import Context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._provider = provider
        self._tracer = provider.get_tracer("pd")
        self._propagator: TraceContextTextMapPropagator = TraceContextTextMapPropagator()
        self._in_context = trace.set_span_in_context
        self._root = Context()  # no parent: a new trace, whatever a contextvar holds
        self._current = trace.get_current_span
        self._link = trace.Link
        self._kinds = {
            "internal": trace.SpanKind.INTERNAL,
            "server": trace.SpanKind.SERVER,
            "client": trace.SpanKind.CLIENT,
        }
        self._closed = False

    def start(
        self,
        name: str,
        parent: Span | Parent | None = None,
        *,
        start_ns: int | None = None,
        attributes: Attributes | None = None,
        links: Iterable[Span | Parent] = (),
        kind: SpanKindName = "internal",
    ) -> Span:
        above = parent._otel_span if parent is not None else None
        span = self._tracer.start_span(
            name,
            context=self._in_context(above) if above is not None else self._root,
            kind=self._kinds[kind],
            attributes=attributes,
            links=[
                self._link(s.get_span_context())
                for s in (link._otel_span for link in links)
                if s is not None
            ],
            start_time=start_ns,
            record_exception=False,
            set_status_on_exception=False,
        )
        return _OtelSpan(span)

    def parent_from_headers(self, headers: Mapping[str, str]) -> Parent | None:
        traceparent = headers.get("traceparent")
        if traceparent is None:
            return None
        carrier = {"traceparent": traceparent}
        if tracestate := headers.get("tracestate"):
            carrier["tracestate"] = tracestate
        remote = self._current(self._propagator.extract(carrier))
        return Parent(remote) if remote.get_span_context().is_valid else None

    def headers(self, span: Span) -> dict[str, str]:
        otel_span = span._otel_span
        carrier: dict[str, str] = {}
        if otel_span is not None:
            self._propagator.inject(carrier, self._in_context(otel_span))
        return carrier

    def shutdown(self, timeout_s: float = 5.0) -> None:
        if not self._closed:
            self._closed = True
            # the exporter retries a collector that is down for up to its own timeout (10 s)
            done = threading.Thread(target=self._provider.shutdown, daemon=True)
            done.start()
            done.join(timeout_s)


def _instance_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of a collector's base URL (kept as it is if it names the path)."""
    base = endpoint.rstrip("/")
    return base if base.endswith("/v1/traces") else base + "/v1/traces"


def setup_tracing(
    service_name: str,
    role: str,
    endpoint: str | None,
    sample_ratio: float,
    instance_id: str | None = None,
    *,
    exporter: SpanExporter | None = None,
) -> Tracing:
    """Tracing for one process: `NO_TRACING` unless `endpoint` (a collector's OTLP/HTTP base
    URL), an OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT variable or `exporter` (tests: spans handed
    to it as each ends) asks for export.

    The resource says `service.name` (pd-router, pd-worker), `service.instance.id` (given, or
    host:pid:random) and `pd.role` (router, prefill, decode, both); OTEL_RESOURCE_ATTRIBUTES
    adds more (pd's three win). New traces are kept with probability `sample_ratio`; a span
    with a parent follows the parent's decision. A ValueError when export is asked for by
    `endpoint` without the `otel` extra; asked by a variable alone, a warning and no tracing.
    """
    if not 0.0 <= sample_ratio <= 1.0:
        raise ValueError(f"sample ratio {sample_ratio} must be in [0, 1]")
    if role not in ROLES:
        raise ValueError(f"role {role!r} must be one of {', '.join(ROLES)}")
    from_env = next((name for name in ENDPOINT_ENV if os.environ.get(name)), None)
    if endpoint is None and exporter is None and from_env is None:
        return NO_TRACING
    if not otel_available():
        if endpoint is None and exporter is None:
            log.warning("%s is set but tracing is off: %s", from_env, OTEL_EXTRA_HINT)
            return NO_TRACING
        raise ValueError(f"exporting traces needs the OpenTelemetry packages: {OTEL_EXTRA_HINT}")

    # the extra is installed: imported only here, when tracing is on
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    resource = Resource.create(
        {
            "service.name": service_name,
            "service.instance.id": instance_id or _instance_id(),
            "pd.role": role,
        }
    )
    provider = TracerProvider(
        sampler=ParentBased(TraceIdRatioBased(sample_ratio)), resource=resource
    )
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        # None: the exporter reads OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT itself
        otlp = OTLPSpanExporter(endpoint=_traces_url(endpoint) if endpoint else None)
        provider.add_span_processor(BatchSpanProcessor(otlp, schedule_delay_millis=EXPORT_DELAY_MS))
        where = _traces_url(endpoint) if endpoint else f"${from_env}"
        log.info("tracing: exporting to %s (sample ratio %g)", where, sample_ratio)
    return _OtelTracing(provider)
