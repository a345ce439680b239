"""pd.tracing: spans, W3C propagation, sampling and export (the `otel` extra), and tracing off."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
from typing import Any

import pytest
from multidict import CIMultiDict

from pd import tracing as tracing_module
from pd.config import WorkerConfig
from pd.router import RouterConfig
from pd.router.main import parse_config
from pd.tracing import (
    NO_SPAN,
    NO_TRACING,
    OTEL_EXTRA_HINT,
    Parent,
    Span,
    Tracing,
    epoch_ns,
    otel_available,
    setup_tracing,
)
from tests.otlp_receiver import OtlpReceiver

NEEDS_OTEL = "needs the otel extra: pip install 'pd[otel]'"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN_ID = "00f067aa0ba902b7"


def traceparent(sampled: bool = True) -> str:
    return f"00-{TRACE_ID}-{SPAN_ID}-{'01' if sampled else '00'}"


@pytest.fixture
def no_otel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in tracing_module.ENDPOINT_ENV:
        monkeypatch.delenv(name, raising=False)


class Memory:
    """A Tracing whose spans land in an InMemorySpanExporter."""

    def __init__(
        self, service: str = "pd-router", role: str = "router", ratio: float = 1.0
    ) -> None:
        pytest.importorskip("opentelemetry.sdk", reason=NEEDS_OTEL)
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        self.exporter = InMemorySpanExporter()
        self.tracing = setup_tracing(
            service, role, None, ratio, f"{role}-1", exporter=self.exporter
        )

    def spans(self) -> list[Any]:
        return list(self.exporter.get_finished_spans())

    def one(self, name: str) -> Any:
        found = [s for s in self.spans() if s.name == name]
        assert len(found) == 1, [s.name for s in self.spans()]
        return found[0]


def hex_ids(otel_span: Any) -> tuple[str, str]:
    ctx = otel_span.context
    return format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")


# ------------------------------------------------------------------------------ tracing off


def test_no_tracing_hands_out_one_no_op_span_and_no_headers():
    t = NO_TRACING
    assert not t.enabled and type(t) is Tracing
    span = t.start("x", kind="server", attributes={"a": 1}, links=[NO_SPAN], start_ns=5)
    assert span is NO_SPAN and t.start("y", span) is NO_SPAN
    with t.start("z") as inside:
        assert inside is NO_SPAN
        inside.set("k", 1)
        inside.set_many({"k": 2})
        inside.event("e", {"k": 3}, at_ns=7)
        inside.error("bad")
    span.end()
    span.end(10)
    assert not span.recording
    assert isinstance(span, Span) and span.trace_id_hex == "0" * 32 and span.span_id_hex == "0" * 16
    assert t.headers(span) == {}
    assert t.parent_from_headers({"traceparent": traceparent()}) is None
    t.shutdown()


def test_no_tracing_costs_next_to_nothing():
    start = NO_TRACING.start
    t0 = time.perf_counter()
    for _ in range(100_000):
        with start("request", kind="server") as span:
            span.set("pd.tokens", 3)
    per_call = (time.perf_counter() - t0) / 100_000
    assert per_call < 5e-6, f"{per_call * 1e9:.0f} ns a span with tracing off"


def test_off_unless_an_endpoint_or_a_variable_asks(no_otel_env):
    assert setup_tracing("pd-router", "router", None, 1.0) is NO_TRACING
    with pytest.raises(ValueError, match="sample ratio"):
        setup_tracing("pd-router", "router", None, 1.5)
    with pytest.raises(ValueError, match="role"):
        setup_tracing("pd-worker", "primary", None, 1.0)


def test_epoch_ns_converts_the_monotonic_clock():
    assert abs(epoch_ns(time.monotonic()) - time.time_ns()) < 50_000_000  # 50 ms


# ------------------------------------------------------------------------------ without the extra


def test_export_without_the_extra_is_a_clear_error(monkeypatch, no_otel_env, caplog):
    monkeypatch.setattr(tracing_module, "otel_available", lambda: False)
    with pytest.raises(ValueError, match=r"pip install 'pd\[otel\]'"):
        setup_tracing("pd-router", "router", "http://collector:4318", 1.0)
    with pytest.raises(ValueError, match=r"--otlp-endpoint needs .*pd\[otel\]"):
        RouterConfig(otlp_endpoint="http://collector:4318")
    with pytest.raises(ValueError, match=r"--otlp-endpoint needs .*pd\[otel\]"):
        WorkerConfig(otlp_endpoint="http://collector:4318")
    assert RouterConfig(otlp_sample_ratio=0.5).otlp_sample_ratio == 0.5  # no endpoint: fine
    # a variable set for other programs: a warning, and pd runs untraced
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    with caplog.at_level(logging.WARNING, logger="pd.tracing"):
        assert setup_tracing("pd-worker", "decode", None, 1.0) is NO_TRACING
    assert OTEL_EXTRA_HINT in caplog.text


def test_pd_imports_and_runs_untraced_without_opentelemetry():
    """In a fresh interpreter where `import opentelemetry` fails, as on a machine without it."""
    code = """
