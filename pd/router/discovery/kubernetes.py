"""`--discovery kubernetes`: the workers behind EndpointSlices, found by a label selector per role
(typically `kubernetes.io/service-name=<the role's headless Service>`), listed and then watched as
the API serves them: from the list's resourceVersion, with bookmarks; a watch that ends is
resumed from the last version seen; `410 Gone` (the version was compacted) lists again; an API
outage keeps the workers there are and retries with a backoff.

An endpoint whose `ready` condition is false (starting, failing its readiness probe, draining or
terminating) leaves the router: it gets no new request, and the streams it serves finish (issue
26's meaning of readiness). The API is reached as pd/kube_api.py says."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import aiohttp

from pd.kube_api import KubeAPI
from pd.kube_slices import WATCH_TIMEOUT_S, SliceWatch
from pd.router.discovery.sync import WorkerSet
from pd.router.registry import Registry


class KubernetesDiscovery:
    """The router's workers from the EndpointSlices of each role's selector."""

    def __init__(
        self,
        api: KubeAPI,
        selectors: Mapping[str, str],  # role -> label selector
        registry: Registry,
        port_name: str = "http",
        watch_timeout_s: int = WATCH_TIMEOUT_S,
    ) -> None:
        self.workers = WorkerSet(registry, "discovery kubernetes")
        self.watches = {
            role: SliceWatch(api, sel, port_name, self._apply, watch_timeout_s)
            for role, sel in selectors.items()
        }

    def _apply(self) -> None:
        if not all(w.synced for w in self.watches.values()):
            return  # a partial view would remove the roles not listed yet
        self.workers.apply({u: role for role, w in self.watches.items() for u in w.urls()})

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            await asyncio.gather(*(w.run(http) for w in self.watches.values()))
