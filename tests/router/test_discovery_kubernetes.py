"""`pd-router --discovery kubernetes` against an in-process double of the API (kube_api.py): the
ready endpoints of each role's EndpointSlices join the router, a not-ready or deleted one leaves
it (its streams finish), and the watch survives its own end, a cut connection, a compacted
version (410 Gone) and an API outage. The double is also driven by the official `kubernetes`
client's `watch.Watch` (issue 44)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from pd.kube_api import KubeAPI
from pd.kube_slices import slice_urls
from pd.router import RouterConfig, make_app
from pd.router.discovery.kubernetes import KubernetesDiscovery
from pd.router.registry import Registry
from tests.kube_api import KubeAPIDouble, endpoint_slice
from tests.router.conftest import COMPLETION, FAST, registry_of, sse_events, wait_for

P_SEL = "kubernetes.io/service-name=pd-prefill"
D_SEL = "kubernetes.io/service-name=pd-decode"


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def test_a_slices_ready_endpoints_are_its_urls() -> None:
    s = endpoint_slice("d-1", "pd-decode", 8000, ["10.0.0.1", "10.0.0.2"])
    assert slice_urls(s, "http") == {"http://10.0.0.1:8000", "http://10.0.0.2:8000"}
    s["endpoints"][1]["conditions"]["ready"] = False  # draining, terminating or unready
    del s["endpoints"][0]["conditions"]["ready"]  # unset counts as ready, as the API says
    assert slice_urls(s, "http") == {"http://10.0.0.1:8000"}
    s["ports"] = [{"name": "metrics", "port": 9000}, {"name": "grpc", "port": 9001}]
    assert slice_urls(s, "http") == set()  # no port of that name, and more than one
    s["endpoints"][0]["addresses"] = ["fd00::1"]
    s["ports"] = [{"name": "web", "port": 8000}]
    assert slice_urls(s, "http") == {"http://[fd00::1]:8000"}


def test_the_api_comes_from_the_flags_or_the_pod(monkeypatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ValueError, match="needs --k8s-api"):
        KubeAPI.from_flags(None, None)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    api = KubeAPI.from_flags(None, "pd")
    assert api.base == "https://10.96.0.1:443" and api.namespace == "pd"
    assert api.slices_url().endswith("/apis/discovery.k8s.io/v1/namespaces/pd/endpointslices")
    with pytest.raises(ValueError, match="needs a --k8s-prefill-selector"):
        RouterConfig(discovery="kubernetes")


@contextlib.asynccontextmanager
async def _discovery(aiohttp_server, double: KubeAPIDouble, registry: Registry, **kw):
    server = await aiohttp_server(double.app())
    api = KubeAPI(str(server.make_url("")).rstrip("/"), double.namespace)
    d = KubernetesDiscovery(api, {"prefill": P_SEL, "decode": D_SEL}, registry, **kw)
    task = asyncio.create_task(d.run())
    try:
        yield d
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_the_watch_follows_changes_and_survives_its_end_a_cut_410_and_an_outage(
    aiohttp_server,
):
    double = KubeAPIDouble()
    double.put(endpoint_slice("p", "pd-prefill", 8001, ["10.0.0.1"]))
    double.put(endpoint_slice("d", "pd-decode", 8002, ["10.0.1.1", "10.0.1.2"]))
    double.put(endpoint_slice("other", "not-pd", 9999, ["10.9.9.9"]))
    registry = Registry(RouterConfig())

    def urls(pool: str) -> set[str]:
        return set(registry.pools[pool].workers)

    async with _discovery(aiohttp_server, double, registry, watch_timeout_s=1) as d:
        await wait_for(lambda: urls("decode") == {"http://10.0.1.1:8002", "http://10.0.1.2:8002"})
        assert urls("prefill") == {"http://10.0.0.1:8001"}  # and nothing of other services
        # not ready: it leaves; ready again: it comes back
        s = endpoint_slice("d", "pd-decode", 8002, ["10.0.1.1", "10.0.1.2"])
        s["endpoints"][1]["conditions"]["ready"] = False
        double.put(s)
        await wait_for(lambda: urls("decode") == {"http://10.0.1.1:8002"})
        double.put(endpoint_slice("d", "pd-decode", 8002, ["10.0.1.1", "10.0.1.2"]))
        await wait_for(lambda: len(urls("decode")) == 2)
        # the API ends the watch after timeoutSeconds (1 s): resumed, with bookmarks between
        await asyncio.sleep(1.5)
        assert double.watches >= 4 and double.bookmarks >= 1 and double.lists == 2
        double.put(endpoint_slice("p2", "pd-prefill", 8001, ["10.0.0.2"]))
        await wait_for(lambda: len(urls("prefill")) == 2)
        # a cut connection: resumed from the last version, nothing listed again
        await double.cut_watches()
        double.delete("p2")
        await wait_for(lambda: urls("prefill") == {"http://10.0.0.1:8001"})
        assert double.lists == 2
        # a version compacted away while the watch was cut: 410, listed again
        await double.cut_watches()
        double.put(endpoint_slice("d", "pd-decode", 8002, ["10.0.1.3"]))
        double.compact()
        await wait_for(lambda: urls("decode") == {"http://10.0.1.3:8002"}, timeout=5.0)
        assert double.lists >= 3 and sum(w.relists for w in d.watches.values()) >= 1
        # an outage: the workers there are stay; the changes made meanwhile arrive after it
        double.down = True
        await double.cut_watches()
        await asyncio.sleep(0.8)
        assert urls("decode") == {"http://10.0.1.3:8002"} and urls("prefill")
        assert sum(w.failures for w in d.watches.values()) >= 1
        double.put(endpoint_slice("d", "pd-decode", 8002, ["10.0.1.4"]))
        double.down = False
        await wait_for(lambda: urls("decode") == {"http://10.0.1.4:8002"}, timeout=10.0)


async def test_a_router_serves_through_the_discovered_workers_and_a_not_ready_ones_stream_finishes(
    stub, aiohttp_client, aiohttp_server
):
    p, d1, d2 = await stub("prefill"), await stub("decode"), await stub("decode")
    d1.chunk_delay = 0.05
    double = KubeAPIDouble()
    api = await aiohttp_server(double.app())
    double.put(endpoint_slice("p", "pd-prefill", _port(p.url), ["127.0.0.1"]))
    double.put(endpoint_slice("d1", "pd-decode", _port(d1.url), ["127.0.0.1"]))
    cfg = RouterConfig(
        **FAST, discovery="kubernetes", k8s_api=str(api.make_url("")).rstrip("/"),
        k8s_namespace="pd", k8s_prefill_selector=P_SEL, k8s_decode_selector=D_SEL,
    )  # fmt: skip
    client = await aiohttp_client(make_app(cfg))
    reg = registry_of(client)
    await wait_for(lambda: bool(reg.prefill.healthy and reg.decode.healthy), timeout=15.0)
    resp = await client.post("/v1/completions", json={**COMPLETION, "stream": True})
    first = await resp.content.readline()
    assert resp.status == 200 and first.startswith(b"data: ")
    # d1 turns not ready (a drain): it gets nothing new, its stream finishes; d2 takes over
    s = endpoint_slice("d1", "pd-decode", _port(d1.url), ["127.0.0.1"], ready=False)
    double.put(s)
    double.put(endpoint_slice("d2", "pd-decode", _port(d2.url), ["127.0.0.1"]))
    await wait_for(lambda: set(reg.decode.workers) == {d2.url})
    events = sse_events(first + await resp.read())
    assert events[-1] == b"[DONE]" and len(events) == d1.chunks + 1, events
    await wait_for(lambda: bool(reg.decode.healthy), timeout=15.0)
    before = len(d1.requests)
    assert (await client.post("/v1/completions", json=COMPLETION)).status == 200
    assert len(d1.requests) == before and len(d2.requests) == 1


async def test_the_official_clients_watch_reads_the_double(aiohttp_server):
    """The `kubernetes` package's own list and `watch.Watch` against the double: its objects
    deserialize as EndpointSlices, its events and bookmarks arrive, and a compacted version is
    the client's 410."""
    k8s = pytest.importorskip("kubernetes", reason="the official client: pip install 'pd[k8s]'")
    double = KubeAPIDouble(bookmark_s=0.1)
    server = await aiohttp_server(double.app())
    double.put(endpoint_slice("d", "pd-decode", 8002, ["10.0.1.1"]))
    conf = k8s.client.Configuration()
    conf.host = str(server.make_url("")).rstrip("/")
    api = k8s.client.DiscoveryV1Api(k8s.client.ApiClient(conf))

    def listed() -> tuple[str, list[str]]:
        got = api.list_namespaced_endpoint_slice("pd", label_selector=D_SEL)
        return got.metadata.resource_version, [e.addresses[0] for e in got.items[0].endpoints]

    version, addresses = await asyncio.to_thread(listed)
    assert addresses == ["10.0.1.1"]

    def watched(since: str) -> list[tuple[str, str]]:
        w = k8s.watch.Watch()
        out = []
        for ev in w.stream(api.list_namespaced_endpoint_slice, "pd", label_selector=D_SEL,
                           resource_version=since, allow_watch_bookmarks=True, timeout_seconds=1):  # fmt: skip
            obj = ev["object"]
            if ev["type"] == "BOOKMARK":  # the client leaves a bookmark's object as it came
                out.append((ev["type"], obj["metadata"]["resourceVersion"]))
            else:  # the others deserialize as the API's model
                assert isinstance(obj, k8s.client.V1EndpointSlice), obj
                out.append((ev["type"], obj.metadata.resource_version))
        assert w.resource_version == double_version()  # where the client would resume
        return out

    def double_version() -> str:
        return str(double.version)

    async def change() -> None:
        await asyncio.sleep(0.3)
        double.put(endpoint_slice("d", "pd-decode", 8002, ["10.0.1.2"]))
        double.delete("d")

    events, _ = await asyncio.gather(asyncio.to_thread(watched, version), change())
    kinds = [k for k, _ in events]
    assert kinds[:1] == ["BOOKMARK"] and "MODIFIED" in kinds and kinds.count("DELETED") == 1
    assert events[kinds.index("DELETED")][1] == str(double.version)
    double.compact()
    with pytest.raises(k8s.client.exceptions.ApiException) as gone:
        await asyncio.to_thread(watched, version)
    assert gone.value.status == 410
