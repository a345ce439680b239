"""`pd-planner --connector kubernetes` against the API double (tests/kube_api.py): a scale-up
sets the Deployment's replicas through its scale subresource; a scale-down takes the pod the
planner chose (the router forgets it, it is marked with the lowest pod-deletion-cost, and the
ReplicaSet deletes that one), one at a time a role; the official client reads the same scale
(issue 44)."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from pd.kube_api import KubeAPI
from pd.planner import Decision
from pd.planner.kubernetes import DELETION_COST, KubernetesConnector
from pd.planner.signals import Observation, WorkerSignals
from tests.kube_api import KubeAPIDouble


def _obs(double: KubeAPIDouble, running: dict[str, int]) -> Observation:
    """The ready workers of the double's alive pods (their IPs), with the rows given by pod."""
    workers = []
    for role in ("prefill", "decode"):
        for pod in double.pods_of(f"pd-{role}", terminating=False):
            name = pod["metadata"]["name"]
            workers.append(WorkerSignals(f"http://{pod['status']['podIP']}:8100", role, True,
                                         running=running.get(name, 0)))  # fmt: skip
    return Observation(0.0, tuple(workers))


async def _router(aiohttp_server, forgotten: list[str]) -> str:
    async def remove(request: web.Request) -> web.Response:
        assert request.headers.get("Authorization") == "Bearer admin"
        forgotten.append(request.query["url"])
        return web.json_response({"removed": {"url": request.query["url"]}})

    app = web.Application()
    app.router.add_delete("/workers", remove)
    return str((await aiohttp_server(app)).make_url("")).rstrip("/")


async def test_scale_up_then_down_the_chosen_pod_one_at_a_time(aiohttp_server):
    double = KubeAPIDouble()
    double.deployment("pd-prefill", 1)
    double.deployment("pd-decode", 1)
    api = KubeAPI(str((await aiohttp_server(double.app())).make_url("")).rstrip("/"), "pd")
    forgotten: list[str] = []
    router = await _router(aiohttp_server, forgotten)
    c = KubernetesConnector(api, {"prefill": "pd-prefill", "decode": "pd-decode"}, router, "admin")
    did = await c.apply(Decision(0, 1, 3, ("test",)), _obs(double, {}))
    assert did == ["decode: deployment pd-decode scaled 1 -> 3"]
    assert double.deployments == {"pd-prefill": 1, "pd-decode": 3}
    assert double.scale_patches == [("pd-decode", 3)]
    # the busiest two stay: the one with the fewest rows goes
    pods = [p["metadata"]["name"] for p in double.pods_of("pd-decode")]
    rows = dict(zip(pods, (9, 2, 7)))
    did = await c.apply(Decision(1, 1, 1, ("test",)), _obs(double, rows))
    chosen = pods[1]
    ip = double.pods[chosen]["status"]["podIP"]
    assert did == [
        f"decode: pod {chosen} (http://{ip}:8100) chosen to drain",
        "decode: deployment pd-decode scaled 3 -> 2",
    ]
    assert forgotten == [f"http://{ip}:8100"]  # the router first
    assert double.pods[chosen]["metadata"]["annotations"][DELETION_COST] == "-1000"
    assert [p["metadata"]["name"] for p in double.pods_of("pd-decode", terminating=True)] == [
        chosen
    ]  # the ReplicaSet took the marked pod, not the newest
    # while it drains, no other goes
    assert await c.apply(Decision(2, 1, 1, ("test",)), _obs(double, rows)) == []
    assert c.pending()["decode"] == {"starting": 0, "leaving": 1}
    double.finish_terminations()
    did = await c.apply(Decision(3, 1, 1, ("test",)), _obs(double, rows))
    assert did[-1] == "decode: deployment pd-decode scaled 2 -> 1"
    assert len(forgotten) == 2 and double.deployments["pd-decode"] == 1


async def test_a_pod_not_serving_yet_goes_first_and_an_api_error_is_raised(aiohttp_server):
    double = KubeAPIDouble()
    double.deployment("pd-prefill", 2)
    double.deployment("pd-decode", 1)
    api = KubeAPI(str((await aiohttp_server(double.app())).make_url("")).rstrip("/"), "pd")
    c = KubernetesConnector(api, {"prefill": "pd-prefill", "decode": "pd-decode"})
    ready_one = _obs(double, {})
    ready_one = Observation(0.0, tuple(w for w in ready_one.workers if w.url.endswith("1:8100")
                                       or w.role == "decode"))  # fmt: skip
    assert c.pending()["prefill"]["starting"] == 0
    did = await c.apply(Decision(0, 1, 1, ("test",)), ready_one)
    unready = next(p for p in double.pods_of("pd-prefill")
                   if not p["status"]["podIP"].endswith(".1"))  # fmt: skip
    assert did[0] == f"prefill: pod {unready['metadata']['name']} (None) chosen to drain"
    assert unready["metadata"].get("deletionTimestamp")
    double.down = True
    with pytest.raises(Exception, match="503"):
        await c.apply(Decision(1, 2, 1, ("test",)), ready_one)


async def test_the_official_client_reads_and_patches_the_scale(aiohttp_server):
    k8s = pytest.importorskip("kubernetes", reason="the official client: pip install 'pd[k8s]'")
    double = KubeAPIDouble()
    double.deployment("pd-decode", 2)
    conf = k8s.client.Configuration()
    conf.host = str((await aiohttp_server(double.app())).make_url("")).rstrip("/")
    apps = k8s.client.AppsV1Api(k8s.client.ApiClient(conf))
    core = k8s.client.CoreV1Api(k8s.client.ApiClient(conf))

    def roundtrip() -> tuple[int, int, int]:
        before = apps.read_namespaced_deployment_scale("pd-decode", "pd")
        after = apps.patch_namespaced_deployment_scale("pd-decode", "pd", {"spec": {"replicas": 3}})
        pods = core.list_namespaced_pod("pd", label_selector=before.status.selector)
        return before.spec.replicas, after.spec.replicas, len(pods.items)

    assert await asyncio.to_thread(roundtrip) == (2, 3, 3)
