"""Tracing: one trace per request across processes, exported over standard OTLP/HTTP (protobuf).

`setup_tracing(...)` returns a `Tracing`; `NO_TRACING` (tracing off) hands out one shared no-op
`Span`, so callers write the same code either way:

    with tracing.start("router.request", tracing.parent_from_headers(request.headers),
                       kind="server") as span:
        span.set("pd.request_id", rid)
        async with session.post(url, headers=tracing.headers(span)) as r: ...

A span used as a context manager ends on the way out, an exception (status ERROR, an event
"exception") and a cancellation (an event "cancelled") included. Parents and links are explicit
(a `Span`, or the `Parent` read from a W3C `traceparent` header): nothing rides on contextvars.
Spans of work timed elsewhere (the engine's steps) are made after the fact with `start_ns=` and
`end(end_ns)`, in epoch nanoseconds (`epoch_ns(time.monotonic())` converts the engine's clock).

The tracer is pd's own, standard library only (issue 45: the OpenTelemetry SDK cost the router
a quarter of its throughput): a span is a small object that `end()` appends to a bounded queue;
a daemon thread wakes every 0.5 s (or at 512 queued spans), encodes the batch with the
hand-written protobuf encoder (otlp.py) into an OTLP `ExportTraceServiceRequest` and POSTs it to
`{endpoint}/v1/traces`. Sampling is OpenTelemetry's ParentBased(TraceIdRatioBased), so a trace
is kept or dropped whole across pd and any OpenTelemetry-instrumented caller.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import socket
import ssl
import threading
import time
import urllib.parse
import uuid
from collections import deque
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from pd.tracing.otlp import _Encoder, _OtlpHttp, _version
from pd.tracing.spans import (
    _KINDS,
    _LOW64,
    ENDPOINT_ENV,
    EXPORT_DELAY_MS,
    EXPORT_WAKE_SPANS,
    MAX_EXPORT_BATCH,
    MAX_QUEUED_SPANS,
    NO_SPAN,
    ROLES,
    WARN_EVERY_S,
    Attributes,
    AttributeValue,
    Event,
    FinishedSpan,
    InMemoryExporter,
    Link,
    Parent,
    Span,
    SpanContext,
    SpanExporter,
    SpanKindName,
    _new_id,
    _Recording,
    _SampledOut,
    _time_ns,
    epoch_ns,
    format_traceparent,
    parse_traceparent,
)

if TYPE_CHECKING:
    from pd.tracing.spans import _Sink

__all__ = [
    "NO_SPAN",
    "NO_TRACING",
    "OTEL_EXTRA_HINT",
    "OTLP_ENDPOINT_HELP",
    "OTLP_SAMPLE_RATIO_HELP",
    "ROLES",
    "Attributes",
    "AttributeValue",
    "Event",
    "FinishedSpan",
    "InMemoryExporter",
    "Link",
    "Parent",
    "Span",
    "SpanContext",
    "SpanExporter",
    "SpanKindName",
    "Tracing",
    "epoch_ns",
    "format_traceparent",
    "otel_available",
    "otlp_flags_error",
    "parse_traceparent",
    "setup_tracing",
]

log = logging.getLogger("pd.tracing")

# The `otel` extra no longer serves tracing (which needs no extra package): it brings
# opentelemetry-proto, with which the tests (tests/otlp_receiver.py) decode what pd sends.
OTEL_EXTRA_HINT = "pip install 'pd[otel]'"
OTLP_ENDPOINT_HELP = (
    "OpenTelemetry: send traces over OTLP/HTTP to this collector, e.g. http://localhost:4318 "
    "(spans go to URL/v1/traces); off by default, and OTEL_EXPORTER_OTLP_ENDPOINT or "
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT turn it on too (docs/tracing.md)"
)
OTLP_SAMPLE_RATIO_HELP = (
    "the share of new traces recorded, in [0, 1]; a request that arrives with a "
    "W3C traceparent follows its caller's decision"
)


def otel_available() -> bool:
    """Whether the `otel` extra (opentelemetry-proto, which decodes OTLP: the tests' receiver)
    is installed. Tracing itself needs no extra."""
    try:
        return importlib.util.find_spec("opentelemetry.proto") is not None
    except ImportError:  # a parent package is missing (or blocked in sys.modules)
        return False


def otlp_flags_error(endpoint: str | None, sample_ratio: float) -> str:
    """Why --otlp-endpoint / --otlp-sample-ratio are refused, or ""."""
    if not 0.0 <= sample_ratio <= 1.0:
        return "--otlp-sample-ratio must be in [0, 1]"
    if endpoint is not None and not endpoint.startswith(("http://", "https://")):
        return f"--otlp-endpoint {endpoint!r} must be an http:// or https:// URL"
    return ""


# ------------------------------------------------------------------------------ tracing


class Tracing:
    """Tracing that is off: `start` returns `NO_SPAN`, nothing is read from or written to
    headers (`NO_TRACING` is the one). `setup_tracing` returns the recording kind."""

    enabled: bool = False

    @property
    def dropped(self) -> int:
        """Spans lost: the export queue was full, or a POST failed."""
        return 0

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


class _Tracing(Tracing):
    """Tracing that is on: sampled spans go to `sink` as they end."""

    enabled = True

    def __init__(self, sample_ratio: float) -> None:
        # TraceIdRatioBased: a new trace is kept when its id's lower 64 bits are below this
        self._bound = round(sample_ratio * (1 << 64))
        self._sink: _Sink = self._discard

    def _discard(self, span: _Recording) -> None:
        pass

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
        if parent is not None and parent._trace_id:  # ParentBased: the parent's decision
            trace_id = parent._trace_id
            if not parent._sampled:
                return _SampledOut(trace_id, _new_id(64), parent._tracestate)
            parent_id = parent._span_id
            tracestate = parent._tracestate
            remote = type(parent) is Parent
        else:
            trace_id = _new_id(128)
            if (trace_id & _LOW64) >= self._bound:
                return _SampledOut(trace_id, _new_id(64), None)
            parent_id = 0
            tracestate = None
            remote = False
        linked = None
        if links:  # NO_SPAN (tracing off, or a span that never was) names nothing to link to
            linked = [
                SpanContext(t._trace_id, t._span_id, type(t) is Parent, t._sampled, t._tracestate)
                for t in links
                if t._trace_id
            ] or None
        return _Recording(
            trace_id,
            _new_id(64),
            tracestate,
            parent_id,
            remote,
            _KINDS[kind],
            name,
            start_ns or _time_ns(),
            dict(attributes) if attributes else {},
            linked,
            self._sink,
        )

    def parent_from_headers(self, headers: Mapping[str, str]) -> Parent | None:
        value = headers.get("traceparent")
        if value is None:
            return None
        return parse_traceparent(value, headers.get("tracestate"))

    def headers(self, span: Span) -> dict[str, str]:
        trace_id = span._trace_id
        if not trace_id:
            return {}
        found = {"traceparent": format_traceparent(trace_id, span._span_id, span._sampled)}
        if span._tracestate:
            found["tracestate"] = span._tracestate
        return found


class _HandedOver(_Tracing):
    """Each span handed to an exporter as it ends (tests: `InMemoryExporter`)."""

    def __init__(
        self, sample_ratio: float, exporter: SpanExporter, resource: dict[str, AttributeValue]
    ) -> None:
        super().__init__(sample_ratio)
        self._exporter = exporter
        self._resource = resource
        self._sink = self._hand_over

    def _hand_over(self, span: _Recording) -> None:
        self._exporter.export([span.finished(self._resource)])

    def shutdown(self, timeout_s: float = 5.0) -> None:
        stop = getattr(self._exporter, "shutdown", None)
        if callable(stop):
            stop()


class _Exported(_Tracing):
    """Spans queued as they end; a daemon thread POSTs them in batches over OTLP/HTTP."""

    def __init__(self, sample_ratio: float, encoder: _Encoder, post: _OtlpHttp) -> None:
        super().__init__(sample_ratio)
        self._encoder = encoder
        self._post = post
        # deque.append and popleft are atomic under the GIL: ending a span takes no lock
        self._queue: deque[_Recording] = deque()
        self._wake = threading.Event()
        self._closing = False
        self._full = 0  # spans dropped as the queue was full (counted by the threads ending them)
        self._failed = 0  # spans lost as their POST failed (counted by the export thread)
        self._told = 0  # the losses logged so far
        self._last_warning = -WARN_EVERY_S
        self._sink = self._enqueue
        self._thread = threading.Thread(target=self._run, name="pd-tracing-export", daemon=True)
        self._thread.start()

    @property
    def dropped(self) -> int:
        return self._full + self._failed

    def _enqueue(self, span: _Recording) -> None:
        queue = self._queue
        if len(queue) < MAX_QUEUED_SPANS and not self._closing:
            queue.append(span)
            if len(queue) >= EXPORT_WAKE_SPANS and not self._wake.is_set():
                self._wake.set()
        else:
            self._full += 1

    def _run(self) -> None:
        delay = EXPORT_DELAY_MS / 1000
        while True:
            self._wake.wait(delay)
            self._wake.clear()
            closing = self._closing
            try:
                self._export_queued()
            except Exception:  # a bug: said, and the thread goes on
                log.exception("tracing: the export thread failed")
            if closing:
                self._post.close()
                return

    def _export_queued(self) -> None:
        queue, error = self._queue, None
        while queue:
            batch = [queue.popleft() for _ in range(min(len(queue), MAX_EXPORT_BATCH))]
            body, bad = self._encoder.request(batch)
            self._failed += bad
            try:
                self._post.send(body)
            except Exception as e:  # the collector is down, or refused: these spans are lost
                self._failed += len(batch) - bad
                error = e
        lost = self.dropped
        now = time.monotonic()
        if lost > self._told and now - self._last_warning >= WARN_EVERY_S:
            self._told, self._last_warning = lost, now
            log.warning(
                "tracing: %d spans lost so far (%d: the queue of %d was full; %d: the export "
                "to %s failed%s)",
                lost,
                self._full,
                MAX_QUEUED_SPANS,
                self._failed,
                self._post.url,
                f", last: {type(error).__name__}: {error}" if error is not None else "",
            )

    def shutdown(self, timeout_s: float = 5.0) -> None:
        if not self._closing:
            self._closing = True
            self._wake.set()
            self._thread.join(timeout_s)


# ------------------------------------------------------------------------------ set-up


@functools.cache
def _instance_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of a collector's base URL (kept as it is if it names the path)."""
    base = endpoint.rstrip("/")
    return base if base.endswith("/v1/traces") else base + "/v1/traces"


def _env(name: str) -> str | None:
    """OTEL_EXPORTER_OTLP_TRACES_<name>, else OTEL_EXPORTER_OTLP_<name> (unset or empty: None)."""
    return (
        os.environ.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}")
        or os.environ.get(f"OTEL_EXPORTER_OTLP_{name}")
        or None
    )


