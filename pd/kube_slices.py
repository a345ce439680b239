"""EndpointSlices of a label selector, listed and then watched as the API serves them: from the
list's resourceVersion, with bookmarks; a watch that ends is resumed from the last version seen;
`410 Gone` (the version was compacted) lists again; an API outage keeps the endpoints there are
and retries with a backoff. `urls()` are the HTTP URLs of their ready endpoints.

Shared by the router's discovery (pd/router/discovery/kubernetes.py) and a decode worker's prefill
peers (pd/worker/disagg/prefiller.py, `--prefill-peer-selector`). The API is reached as
pd/kube_api.py says."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp

from pd.kube_api import Gone, KubeAPI, KubeError

log = logging.getLogger("pd.kube")

WATCH_TIMEOUT_S = 300  # the API ends a watch after this; it is resumed at once
BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0)  # between failed attempts (the last repeats)


def slice_urls(obj: Mapping[str, Any], port_name: str) -> set[str]:
    """The worker URLs of one EndpointSlice's ready endpoints (`ready` unset counts as ready, as
    the API says)."""
    ports = obj.get("ports") or []
    port = next((p.get("port") for p in ports if p.get("name") == port_name), None)
    if port is None and len(ports) == 1:
        port = ports[0].get("port")
    if port is None:
        return set()
    out = set()
    for ep in obj.get("endpoints") or []:
        if (ep.get("conditions") or {}).get("ready") is False or not ep.get("addresses"):
            continue
        addr = ep["addresses"][0]
        host = f"[{addr}]" if ":" in addr else addr
        out.add(f"http://{host}:{port}")
    return out


class SliceWatch:
    """One role's EndpointSlices: listed, then watched; `urls()` of their ready endpoints."""

    def __init__(
        self,
        api: KubeAPI,
        selector: str,
        port_name: str,
        changed: Callable[[], None],
        watch_timeout_s: int = WATCH_TIMEOUT_S,
    ) -> None:
        self.api = api
        self.selector = selector
        self.port_name = port_name
        self.changed = changed
        self.watch_timeout_s = watch_timeout_s
        self.slices: dict[str, Mapping[str, Any]] = {}
        self.version: str | None = None
        self.synced = False  # listed at least once
        self.relists = 0  # lists after the first (410 Gone)
        self.failures = 0  # attempts that failed (API down, refused, cut)

    def urls(self) -> set[str]:
        return {u for s in self.slices.values() for u in slice_urls(s, self.port_name)}

    async def run(self, http: aiohttp.ClientSession) -> None:
        attempt = 0
        while True:
            try:
                if self.version is None:
                    await self.list(http)
                await self.watch(http)
                attempt = 0
            except Gone:
                log.info("endpointslices %s: version compacted, listing again", self.selector)
                self.version = None
                self.relists += 1
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError, KubeError) as e:
                self.failures += 1
                wait = BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)]
                attempt += 1
                log.warning(
                    "endpointslices %s: %s (the workers there are stay; again in %.1f s)",
                    self.selector, e or type(e).__name__, wait,
                )  # fmt: skip
                await asyncio.sleep(wait)

    async def list(self, http: aiohttp.ClientSession) -> None:
        body = await self.api.request(
            http, "GET", self.api.slices_path(), params={"labelSelector": self.selector}
        )
        self.slices = {i["metadata"]["name"]: i for i in body.get("items") or []}
        self.version = body["metadata"]["resourceVersion"]
        self.synced = True
        self.changed()

    async def watch(self, http: aiohttp.ClientSession) -> None:
        """Follow the events from `version` until the API ends the watch."""
        params = {
            "labelSelector": self.selector,
            "watch": "true",
            "resourceVersion": self.version or "",
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(self.watch_timeout_s),
        }
        timeout = aiohttp.ClientTimeout(total=None, sock_read=self.watch_timeout_s + 30)
        async with http.get(
            self.api.slices_url(),
            params=params,
            headers=self.api.headers(),
            ssl=self.api.ssl_context(),
            timeout=timeout,
        ) as r:
            if r.status == 410:
                raise Gone()
            if r.status != 200:
                raise KubeError(r.status, (await r.text())[:300])
            async for line in r.content:
                if line.strip():
                    self.event(json.loads(line))

    def event(self, event: Mapping[str, Any]) -> None:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise Gone()
            raise ValueError(f"watch error: {obj.get('message') or obj}")
        meta = obj.get("metadata") or {}
        if kind in ("ADDED", "MODIFIED"):
            self.slices[meta["name"]] = obj
        elif kind == "DELETED":
            self.slices.pop(meta.get("name", ""), None)
        elif kind != "BOOKMARK":
            raise ValueError(f"watch event of unknown type {kind!r}")
        self.version = meta.get("resourceVersion", self.version)
        if kind != "BOOKMARK":
            self.changed()
