"""The P -> D exchange run by a decode worker itself, for a gateway that sends each request to one
endpoint (the Gateway API Inference Extension: pd-router --endpoint-picker picks D and names P in
`x-prefiller-host-port`, as llm-d does).

Taken only when the header is signed by the picker with the cluster token, bound to this
request's body (`x-pd-prefiller-sig`, pd/signing.py), and names a prefill worker of this decode
worker's own set (`PrefillPeers`: `--prefill-peer` URLs, and on Kubernetes the ready endpoints of
the prefill workers' EndpointSlices, `--prefill-peer-selector`, watched); otherwise 400. D then asks P what the router would
(`max_tokens` 1, no stream, `kv_transfer_params={"do_remote_decode": true}`), and serves the
request with P's answer's `kv_transfer_params` (signed by P, checked as any). A request for at
most one token needs no KV from anywhere: this worker serves it alone. If D then fails before it
pulls, P's pinned pages are freed by their lease (`--lease-ttl-s`)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import aiohttp
import orjson

from pd.kube_api import KubeAPI
from pd.kube_slices import SliceWatch
from pd.protocol import APIError, bad_request
from pd.protocol.names import KV_PARAMS, PREFILLER_HEADER, PREFILLER_SIG_HEADER
from pd.registration import host_port
from pd.signing import check_prefiller

TIMEOUT_S = 300.0  # P's answer: a long prompt's prefill


class PrefillPeers:
    """The prefill workers a picker may name to this decode worker: the `--prefill-peer` URLs,
    and with a `watch` the ready endpoints of the EndpointSlices of `--prefill-peer-selector`
    (a P leaves the set when its endpoint turns not ready or goes; a request naming it is then
    a 400, and the picker, which watches the same slices, stops naming it)."""

    def __init__(self, urls: Iterable[str] = (), watch: SliceWatch | None = None) -> None:
        self.static = tuple(urls)
        self.watch = watch
        self._http: aiohttp.ClientSession | None = None

    def http(self) -> aiohttp.ClientSession:
        """The session the prefill requests share (a connection pool a P), made on first use."""
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession()
        return self._http

    @classmethod
    def from_flags(
        cls,
        urls: Iterable[str],
        selector: str | None,
        api: str | None,
        namespace: str | None,
        port_name: str,
    ) -> PrefillPeers:
        if selector is None:
            return cls(urls)
        kube = KubeAPI.from_flags(api, namespace)
        return cls(urls, SliceWatch(kube, selector, port_name, lambda: None))

    def urls(self) -> tuple[str, ...]:
        watched = sorted(self.watch.urls()) if self.watch is not None else []
        return self.static + tuple(watched)

    def find(self, named: str) -> str | None:
        """The URL of the peer `named` (host:port), or None."""
        return next((u for u in self.urls() if host_port(u) == named), None)

    async def run(self) -> None:
        """Watch the slices, if any, until the caller cancels; then close the shared session."""
        try:
            if self.watch is None:
                await asyncio.Event().wait()  # nothing to watch: hold on until cancelled
            else:
                timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
                async with aiohttp.ClientSession(timeout=timeout) as http:
                    await self.watch.run(http)
        finally:
            if self._http is not None:
                await self._http.close()


def prefill_request(body: dict[str, Any], max_tokens: int | None) -> dict[str, Any]:
    """What P is asked (the router's plan for P): one token, no stream, KV kept for D."""
    out = {**body, "stream": False, "max_tokens": 1}
    out.pop("stream_options", None)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out[KV_PARAMS] = {"do_remote_decode": True}
    if max_tokens is not None:  # P refuses, before prefilling, what no decode worker could take
        out[KV_PARAMS]["max_tokens"] = max_tokens
    return out


async def prefill_elsewhere(
    role: str,
    token: bytes | None,
    peers: PrefillPeers,
    path: str,
    headers: Any,
    raw: bytes,
) -> bytes:
    """The body to serve: `raw` with P's `kv_transfer_params`, when a picker named a prefill
    worker for it (else `raw`); APIError 400 for a header not to be trusted, 502 when P fails."""
    named = headers.get(PREFILLER_HEADER)
    if named is None:
        return raw
    param = PREFILLER_HEADER
    if role != "decode":
        raise bad_request(f"{PREFILLER_HEADER} is for decode workers; this one is {role}", param)
    if not check_prefiller(token, named, raw, headers.get(PREFILLER_SIG_HEADER)):
        raise bad_request(
            f"{PREFILLER_HEADER} must come signed by the endpoint picker with the cluster token, "
            f"for this request's body ({PREFILLER_SIG_HEADER})",
            param,
        )
    peer = peers.find(named)
    if peer is None:
        raise bad_request(
            f"{named} is not a prefill worker of this decode worker (--prefill-peer, "
            "--prefill-peer-selector)",
            param,
        )
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw  # the parse answers it
    if not isinstance(body, dict) or KV_PARAMS in body:
        return raw
    asked = body.get("max_completion_tokens", body.get("max_tokens"))
    if isinstance(asked, int) and asked <= 1:
        return raw  # P's one token is the whole answer: served here alone
    max_tokens = asked if isinstance(asked, int) and not isinstance(asked, bool) else None
    try:
        async with peers.http().post(
            peer.rstrip("/") + path,
            data=orjson.dumps(prefill_request(body, max_tokens)),
            headers={"Content-Type": "application/json"},
            timeout=aiohttp.ClientTimeout(total=TIMEOUT_S),
        ) as r:
            answer = await r.read()
            status = r.status
    except (aiohttp.ClientError, TimeoutError) as e:
        raise APIError(502, f"the prefill worker {named} did not answer: {type(e).__name__}",
                       "server_error", "prefill_failed") from None  # fmt: skip
    if status != 200:
        raise APIError(502, f"the prefill worker {named} answered {status}: {answer[:200]!r}",
                       "server_error", "prefill_failed")  # fmt: skip
    kvp = orjson.loads(answer).get(KV_PARAMS)
    if not isinstance(kvp, dict):
        raise APIError(502, f"the prefill worker {named} kept no KV for this request",
                       "server_error", "prefill_failed")  # fmt: skip
    return orjson.dumps({**body, KV_PARAMS: kvp})