def _key_values(text: str, what: str) -> dict[str, str]:
    """`k1=v1,k2=v2` (values URL-encoded), as OTEL_EXPORTER_OTLP_HEADERS and
    OTEL_RESOURCE_ATTRIBUTES say them; a malformed entry is skipped with a warning."""
    found: dict[str, str] = {}
    for item in text.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            log.warning("tracing: %s: %r is not key=value, ignored", what, item)
            continue
        found[urllib.parse.unquote(key)] = urllib.parse.unquote(value.strip())
    return found


def _tls_context() -> ssl.SSLContext | None:
    cafile = _env("CERTIFICATE")
    cert, key = _env("CLIENT_CERTIFICATE"), _env("CLIENT_KEY")
    if cafile is None and cert is None:
        return None
    context = ssl.create_default_context(cafile=cafile)
    if cert is not None:
        context.load_cert_chain(cert, key)
    return context


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
    URL), an OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT variable or `exporter` (tests: an
    `InMemoryExporter`, each span handed to it as it ends) asks for export.

    The resource says `service.name` (pd-router, pd-worker), `service.instance.id` (given, or
    host:pid:random) and `pd.role` (router, prefill, decode, both); OTEL_RESOURCE_ATTRIBUTES
    adds more (pd's win). New traces are kept with probability `sample_ratio`; a span with a
    parent follows the parent's decision. OTEL_EXPORTER_OTLP_[TRACES_]HEADERS, _COMPRESSION
    (gzip), _CERTIFICATE, _CLIENT_CERTIFICATE and _CLIENT_KEY are read as the spec says, and
    OTEL_SDK_DISABLED=true turns tracing off.
    """
    if not 0.0 <= sample_ratio <= 1.0:
        raise ValueError(f"sample ratio {sample_ratio} must be in [0, 1]")
    if role not in ROLES:
        raise ValueError(f"role {role!r} must be one of {', '.join(ROLES)}")
    if exporter is None and os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        log.info("tracing: off, OTEL_SDK_DISABLED=true")
        return NO_TRACING
    if endpoint is None and exporter is None:
        from_env = os.environ.get(ENDPOINT_ENV[0]) or None
        if from_env is None and (base := os.environ.get(ENDPOINT_ENV[1])):
            from_env = _traces_url(base)
        if from_env is None:
            return NO_TRACING
        url = from_env
    else:
        url = _traces_url(endpoint) if endpoint else ""

    resource: dict[str, AttributeValue] = {
        **_key_values(os.environ.get("OTEL_RESOURCE_ATTRIBUTES", ""), "OTEL_RESOURCE_ATTRIBUTES"),
        "telemetry.sdk.language": "python",
        "telemetry.sdk.name": "pd",
        "telemetry.sdk.version": _version(),
        "service.name": service_name,
        "service.instance.id": instance_id or _instance_id(),
        "pd.role": role,
    }
    if exporter is not None:
        return _HandedOver(sample_ratio, exporter, resource)
    compression = _env("COMPRESSION")
    if compression not in (None, "none", "gzip"):
        log.warning("tracing: OTLP compression %r is not supported: none", compression)
    try:
        post = _OtlpHttp(
            url,
            _key_values(_env("HEADERS") or "", "OTEL_EXPORTER_OTLP_HEADERS"),
            "gzip" if compression == "gzip" else None,
            _tls_context(),
        )
    except (ValueError, OSError) as e:  # a bad URL or certificate
        if endpoint is not None:
            raise ValueError(f"tracing: {e}") from e
        log.warning("tracing: off, the OTEL_EXPORTER_OTLP_* settings do not work: %s", e)
        return NO_TRACING
    log.info("tracing: exporting to %s (sample ratio %g)", url, sample_ratio)
    return _Exported(sample_ratio, _Encoder(resource, "pd", _version()), post)
