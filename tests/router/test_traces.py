"""The router's spans (pd/tracing.py, in-memory exporter): a request's span is the child of the
client's `traceparent`, each call to a worker a client span under it (retries as events), and a
migrated stream's leg a `pd.migration` span linked to the call whose stream broke."""

from __future__ import annotations

import pytest

from pd.tracing import setup_tracing
from tests.router.test_migration import COMPLETION_PATH, body_of, two_of

pytest.importorskip("opentelemetry.sdk", reason="needs the otel extra: pip install 'pd[otel]'")

from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)

TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


@pytest.fixture
def spans(monkeypatch):
    exporter = InMemorySpanExporter()
    tracing = setup_tracing("pd-router", "router", None, 1.0, exporter=exporter)
    monkeypatch.setattr("pd.router.app.setup_tracing", lambda *a, **k: tracing)
    return exporter


def _hex(n: int, digits: int) -> str:
    return format(n, f"0{digits}x")


async def test_a_migrated_streams_leg_links_to_the_call_that_broke(stub, router, spans):
    client, p, ws = await two_of(stub, router, "pd")
    ws[0].break_at, ws[0].break_times = 3, 1
    resp = await client.post(
        COMPLETION_PATH,
        json=body_of(False, True, False),
        headers={"traceparent": f"00-{TRACE}-{CLIENT_SPAN}-01"},
    )
    assert resp.status == 200
    assert (await resp.read()).rstrip().endswith(b"data: [DONE]")
    got = spans.get_finished_spans()
    assert {_hex(s.context.trace_id, 32) for s in got} == {TRACE}
    by_name: dict[str, list] = {}
    for s in got:
        by_name.setdefault(s.name, []).append(s)
    (request,) = by_name["POST /v1/completions"]
    assert _hex(request.parent.span_id, 16) == CLIENT_SPAN
    (leg,) = by_name["pd.migration"]
    assert leg.parent.span_id == request.context.span_id
    assert leg.attributes["pd.reason"] == "broken" and leg.attributes["pd.tokens_before"] > 0
    broke = [s for s in by_name["pd.decode"] if s.parent.span_id == request.context.span_id]
    assert len(broke) == 1 and broke[0].attributes["pd.worker"] == ws[0].url
    (link,) = leg.links
    assert link.context.span_id == broke[0].context.span_id  # the call whose stream broke
    # The leg's own calls (P again, then the other D) are its children.
    children = [s for s in got if s.parent is not None and s.parent.span_id == leg.context.span_id]
    assert {s.name for s in children} == {"pd.prefill", "pd.decode"}
    (d2,) = [s for s in children if s.name == "pd.decode"]
    assert d2.attributes["pd.worker"] == ws[1].url
    assert all(s.end_time >= s.start_time for s in got)


async def test_without_a_traceparent_the_router_starts_the_trace(stub, router, spans):
    p, d = await stub("prefill"), await stub("decode")
    client = await router(prefill=[p], decode=[d])
    resp = await client.post(COMPLETION_PATH, json=body_of(False, False, False))
    assert resp.status == 200
    (request,) = [s for s in spans.get_finished_spans() if s.name.startswith("POST")]
    assert request.parent is None
    assert request.attributes["http.response.status_code"] == 200
