"""An in-process double of the Kubernetes API: EndpointSlices (list and watch), Deployments' scale
subresource and Pods (list, merge-patch), with a ReplicaSet controller's part of it (pods made
and deleted to the replicas, the lowest `pod-deletion-cost` deleted first). It serves them as the
API server does: one resourceVersion counter, a list's version to watch from, `ADDED`/`MODIFIED`/
`DELETED` events after it, `BOOKMARK`s when asked (`allowWatchBookmarks`), a watch ended after
`timeoutSeconds`, an `ERROR` event of a `410` Status for a version compacted away (`compact()`),
equality label selectors, and outages (`down`: 503) and cut connections (`cut_watches()`).

tests/router/test_discovery_kubernetes.py and tests/planner/test_kubernetes_connector.py drive
it with the official `kubernetes` client's
`watch.Watch` too, so that it speaks the API and not only pd's assumptions."""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

from aiohttp import web

GROUP = "/apis/discovery.k8s.io/v1"
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
# the patches the API takes that are the same for these flat fields (a JSON patch is not served)
PATCHES = ("application/merge-patch+json", "application/strategic-merge-patch+json")


def endpoint_slice(
    name: str, service: str, port: int, addresses: list[str], ready: bool = True, **labels: str
) -> dict[str, Any]:
    """A valid discovery.k8s.io/v1 EndpointSlice of `service` (its label, as the controller
    sets it), one endpoint an address."""
    terminating = not ready
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "labels": {"kubernetes.io/service-name": service, **labels},
        },
        "addressType": "IPv4",
        "endpoints": [
            {
                "addresses": [a],
                "conditions": {"ready": ready, "serving": True, "terminating": terminating},
                "targetRef": {"kind": "Pod", "name": f"{name}-{i}"},
            }
            for i, a in enumerate(addresses)
        ],
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
    }


def _matches(labels: dict[str, str], selector: str) -> bool:
    for term in (t.strip() for t in selector.split(",") if t.strip()):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        else:
            k, v = term.replace("==", "=").split("=", 1)
            if labels.get(k.strip()) != v.strip():
                return False
    return True


