"""A decode worker given a signed `x-prefiller-host-port` (the endpoint picker's, issue 44) runs the
P -> D exchange itself: P prefills, D pulls and decodes; an unsigned, forged or moved header, a
prefill worker not among D's peers (`--prefill-peer`, or the EndpointSlices of
`--prefill-peer-selector`), or the header sent to a prefill worker is a 400.
Simulated GPUs (real worker processes, modeled steps)."""

from __future__ import annotations

import asyncio
import os

import aiohttp
import pytest

from pd.bench.pd import _spawn, _wait_healthy
from pd.ports import free_port
from pd.protocol.names import PREFILLER, PREFILLER_HEADER, PREFILLER_SIG_HEADER
from pd.signing import prefiller_payload, sign
from pd.worker.disagg.prefiller import host_port
from tests.kube_api import KubeAPIDouble, endpoint_slice

TOKEN = "pd-test-prefiller"
PROFILE = "llama-3.1-8b:h100:tp1"


@pytest.fixture(scope="module")
def p_and_d():
    before = os.environ.get("PD_CLUSTER_TOKEN")
    os.environ["PD_CLUSTER_TOKEN"] = TOKEN  # _spawn passes it on
    pp, dp = free_port(), free_port()
    p_url, d_url = f"http://127.0.0.1:{pp}", f"http://127.0.0.1:{dp}"
    procs = [
        _spawn("pd.worker.main", "--role", "prefill", "--port", str(pp), "--simulate", PROFILE),
        _spawn(
            "pd.worker.main",
            "--role",
            "decode",
            "--port",
            str(dp),
            "--simulate",
            PROFILE,
            "--prefill-peer",
            p_url,
        ),  # fmt: skip
    ]
    try:
        for u in (p_url, d_url):
            asyncio.run(_wait_healthy(u, procs, timeout=120))
        yield p_url, d_url
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)
        if before is None:
            os.environ.pop("PD_CLUSTER_TOKEN", None)
        else:
            os.environ["PD_CLUSTER_TOKEN"] = before


async def _metric(http: aiohttp.ClientSession, url: str, name: str) -> float:
    async with http.get(f"{url}/metrics") as r:
        text = await r.text()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def _signed(named: str, body: bytes, token: str = TOKEN) -> dict[str, str]:
    sig = sign(token.encode(), PREFILLER, prefiller_payload(named, body))
    return {PREFILLER_HEADER: named, PREFILLER_SIG_HEADER: sig, "Content-Type": "application/json"}


BODY = (
    b'{"model": "default", "prompt": "one two three four five six seven eight", '
    b'"max_tokens": 8, "stream": true, "ignore_eos": true}'
)


async def test_a_signed_header_has_d_prefill_on_p_then_decode(p_and_d):
    p_url, d_url = p_and_d
    named = host_port(p_url)
    async with aiohttp.ClientSession() as http:
        p_before = await _metric(http, p_url, "pd_prompt_tokens_total")
        pulls_before = await _metric(http, d_url, "pd_kv_transfer_seconds_count")
        async with http.post(
            f"{d_url}/v1/completions", data=BODY, headers=_signed(named, BODY)
        ) as r:
            assert r.status == 200, await r.text()
            raw = await r.read()
        assert raw.rstrip().endswith(b"data: [DONE]")
        assert await _metric(http, p_url, "pd_prompt_tokens_total") > p_before  # P prefilled
        # and D pulled its KV from P, rather than prefilling it
        assert await _metric(http, d_url, "pd_kv_transfer_seconds_count") == pulls_before + 1
        await _pages_free(http, p_url, d_url)


async def _pages_free(http: aiohttp.ClientSession, *urls: str) -> None:
    """Every page back (cached ones count as free), nothing pinned, the page walk clean."""
    for url in urls:
        for _ in range(100):
            async with http.get(f"{url}/health") as r:
                h = await r.json()
            load = h["load"]
            if load["kv_pages_free"] == load["kv_pages_total"] and not load["kv_pages_held"]:
                break
            await asyncio.sleep(0.1)
        assert load["kv_pages_free"] == load["kv_pages_total"] and not load["kv_pages_held"], load
        assert h["integrity"] == "ok", h["integrity"]


@pytest.mark.parametrize("case", ["unsigned", "forged", "other_body", "not_a_peer", "to_p"])
async def test_an_untrusted_header_is_a_400(p_and_d, case):
    p_url, d_url = p_and_d
    named = host_port(p_url)
    headers = _signed(named, BODY)
    target = d_url
    if case == "unsigned":
        del headers[PREFILLER_SIG_HEADER]
    elif case == "forged":
        headers = _signed(named, BODY, token="not-the-cluster-token")
    elif case == "other_body":  # a signature moved onto another request
        headers = _signed(named, BODY.replace(b"one", b"uno"))
    elif case == "not_a_peer":
        headers = _signed("127.0.0.1:1", BODY)
    else:
        target = p_url
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{target}/v1/completions", data=BODY, headers=headers) as r:
            body = await r.json()
            assert r.status == 400, body
    assert body["error"]["param"] == PREFILLER_HEADER, body
    async with aiohttp.ClientSession() as http:
        await _pages_free(http, p_url, d_url)  # nothing admitted on either


async def test_the_prefill_peers_follow_the_endpointslices(p_and_d, aiohttp_server):
    """`--prefill-peer-selector` (the gie overlay's decode workers): D's set of prefill peers is
    the ready endpoints of the prefill Service's EndpointSlices, watched. Before P's slice exists
    the header naming it is a 400; once its endpoint is ready, D prefills there; when it turns
    not ready (draining), a 400 again."""
    p_url, _ = p_and_d
    named = host_port(p_url)
    api = KubeAPIDouble()
    server = await aiohttp_server(api.app())
    dp = free_port()
    d_url = f"http://127.0.0.1:{dp}"
    proc = _spawn(
        "pd.worker.main", "--role", "decode", "--port", str(dp), "--simulate", PROFILE,
        "--prefill-peer-selector", "kubernetes.io/service-name=pd-prefill",
        "--k8s-api", str(server.make_url("")).rstrip("/"), "--k8s-namespace", api.namespace,
    )  # fmt: skip
    host, port = named.rsplit(":", 1)

    async def status_until(http: aiohttp.ClientSession, want: int) -> dict:
        for _ in range(100):
            async with http.post(
                f"{d_url}/v1/completions", data=BODY, headers=_signed(named, BODY)
            ) as r:
                body = await r.read()
                if r.status == want:
                    return {"status": r.status, "body": body}
            await asyncio.sleep(0.1)
        raise AssertionError(f"still {r.status}, not {want}: {body[:300]!r}")

    try:
        await _wait_healthy(d_url, [proc], timeout=120)
        async with aiohttp.ClientSession() as http:
            got = await status_until(http, 400)
            assert b"not a prefill worker of this decode worker" in got["body"]
            api.put(endpoint_slice("pd-prefill-1", "pd-prefill", int(port), [host]))
            pulls = await _metric(http, d_url, "pd_kv_transfer_seconds_count")
            got = await status_until(http, 200)
            assert got["body"].rstrip().endswith(b"data: [DONE]")
            assert await _metric(http, d_url, "pd_kv_transfer_seconds_count") == pulls + 1
            api.put(endpoint_slice("pd-prefill-1", "pd-prefill", int(port), [host], ready=False))
            await status_until(http, 400)
            await _pages_free(http, p_url, d_url)
        assert api.lists >= 1 and api.watches >= 1
    finally:
        proc.terminate()
        proc.wait(timeout=30)
