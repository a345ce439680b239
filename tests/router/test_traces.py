"""The router's spans (pd/tracing.py, in-memory exporter): one a request, the child of the
client's `traceparent`, with the workers its policies picked (retries as events); a migrated
stream's leg a `pd.migration` span under it, linked to the leg it continues."""

from __future__ import annotations

import pytest

from pd.tracing import InMemoryExporter, setup_tracing
from tests.router.test_migration import COMPLETION_PATH, body_of, two_of

TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


@pytest.fixture
def spans(monkeypatch):
    exporter = InMemoryExporter()
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
    assert request.attributes["pd.decode.worker"] == ws[0].url  # the stream that broke
    (leg,) = by_name["pd.migration"]
    assert leg.parent.span_id == request.context.span_id
    assert leg.attributes["pd.reason"] == "broken" and leg.attributes["pd.tokens_before"] > 0
    assert leg.attributes["pd.broken_worker"] == ws[0].url
    (link,) = leg.links
    assert link.context.span_id == request.context.span_id  # the leg it continues
    assert leg.attributes["pd.decode.worker"] == ws[1].url  # where it went on
    assert len(got) == 2 and all(s.end_time >= s.start_time for s in got)


async def test_without_a_traceparent_the_router_starts_the_trace(stub, router, spans):
    p, d = await stub("prefill"), await stub("decode")
    client = await router(prefill=[p], decode=[d])
    resp = await client.post(COMPLETION_PATH, json=body_of(False, False, False))
    assert resp.status == 200
    (request,) = [s for s in spans.get_finished_spans() if s.name.startswith("POST")]
    assert request.parent is None
    assert request.attributes["http.response.status_code"] == 200
