"""`--connector kubernetes`: the planner sets the replicas of the prefill and decode Deployments
(deploy/kubernetes) through their scale subresource.

A scale-up sets the replicas; the Deployment's pods take load when their readiness probe says so
(the router admits ready endpoints only). A scale-down removes one pod of a role at a time, and
the one the planner chose, in the order that loses nothing: the router forgets it (no new
request), it is marked `controller.kubernetes.io/pod-deletion-cost` lowest (the ReplicaSet
deletes it, not another), the replicas drop by one, and the pod drains on its own (preStop pause,
then SIGTERM: a decode worker's streams migrate, a prefill worker finishes its prefills) within
its grace period. No other scale-down of that role while one of its pods terminates. Where the
pod's URL is unknown (not ready yet), the ReplicaSet's own order applies: unready pods first.
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from pd.kube_api import KubeAPI
from pd.planner.connector import Connector
from pd.planner.decide import ROLES, Decision
from pd.planner.signals import Observation
from pd.registration import RegistrationError, deregister_from_router

log = logging.getLogger("pd.planner")

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
LEAST_COST = "-1000"  # below every pod's default (0)


class KubernetesConnector(Connector):
    name = "kubernetes"

    def __init__(
        self,
        api: KubeAPI,
        deployments: dict[str, str],  # role -> Deployment name
        router_url: str | None = None,
        admin_token: str | None = None,
    ) -> None:
        self.api = api
        self.deployments = deployments
        self.router_url = router_url
        self.admin_token = admin_token
        self._pending = {r: {"starting": 0, "leaving": 0} for r in ROLES}

    def pending(self) -> dict[str, dict[str, int]]:
        return {r: dict(v) for r, v in self._pending.items()}

    def _path(self, role: str) -> str:
        ns = self.api.namespace
        return f"/apis/apps/v1/namespaces/{ns}/deployments/{self.deployments[role]}/scale"

    async def apply(self, decision: Decision, obs: Observation) -> list[str]:
        actions: list[str] = []
        async with aiohttp.ClientSession() as http:
            for role, want in (("prefill", decision.prefill), ("decode", decision.decode)):
                actions += await self._role(http, role, want, obs)
        return actions

    async def _role(
        self, http: aiohttp.ClientSession, role: str, want: int, obs: Observation
    ) -> list[str]:
        scale = await self.api.request(http, "GET", self._path(role))
        have = int(scale.get("spec", {}).get("replicas", 0))
        pods = await self._pods(http, scale.get("status", {}).get("selector", ""))
        leaving = [p for p in pods if p["metadata"].get("deletionTimestamp")]
        alive = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        ready_urls = {w.url for w in obs.of(role)}
        self._pending[role] = {
            "starting": sum(_url_of(p, ready_urls) is None for p in alive),
            "leaving": len(leaving),
        }
        name = self.deployments[role]
        if want > have:
            await self._set(http, role, want)
            return [f"{role}: deployment {name} scaled {have} -> {want}"]
        if want >= have or leaving:
            return []
        actions = []
        victim = self._choose(role, alive, obs)
        if victim is not None:
            pod, url = victim
            if url is not None and self.router_url is not None:
                try:  # the router stops sending to it at once
                    await deregister_from_router(self.router_url, url, self.admin_token, http)
                except RegistrationError as e:  # its endpoint's removal does it too
                    log.warning("router did not forget %s: %s", url, e)
            await self.api.request(
                http,
                "PATCH",
                f"/api/v1/namespaces/{self.api.namespace}/pods/{pod['metadata']['name']}",
                patch={"metadata": {"annotations": {DELETION_COST: LEAST_COST}}},
            )
            actions.append(f"{role}: pod {pod['metadata']['name']} ({url}) chosen to drain")
        await self._set(http, role, have - 1)
        return [*actions, f"{role}: deployment {name} scaled {have} -> {have - 1}"]

    def _choose(
        self, role: str, pods: list[dict[str, Any]], obs: Observation
    ) -> tuple[dict[str, Any], str | None] | None:
        """The pod to remove: one not serving yet, else the ready worker with the fewest rows
        (the fewest streams to move)."""
        ready = {w.url: w for w in obs.of(role)}
        found = [(p, _url_of(p, set(ready))) for p in pods]
        unready = [(p, u) for p, u in found if u is None]
        if unready:
            return unready[0]
        if not found:
            return None
        return min(found, key=lambda pu: ready[pu[1]].running if pu[1] else 0)

    async def _pods(self, http: aiohttp.ClientSession, selector: str) -> list[dict[str, Any]]:
        got = await self.api.request(
            http,
            "GET",
            f"/api/v1/namespaces/{self.api.namespace}/pods",
            params={"labelSelector": selector},
        )
        return list(got.get("items") or [])

    async def _set(self, http: aiohttp.ClientSession, role: str, replicas: int) -> None:
        await self.api.request(
            http, "PATCH", self._path(role), patch={"spec": {"replicas": replicas}}
        )
        log.info("%s: deployment %s replicas %d", role, self.deployments[role], replicas)


def _url_of(pod: dict[str, Any], urls: set[str]) -> str | None:
    """The ready worker URL on this pod's IP (None: not a ready worker)."""
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    return next((u for u in urls if urlsplit(u).hostname == ip), None)
