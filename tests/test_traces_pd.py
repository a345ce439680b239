"""One trace per request across pd-router, a prefill and a decode worker (processes on simulated
GPUs), exported over OTLP/HTTP to a receiver in the test (issue 45): the client's trace id on
every span, the router's request span a child of the client's (with the workers it picked),
each worker's a child of it, the stage spans with their figures, each process's resource; and when the
client leaves mid-stream, every span still ends and is exported."""

from __future__ import annotations

import asyncio
import os
import secrets

import aiohttp
import pytest

from pd.bench.pd import _spawn, _wait_healthy
from pd.ports import free_port

pytest.importorskip(
    "opentelemetry.proto",
    reason="the OTLP receiver decodes with the otel extra: pip install 'pd[otel]'",
)

from tests.otlp_receiver import OtlpReceiver, ReceivedSpan  # noqa: E402

PROFILE = "llama-3.1-8b:h100:tp1"
TOKEN = "pd-test-traces"


@pytest.fixture(scope="module")
def cluster():
    before = os.environ.get("PD_CLUSTER_TOKEN")
    os.environ["PD_CLUSTER_TOKEN"] = TOKEN
    receiver = OtlpReceiver().start()
    pp, dp, rp = free_port(), free_port(), free_port()
    urls = {
        r: f"http://127.0.0.1:{p}" for r, p in (("prefill", pp), ("decode", dp), ("router", rp))
    }
    otlp = ("--otlp-endpoint", receiver.url)
    procs = [
        _spawn("pd.worker.main", "--role", "prefill", "--port", str(pp), "--simulate", PROFILE, *otlp),
        _spawn("pd.worker.main", "--role", "decode", "--port", str(dp), "--simulate", PROFILE, *otlp),
    ]  # fmt: skip
    try:
        for role in ("prefill", "decode"):
            asyncio.run(_wait_healthy(urls[role], procs, timeout=120))
        procs.append(_spawn(
            "pd.router.main", "--port", str(rp), "--prefill", urls["prefill"], "--decode",
            urls["decode"], "--local-prefill-max-tokens", "0", *otlp,
        ))  # fmt: skip
        asyncio.run(_wait_healthy(urls["router"], procs, timeout=60))
        yield urls, receiver
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)
        receiver.stop()
        if before is None:
            os.environ.pop("PD_CLUSTER_TOKEN", None)
        else:
            os.environ["PD_CLUSTER_TOKEN"] = before


def _traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def _one(spans: list[ReceivedSpan], name: str, role: str) -> ReceivedSpan:
    found = [s for s in spans if s.name == name and s.role == role]
    assert len(found) == 1, (name, role, [(s.name, s.role) for s in spans])
    return found[0]


async def test_one_trace_across_router_prefill_and_decode(cluster):
    urls, otlp = cluster
    trace_id, client_span, traceparent = _traceparent()
    body = {"model": "default", "prompt": "one two three four five six seven eight nine ten",
            "max_tokens": 8, "stream": True, "ignore_eos": True}  # fmt: skip
    async with aiohttp.ClientSession() as http:
        async with http.post(
            f"{urls['router']}/v1/completions", json=body, headers={"traceparent": traceparent}
        ) as r:
            assert r.status == 200, await r.text()
            assert (await r.read()).rstrip().endswith(b"data: [DONE]")
    # Exported within 5 s of the answer: the router's, P's and D's request spans and stages.
    spans = await otlp.wait(lambda s: s.trace_id == trace_id, count=10, timeout=5)
    request = _one(spans, "POST /v1/completions", "router")
    assert request.parent_span_id == client_span and request.kind == "server"
    assert request.attributes["pd.route"] == "pd" and request.attributes["pd.class"] == "default"
    assert request.attributes["http.response.status_code"] == 200
    for pool in ("prefill", "decode"):  # the policy's picks, on the router's one span
        assert request.attributes[f"pd.{pool}.worker"] == urls[pool]
        assert request.attributes[f"pd.{pool}.policy"] == "load-aware"
    on_p = _one(spans, "pd-worker POST /v1/completions", "prefill")
    on_d = _one(spans, "pd-worker POST /v1/completions", "decode")
    assert on_p.parent_span_id == on_d.parent_span_id == request.span_id
    for stage in ("pd.queue", "pd.prefill", "pd.handoff"):
        assert _one(spans, stage, "prefill").parent_span_id == on_p.span_id
    pull = _one(spans, "pd.kv_pull", "decode")
    assert pull.attributes["pd.bytes"] > 0 and pull.attributes["pd.seconds"] > 0
    decode = _one(spans, "pd.decode", "decode")
    assert decode.attributes["pd.tokens"] == 8
    assert 0 < decode.attributes["pd.itl_p50_s"] <= decode.attributes["pd.itl_p99_s"]
    for stage in ("pd.admission", "pd.page_wait", "pd.kv_pull", "pd.decode"):
        assert _one(spans, stage, "decode").parent_span_id == on_d.span_id
    services = {(s.service, s.role) for s in spans}
    assert services == {("pd-router", "router"), ("pd-worker", "prefill"), ("pd-worker", "decode")}
    assert len({s.resource["service.instance.id"] for s in spans}) == 3
    assert all(s.end_ns >= s.start_ns > 0 for s in spans)


async def test_a_client_that_leaves_mid_stream_leaves_every_span_ended(cluster):
    urls, otlp = cluster
    trace_id, _, traceparent = _traceparent()
    body = {"model": "default", "prompt": "count to a thousand", "max_tokens": 2000,
            "stream": True, "ignore_eos": True}  # fmt: skip
    async with aiohttp.ClientSession() as http:
        r = await http.post(
            f"{urls['router']}/v1/completions", json=body, headers={"traceparent": traceparent}
        )
        assert r.status == 200
        await r.content.readany()  # the stream is under way
        r.close()  # the client leaves
    spans = await otlp.wait(
        lambda s: s.trace_id == trace_id and s.name.startswith(("POST", "pd-worker")),
        count=3,
        timeout=10,
    )
    request = _one(spans, "POST /v1/completions", "router")
    assert any(e[0] == "the client went away" for e in request.events), request.events
    on_d = _one(spans, "pd-worker POST /v1/completions", "decode")
    assert on_d.status == "error" and "left" in on_d.status_message
    # the decode stage ended with it, short of the 2000 tokens
    decode = (await otlp.wait(lambda s: s.trace_id == trace_id and s.name == "pd.decode"))[0]
    assert decode.attributes["pd.tokens"] < 2000
