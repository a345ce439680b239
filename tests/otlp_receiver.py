"""A tiny OTLP/HTTP trace receiver for tests: what a collector would get, as flat records.

`OtlpReceiver` serves POST /v1/traces (application/x-protobuf, gzip or not) from a thread of its
own, so in-process tracers and router/worker subprocesses reach it whatever the test is doing
(awaiting, or blocked in a sync call). Give its `url` to `--otlp-endpoint` or `setup_tracing`:

    with OtlpReceiver() as otlp:
        ... start pd-worker --otlp-endpoint otlp.url ...
        spans = await otlp.wait(lambda s: s.name == "prefill", timeout=5)

Decoding needs opentelemetry-proto (the `otel` extra brings it); it is imported at the first
POST, so this module imports without it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

KINDS = {0: "unspecified", 1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}
STATUSES = {0: "unset", 1: "ok", 2: "error"}


@dataclass(frozen=True)
class ReceivedSpan:
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str  # "" for a root span
    name: str
    kind: str  # internal, server, client, ...
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    links: list[tuple[str, str]]  # (trace_id, span_id)
    events: list[tuple[str, int, dict[str, Any]]]  # (name, time_ns, attributes)
    status: str  # unset, ok, error
    status_message: str
    resource: dict[str, Any]  # service.name, service.instance.id, pd.role, ...

    @property
    def service(self) -> str:
        return self.resource.get("service.name", "")

    @property
    def role(self) -> str:
        return self.resource.get("pd.role", "")


def _value(v: Any) -> Any:
    which = v.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, which)


def _attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


def decode_export_request(body: bytes) -> list[ReceivedSpan]:
    """The spans of one serialized ExportTraceServiceRequest."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    request = ExportTraceServiceRequest.FromString(body)
    found = []
    for rs in request.resource_spans:
        resource = _attributes(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                found.append(
                    ReceivedSpan(
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex(),
                        name=s.name,
                        kind=KINDS.get(s.kind, str(s.kind)),
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        attributes=_attributes(s.attributes),
                        links=[(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                        events=[
                            (e.name, e.time_unix_nano, _attributes(e.attributes)) for e in s.events
                        ],
                        status=STATUSES.get(s.status.code, str(s.status.code)),
                        status_message=s.status.message,
                        resource=resource,
                    )
                )
    return found


class OtlpReceiver:
    """An OTLP/HTTP collector double on 127.0.0.1 (a free port), serving from its own thread."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = 0
        self.posts = 0  # export requests received
        self.headers: list[dict[str, str]] = []  # each export request's HTTP headers
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        """The base URL to give --otlp-endpoint (spans are POSTed to URL/v1/traces)."""
        return f"http://{self.host}:{self.port}"

    @property
    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        return [s for s in self.spans if s.trace_id == trace_id]

    # ------------------------------------------------------------------------------ waiting

    def _matching(
        self, predicate: Callable[[ReceivedSpan], bool] | None, count: int
    ) -> list[ReceivedSpan] | None:
        found = [s for s in self.spans if predicate is None or predicate(s)]
        return found if len(found) >= count else None

    def _timed_out(self, count: int, timeout: float) -> AssertionError:
        names = sorted({s.name for s in self.spans})
        return AssertionError(
            f"fewer than {count} matching spans in {timeout} s; "
            f"{self.posts} posts, span names received: {names}"
        )

    async def wait(
        self,
        predicate: Callable[[ReceivedSpan], bool] | None = None,
        count: int = 1,
        timeout: float = 5.0,
    ) -> list[ReceivedSpan]:
        """The spans matching `predicate` once at least `count` have arrived (AssertionError
        after `timeout` seconds). Awaits, so an in-loop server keeps serving meanwhile."""
        deadline = time.monotonic() + timeout
        while (found := self._matching(predicate, count)) is None:
            if time.monotonic() > deadline:
                raise self._timed_out(count, timeout)
            await asyncio.sleep(0.02)
        return found

    def wait_sync(
        self,
        predicate: Callable[[ReceivedSpan], bool] | None = None,
        count: int = 1,
        timeout: float = 5.0,
    ) -> list[ReceivedSpan]:
        """`wait` for code outside an event loop."""
        deadline = time.monotonic() + timeout
        while (found := self._matching(predicate, count)) is None:
            if time.monotonic() > deadline:
                raise self._timed_out(count, timeout)
            time.sleep(0.02)
        return found

    # ------------------------------------------------------------------------------ serving

    async def _traces(self, request: web.Request) -> web.Response:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceResponse,
        )

        if request.content_type != "application/x-protobuf":
            return web.Response(status=415, text=f"not protobuf: {request.content_type}")
        body = await request.read()  # aiohttp has undone a gzip or deflate Content-Encoding
        try:
            spans = decode_export_request(body)
        except Exception as e:  # a malformed body: the exporter's bug, shown to the test
            return web.Response(status=400, text=f"{type(e).__name__}: {e}")
        with self._lock:
            self.posts += 1
            self.headers.append(dict(request.headers))
            self._spans.extend(spans)
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(),
            content_type="application/x-protobuf",
        )

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        app = web.Application()
        app.router.add_post("/v1/traces", self._traces)
        runner = web.AppRunner(app, access_log=None)
        try:
            loop.run_until_complete(runner.setup())
            loop.run_until_complete(web.TCPSite(runner, self.host, 0).start())
            self.port = runner.addresses[0][1]
        except BaseException as e:
            self._error = e
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(runner.cleanup())
            loop.close()

    def start(self) -> OtlpReceiver:
        self._thread = threading.Thread(target=self._serve, name="otlp-receiver", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise RuntimeError("the OTLP receiver did not start") from self._error
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