import sys
sys.modules["opentelemetry"] = None
from pd.tracing import NO_TRACING, otel_available, setup_tracing
from pd.router import RouterConfig
assert not otel_available()
assert setup_tracing("pd-router", "router", None, 1.0) is NO_TRACING
try:
    RouterConfig(otlp_endpoint="http://collector:4318")
except ValueError as e:
    assert "pip install 'pd[otel]'" in str(e), e
else:
    raise AssertionError("no error")
try:
    setup_tracing("pd-router", "router", "http://collector:4318", 1.0)
except ValueError as e:
    assert "pip install 'pd[otel]'" in str(e), e
else:
    raise AssertionError("no error")
assert not [m for m in sys.modules if m.startswith("opentelemetry.")]
"""
    env_free = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env_free
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"otlp_sample_ratio": 1.5}, r"--otlp-sample-ratio must be in \[0, 1\]"),
        ({"otlp_sample_ratio": -0.1}, r"--otlp-sample-ratio must be in \[0, 1\]"),
        ({"otlp_endpoint": "collector:4318"}, "http:// or https://"),
    ],
)
def test_bad_flags_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        RouterConfig(**kw)
    with pytest.raises(ValueError, match=message):
        WorkerConfig(**kw)


def test_the_flags_are_off_by_default():
    for cfg in (RouterConfig(), WorkerConfig()):
        assert cfg.otlp_endpoint is None and cfg.otlp_sample_ratio == 1.0


# ------------------------------------------------------------------------------ with the extra


def test_the_command_line_flags():
    pytest.importorskip("opentelemetry.sdk", reason=NEEDS_OTEL)
    assert otel_available()
    cfg = parse_config(["--otlp-endpoint", "http://collector:4318", "--otlp-sample-ratio", "0.25"])
    assert cfg.otlp_endpoint == "http://collector:4318" and cfg.otlp_sample_ratio == 0.25
    with pytest.raises(SystemExit):
        parse_config(["--otlp-sample-ratio", "2"])


def test_a_child_in_another_process_joins_the_trace_through_headers():
    router, worker = Memory(), Memory("pd-worker", "prefill")
    with router.tracing.start("router.request", kind="server") as request:
        with router.tracing.start("router.prefill", request, kind="client") as call:
            headers = router.tracing.headers(call)
            assert list(headers) == ["traceparent"]
            version, trace_id, span_id, flags = headers["traceparent"].split("-")
            assert (trace_id, span_id) == (call.trace_id_hex, call.span_id_hex)
            assert version == "00" and int(flags, 16) & 1  # sampled (newer SDKs add 2: random)
            # aiohttp's request.headers: case-insensitive
            parent = worker.tracing.parent_from_headers(
                CIMultiDict({"TraceParent": headers["traceparent"]})
            )
            assert isinstance(parent, Parent) and parent.sampled
            assert (parent.trace_id_hex, parent.span_id_hex) == (
                call.trace_id_hex,
                call.span_id_hex,
            )
            with worker.tracing.start("worker.prefill", parent, kind="server") as served:
                pass
    assert served.trace_id_hex == request.trace_id_hex
    root, client, server = (
        router.one("router.request"),
        router.one("router.prefill"),
        worker.one("worker.prefill"),
    )
    assert root.parent is None and client.parent.span_id == root.context.span_id
    assert server.parent.span_id == client.context.span_id and server.parent.is_remote
    assert len({s.context.trace_id for s in (root, client, server)}) == 1
    assert [s.kind.name for s in (root, client, server)] == ["SERVER", "CLIENT", "SERVER"]
    for span, (service, role) in (
        (root, ("pd-router", "router")),
        (server, ("pd-worker", "prefill")),
    ):
        attrs = span.resource.attributes
        assert (attrs["service.name"], attrs["pd.role"]) == (service, role)
        assert attrs["service.instance.id"] == f"{role}-1"


def test_no_parent_is_a_new_trace_whatever_the_current_context():
    m = Memory()
    from opentelemetry import context, trace

    outer = m.tracing.start("outer")
    token = context.attach(trace.set_span_in_context(outer._otel_span))  # an instrumentation's
    try:
        inner = m.tracing.start("inner")
    finally:
        context.detach(token)
    assert inner.trace_id_hex != outer.trace_id_hex


def test_tracestate_travels_and_bad_traceparents_are_ignored():
    t = Memory().tracing
    parent = t.parent_from_headers({"traceparent": traceparent(), "tracestate": "vendor=abc"})
    assert parent is not None and parent.trace_id_hex == TRACE_ID
    with t.start("child", parent) as child:
        assert t.headers(child)["tracestate"] == "vendor=abc"
    for bad in ({}, {"traceparent": "garbage"}, {"traceparent": f"00-{'0' * 32}-{SPAN_ID}-01"}):
        assert t.parent_from_headers(bad) is None
    assert t.headers(NO_SPAN) == {}


def test_the_default_instance_id_names_host_and_process(no_otel_env):
    pytest.importorskip("opentelemetry.sdk", reason=NEEDS_OTEL)
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    t = setup_tracing("pd-worker", "both", None, 1.0, exporter=exporter)
    t.start("x").end()
    (span,) = exporter.get_finished_spans()
    instance = span.resource.attributes["service.instance.id"]
    assert f":{os.getpid()}:" in instance
    assert span.resource.attributes["pd.role"] == "both"


def test_links_attributes_events_errors_and_explicit_times():
    m = Memory()
    t = m.tracing
    remote = t.parent_from_headers({"traceparent": traceparent()})
    assert remote is not None
    leg1 = t.start("leg", attributes={"pd.leg": 1})
    leg1.end()
    t0 = time.time_ns() - 5_000_000
    leg2 = t.start("leg2", links=[leg1, remote, NO_SPAN], start_ns=t0, attributes={"a": "x"})
    assert leg2.recording
    leg2.set("pd.tokens", 7)
    leg2.set_many({"pd.worker": "http://d1", "pd.flags": ["a", "b"]})
    leg2.event("first_token", {"pd.ttft_ms": 3.5}, at_ns=t0 + 1_000)
    leg2.error("worker died")
    leg2.end(t0 + 2_000_000)
    leg2.end()  # a second end does nothing
    span = m.one("leg2")
    assert dict(span.attributes) == {
        "a": "x",
        "pd.tokens": 7,
        "pd.worker": "http://d1",
        "pd.flags": ("a", "b"),
    }
    assert [hex_ids(link) for link in span.links] == [
        (leg1.trace_id_hex, leg1.span_id_hex),
        (TRACE_ID, SPAN_ID),
    ]
    assert (span.start_time, span.end_time) == (t0, t0 + 2_000_000)
    (event,) = span.events
    assert (event.name, event.timestamp, dict(event.attributes)) == (
        "first_token",
        t0 + 1_000,
        {"pd.ttft_ms": 3.5},
    )
    assert span.status.status_code.name == "ERROR" and span.status.description == "worker died"
    assert len(m.spans()) == 2


@pytest.mark.parametrize("ratio, kept", [(0.0, 0), (1.0, 20)])
def test_the_sample_ratio_keeps_that_share_of_new_traces(ratio, kept):
    m = Memory(ratio=ratio)
    for _ in range(20):
        with m.tracing.start("request", kind="server") as span:
            assert span.recording == bool(kept)
            # the decision travels: a sampled-out trace's headers say so
            flags = m.tracing.headers(span)["traceparent"].rsplit("-", 1)[1]
            assert int(flags, 16) & 1 == bool(kept)
    assert len(m.spans()) == kept


def test_an_incoming_traceparent_decides_sampling():
    m = Memory(ratio=0.0)
    parent = m.tracing.parent_from_headers({"traceparent": traceparent(sampled=True)})
    with m.tracing.start("sampled upstream", parent) as span:
        assert span.recording and span.trace_id_hex == TRACE_ID
    m2 = Memory(ratio=1.0)
    parent = m2.tracing.parent_from_headers({"traceparent": traceparent(sampled=False)})
    with m2.tracing.start("not sampled upstream", parent) as span:
        assert not span.recording
    assert [s.name for s in m.spans()] == ["sampled upstream"] and m2.spans() == []


def test_a_span_ends_on_an_exception_with_status_error():
    m = Memory()
    with pytest.raises(RuntimeError), m.tracing.start("request"):
        raise RuntimeError("boom")
    span = m.one("request")
    assert span.end_time is not None
    assert span.status.status_code.name == "ERROR"
    assert span.status.description == "RuntimeError: boom"
    assert [e.name for e in span.events] == ["exception"]


async def test_a_span_ends_when_its_task_is_cancelled():
    m = Memory()
    entered = asyncio.Event()

    async def handler() -> None:
        with m.tracing.start("request", kind="server") as span:
            span.set("pd.stream", True)
            entered.set()
            await asyncio.sleep(60)  # streaming to a client who then goes away

    task = asyncio.create_task(handler())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    span = m.one("request")
    assert span.end_time is not None and span.status.status_code.name == "UNSET"
    (event,) = span.events
    assert event.name == "cancelled" and event.attributes["exception.type"] == "CancelledError"


def test_a_span_made_after_the_fact_from_engine_times():
    m = Memory("pd-worker", "decode")
    arrived = time.monotonic() - 0.25
    parent = m.tracing.parent_from_headers({"traceparent": traceparent()})
    span = m.tracing.start("worker.decode", parent, start_ns=epoch_ns(arrived), kind="server")
    span.event("first_token", at_ns=epoch_ns(arrived + 0.05))
    span.end(epoch_ns(arrived + 0.2))
    done = m.one("worker.decode")
    assert done.end_time - done.start_time == pytest.approx(200_000_000, abs=1_000)
    assert format(done.parent.span_id, "016x") == SPAN_ID


# ------------------------------------------------------------------------------ OTLP/HTTP export


@pytest.fixture
def otlp():
    pytest.importorskip("opentelemetry.sdk", reason=NEEDS_OTEL)
    with OtlpReceiver() as receiver:
        yield receiver


async def test_spans_reach_an_otlp_http_collector_within_5_s(otlp, no_otel_env):
    t = setup_tracing("pd-worker", "decode", otlp.url, 1.0, "d-1")
    assert t.enabled
    try:
        t0 = time.monotonic()
        with t.start("router.request", kind="server", attributes={"pd.n": 2}) as root:
            with t.start("worker.decode", root, kind="client") as child:
                child.event("first_token", {"pd.tokens": 1})
        got = await otlp.wait(lambda s: s.trace_id == root.trace_id_hex, count=2, timeout=5.0)
        assert time.monotonic() - t0 < 5.0
    finally:
        t.shutdown()
    by_name = {s.name: s for s in got}
    r, c = by_name["router.request"], by_name["worker.decode"]
    assert (r.kind, r.parent_span_id, r.attributes) == ("server", "", {"pd.n": 2})
    assert (c.kind, c.parent_span_id, c.span_id) == ("client", r.span_id, child.span_id_hex)
    assert c.events[0][0] == "first_token" and c.events[0][2] == {"pd.tokens": 1}
    assert r.start_ns <= c.start_ns <= c.end_ns <= r.end_ns
    assert (r.service, r.role, r.resource["service.instance.id"]) == ("pd-worker", "decode", "d-1")


async def test_the_standard_variable_turns_export_on(otlp, monkeypatch, no_otel_env):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", otlp.url)
    t = setup_tracing("pd-router", "router", None, 1.0)
    assert t.enabled
    try:
        t.start("from the variable").end()
        (span,) = await otlp.wait(lambda s: s.name == "from the variable")
    finally:
        t.shutdown()
        t.shutdown()  # a second shutdown does nothing
    assert span.service == "pd-router" and span.role == "router"


def test_the_traces_url_of_an_endpoint():
    url = tracing_module._traces_url
    assert url("http://c:4318") == url("http://c:4318/") == "http://c:4318/v1/traces"
    assert url("https://c/otlp/v1/traces") == "https://c/otlp/v1/traces"


def test_shutdown_gives_up_on_a_collector_that_is_down(no_otel_env):
    pytest.importorskip("opentelemetry.sdk", reason=NEEDS_OTEL)
    t = setup_tracing("pd-router", "router", "http://127.0.0.1:1", 1.0)
    t.start("lost").end()
    t0 = time.monotonic()
    t.shutdown(timeout_s=0.5)
    assert time.monotonic() - t0 < 2.0
