"""The Kubernetes API as pd reaches it (plain aiohttp, no client package): where the API server
is, and its credentials. In a pod, the service account's token (read again at each request:
projected tokens rotate), CA and namespace; outside, `--k8s-api`. Shared by the router's
discovery (pd/router/discovery/kubernetes.py) and the planner's connector
(pd/planner/kubernetes.py)."""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from typing import Any

import aiohttp

SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


class Gone(Exception):
    """410: the resourceVersion was compacted away; list again."""


class KubeError(Exception):
    """The API answered with an error status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


@dataclass(frozen=True)
class KubeAPI:
    """Where the API server is and how to authenticate to it."""

    base: str  # https://host:port (no trailing slash)
    namespace: str
    token_file: str | None = None  # read at each connection
    ca_file: str | None = None

    @classmethod
    def from_flags(cls, api: str | None, namespace: str | None) -> KubeAPI:
        """`--k8s-api` (default: the pod's API server), `--k8s-namespace` (default: the pod's)."""
        token = os.path.join(SERVICE_ACCOUNT, "token")
        ca = os.path.join(SERVICE_ACCOUNT, "ca.crt")
        if api is None:
            host, port = (
                os.environ.get("KUBERNETES_SERVICE_HOST"),
                os.environ.get("KUBERNETES_SERVICE_PORT", "443"),
            )
            if not host:
                raise ValueError(
                    "the Kubernetes API outside a pod needs --k8s-api URL (no "
                    "KUBERNETES_SERVICE_HOST)"
                )
            api = f"https://{host}:{port}"
        if namespace is None:
            try:
                with open(os.path.join(SERVICE_ACCOUNT, "namespace")) as f:
                    namespace = f.read().strip()
            except OSError:
                namespace = "default"
        return cls(
            api.rstrip("/"),
            namespace,
            token if os.path.exists(token) else None,
            ca if os.path.exists(ca) else None,
        )

    def headers(self) -> dict[str, str]:
        if self.token_file is None:
            return {}
        with open(self.token_file) as f:
            return {"Authorization": f"Bearer {f.read().strip()}"}

    def ssl_context(self) -> ssl.SSLContext | None:
        return ssl.create_default_context(cafile=self.ca_file) if self.ca_file else None

    def slices_url(self) -> str:
        return f"{self.base}{self.slices_path()}"

    def slices_path(self) -> str:
        return f"/apis/discovery.k8s.io/v1/namespaces/{self.namespace}/endpointslices"

    async def request(
        self,
        http: aiohttp.ClientSession,
        method: str,
        path: str,
        *,
        params: dict[str, str] | None = None,
        patch: dict[str, Any] | None = None,
    ) -> Any:
        """One call to the API: its JSON answer, or KubeError (410: Gone). `patch` is sent as a
        JSON merge patch."""
        headers = self.headers()
        if patch is not None:
            headers["Content-Type"] = "application/merge-patch+json"
        async with http.request(
            method,
            f"{self.base}{path}",
            params=params,
            json=patch,
            headers=headers,
            ssl=self.ssl_context(),
            timeout=aiohttp.ClientTimeout(total=30),
        ) as r:
            if r.status == 410:
                raise Gone()
            if r.status >= 300:
                raise KubeError(r.status, (await r.text())[:300])
            return await r.json()