class KubeAPIDouble:
    def __init__(self, namespace: str = "pd", bookmark_s: float = 0.2) -> None:
        self.namespace = namespace
        self.bookmark_s = bookmark_s
        self.version = 1000
        self.objects: dict[str, dict[str, Any]] = {}
        self.events: list[tuple[int, str, dict[str, Any]]] = []
        self.compacted = 0  # versions up to this one are gone: a watch from them gets 410
        self.down = False  # answer 503, as an API server restarting
        self.lists = 0
        self.watches = 0
        self.bookmarks = 0
        self._changed = asyncio.Event()
        self._open: set[web.StreamResponse] = set()
        self.deployments: dict[str, int] = {}  # name -> replicas
        self.pods: dict[str, dict[str, Any]] = {}
        self.scale_patches: list[tuple[str, int]] = []
        self._made = 0

    # ------------------------------------------------------------------ the cluster's side

    def put(self, obj: dict[str, Any]) -> None:
        obj = copy.deepcopy(obj)
        name = obj["metadata"]["name"]
        kind = "MODIFIED" if name in self.objects else "ADDED"
        self._event(kind, obj)
        self.objects[name] = obj

    def delete(self, name: str) -> None:
        obj = self.objects.pop(name)
        self._event("DELETED", copy.deepcopy(obj))

    def compact(self) -> None:
        self.compacted = self.version

    async def cut_watches(self) -> None:
        """Drop every open watch's connection (an API server's restart, a proxy's timeout)."""
        for resp in list(self._open):
            transport = resp._req.transport if resp._req is not None else None
            if transport is not None:
                transport.close()

    def _event(self, kind: str, obj: dict[str, Any]) -> None:
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        obj["metadata"]["namespace"] = self.namespace
        self.events.append((self.version, kind, obj))
        self._changed.set()
        self._changed = asyncio.Event()

    # ------------------------------------------------------------------ the API's side

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get(f"{GROUP}/namespaces/{{ns}}/endpointslices", self._handle)
        scale = "/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale"
        app.router.add_get(scale, self._scale)
        app.router.add_patch(scale, self._scale)
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self._pods)
        app.router.add_patch("/api/v1/namespaces/{ns}/pods/{name}", self._pod_patch)
        return app

    # ------------------------------------------------------------------ Deployments and Pods

    def deployment(self, name: str, replicas: int) -> None:
        """A Deployment of pods labelled app.kubernetes.io/name=NAME, reconciled at once."""
        self.deployments[name] = replicas
        self._reconcile(name)

    def pods_of(self, name: str, terminating: bool | None = None) -> list[dict[str, Any]]:
        return [
            p for p in self.pods.values()
            if p["metadata"]["labels"]["app.kubernetes.io/name"] == name
            and (terminating is None or bool(p["metadata"].get("deletionTimestamp")) == terminating)
        ]  # fmt: skip

    def finish_terminations(self) -> None:
        """The terminating pods' drains end: they are gone."""
        for pod in [p for p in self.pods.values() if p["metadata"].get("deletionTimestamp")]:
            del self.pods[pod["metadata"]["name"]]

    def _reconcile(self, name: str) -> None:
        alive = self.pods_of(name, terminating=False)
        want = self.deployments[name]
        while len(alive) < want:
            self._made += 1
            pod = {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": f"{name}-{self._made}", "namespace": self.namespace,
                             "labels": {"app.kubernetes.io/name": name}, "annotations": {},
                             "resourceVersion": str(self.version)},
                "spec": {"containers": [{"name": "worker", "image": "pd"}]},
                "status": {"phase": "Running", "podIP": f"10.0.{self._made // 250}.{self._made % 250 + 1}"},
            }  # fmt: skip
            self.pods[pod["metadata"]["name"]] = pod
            alive.append(pod)
        # a ReplicaSet deletes the lowest pod-deletion-cost first (then the newest)
        alive.sort(key=lambda p: (int(p["metadata"]["annotations"].get(DELETION_COST, "0")),
                                  -int(p["metadata"]["name"].rsplit("-", 1)[1])))  # fmt: skip
        for pod in alive[: max(0, len(alive) - want)]:
            pod["metadata"]["deletionTimestamp"] = "2026-12-07T00:00:00Z"

    async def _scale(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if self.down:
            return web.json_response(
                _status(503, "ServiceUnavailable", "the API is down"), status=503
            )
        if request.match_info["ns"] != self.namespace or name not in self.deployments:
            return web.json_response(
                _status(404, "NotFound", f'deployments.apps "{name}" not found'), status=404
            )
        if request.method == "PATCH":
            if request.content_type not in PATCHES:
                return web.json_response(
                    _status(415, "UnsupportedMediaType", request.content_type), status=415
                )
            body = await request.json()
            self.deployments[name] = int(body["spec"]["replicas"])
            self.scale_patches.append((name, self.deployments[name]))
            self._reconcile(name)
        n = self.deployments[name]
        return web.json_response({
            "apiVersion": "autoscaling/v1", "kind": "Scale",
            "metadata": {"name": name, "namespace": self.namespace, "resourceVersion": str(self.version)},
            "spec": {"replicas": n},
            "status": {"replicas": len(self.pods_of(name)), "selector": f"app.kubernetes.io/name={name}"},
        })  # fmt: skip

    async def _pods(self, request: web.Request) -> web.Response:
        selector = request.query.get("labelSelector", "")
        items = [p for p in self.pods.values() if _matches(p["metadata"]["labels"], selector)]
        return web.json_response({"apiVersion": "v1", "kind": "PodList",
                                  "metadata": {"resourceVersion": str(self.version)}, "items": items})  # fmt: skip

    async def _pod_patch(self, request: web.Request) -> web.Response:
        pod = self.pods.get(request.match_info["name"])
        if pod is None:
            return web.json_response(_status(404, "NotFound", "pod not found"), status=404)
        if request.content_type not in PATCHES:
            return web.json_response(
                _status(415, "UnsupportedMediaType", request.content_type), status=415
            )
        body = await request.json()
        pod["metadata"]["annotations"].update((body.get("metadata") or {}).get("annotations") or {})
        return web.json_response(pod)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if self.down:
            return web.json_response(
                _status(503, "ServiceUnavailable", "the API is down"), status=503
            )
        if request.match_info["ns"] != self.namespace:
            return web.json_response({"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
                                      "metadata": {"resourceVersion": str(self.version)}, "items": []})  # fmt: skip
        selector = request.query.get("labelSelector", "")
        if request.query.get("watch") in ("true", "1"):
            return await self._watch(request, selector)
        self.lists += 1
        items = [o for o in self.objects.values() if _matches(o["metadata"]["labels"], selector)]
        return web.json_response({
            "kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
            "metadata": {"resourceVersion": str(self.version)}, "items": items,
        })  # fmt: skip

    async def _watch(self, request: web.Request, selector: str) -> web.StreamResponse:
        self.watches += 1
        since = request.query.get("resourceVersion", "")
        timeout = float(request.query.get("timeoutSeconds", "1800"))
        bookmarks = request.query.get("allowWatchBookmarks") in ("true", "1")
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        self._open.add(resp)
        try:

            async def send(kind: str, obj: dict[str, Any]) -> None:
                await resp.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")

            if since in ("", "0"):  # no version: the current objects as ADDED, then changes
                for o in list(self.objects.values()):
                    if _matches(o["metadata"]["labels"], selector):
                        await send("ADDED", o)
                seen = self.version
            elif int(since) < self.compacted:
                await send(
                    "ERROR",
                    _status(
                        410, "Expired", f"too old resource version: {since} ({self.compacted})"
                    ),
                )
                return resp
            else:
                seen = int(since)
            loop = asyncio.get_running_loop()
            end = loop.time() + timeout
            while loop.time() < end:
                for version, kind, obj in [e for e in self.events if e[0] > seen]:
                    if _matches(obj["metadata"]["labels"], selector):
                        await send(kind, obj)
                    seen = version
                waited = self._changed
                try:
                    await asyncio.wait_for(
                        waited.wait(), min(self.bookmark_s, max(0.0, end - loop.time()))
                    )
                except TimeoutError:
                    if bookmarks and loop.time() < end and self.version == seen:
                        self.bookmarks += 1
                        await send("BOOKMARK", {
                            "kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
                            "metadata": {"resourceVersion": str(seen)},
                            "addressType": "IPv4", "endpoints": [],
                        })  # fmt: skip
            await resp.write_eof()
        except (ConnectionResetError, RuntimeError):
            pass  # the client went, or the connection was cut
        finally:
            self._open.discard(resp)
        return resp


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}  # fmt: skip
