"""The router's /tokenize and /detokenize (forwarded to a healthy worker) and its CORS."""

from __future__ import annotations

from tests.router.conftest import COMPLETION, registry_of

PREFLIGHT = {
    "Origin": "http://ui.example",
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type",
}


async def test_tokenize_goes_to_a_healthy_worker_with_the_worker_key(stub, router):
    p, d = await stub("prefill"), await stub("decode")
    d.instance = "d"
    client = await router(prefill=[p], decode=[d], worker_api_key="wk")
    registry_of(client).prefill.set_healthy(registry_of(client).prefill.workers[p.url], False)
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1, 2]})):
        resp = await client.post(path, json=body)
        assert resp.status == 200
        assert await resp.json() == {"path": path, "instance": "d", **body}
    assert [h["Authorization"] for h in d.headers] == ["Bearer wk"] * 2 and not p.requests


async def test_tokenize_without_a_healthy_worker_is_a_503(stub, router):
    d = await stub("decode", health_status=503)
    client = await router(decode=[d])
    resp = await client.post("/tokenize", json={"prompt": "hi"})
    assert resp.status == 503 and (await resp.json())["error"]["code"] == "no_healthy_worker"


async def test_the_api_key_guards_tokenize_but_not_a_cors_preflight(stub, router):
    w = await stub("both")
    client = await router(worker=[w], api_key="k", allowed_origins=("http://ui.example",))
    resp = await client.post("/tokenize", json={"prompt": "hi"}, headers={"Origin": "http://ui.example"})
    assert resp.status == 401 and (await resp.json())["error"]["code"] == "invalid_api_key"
    assert resp.headers["Access-Control-Allow-Origin"] == "http://ui.example"
    for path in ("/v1/chat/completions", "/tokenize"):
        resp = await client.options(path, headers=PREFLIGHT)
        assert resp.status == 200, path
        assert resp.headers["Access-Control-Allow-Origin"] == "http://ui.example"
    resp = await client.post(
        "/v1/completions", json=COMPLETION,
        headers={"Origin": "http://ui.example", "Authorization": "Bearer k"},
    )  # fmt: skip
    assert resp.status == 200 and resp.headers["Access-Control-Allow-Origin"] == "http://ui.example"
    await resp.read()


async def test_no_cors_unless_asked(stub, router):
    w = await stub("both")
    client = await router(worker=[w])
    resp = await client.options("/v1/completions", headers=PREFLIGHT)
    assert resp.status == 405 and "Access-Control-Allow-Origin" not in resp.headers
