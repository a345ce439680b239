"""deploy/kubernetes (issue 44): every overlay renders (`kubectl kustomize`), each object passes
`kubernetes-validate --strict` against the API's schemas, and every flag, port and probe path the
manifests name exists in pd: the args parse with pd-router's and pd-worker's own parsers, the
probes name the container's ports and the routes the servers serve."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from typing import Any

import pytest
import yaml

from pd.planner.main import parse_config as parse_planner
from pd.router.app import make_app
from pd.router.config import RouterConfig
from pd.router.main import parse_config
from pd.worker.main import parse_args

PLANNER_PATHS = {"/health", "/metrics"}  # pd/planner/service.py

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
KUSTOMIZE = os.path.join(ROOT, "deploy", "kubernetes")
OVERLAYS = sorted(os.listdir(os.path.join(KUSTOMIZE, "overlays")))
K8S_VERSION = "1.33.0"  # a version every maintained cluster has reached
CRD_GROUPS = ("inference.networking.k8s.io", "gateway.networking.k8s.io")

needs_kubectl = pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl renders the overlays (not installed)"
)


def render(overlay: str) -> list[dict[str, Any]]:
    out = subprocess.run(
        ["kubectl", "kustomize", os.path.join(KUSTOMIZE, "overlays", overlay)],
        check=True, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def containers(objects: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], int]]:
    """(deployment, container, its pod's termination grace seconds)."""
    return [
        (o["metadata"]["name"], c, o["spec"]["template"]["spec"]["terminationGracePeriodSeconds"])
        for o in objects
        if o["kind"] == "Deployment"
        for c in o["spec"]["template"]["spec"]["containers"]
    ]


def test_there_are_overlays_for_cpu_gpu_either_autoscaler_and_the_gateway() -> None:
    assert {"cpu", "gpu", "hpa", "planner", "gie"} <= set(OVERLAYS)


@needs_kubectl
def test_the_gateway_kinds_have_their_required_fields() -> None:
    """InferencePool (GIE v1) and HTTPRoute (Gateway API v1) have no schema in
    kubernetes-validate: their CRDs' required fields, and that they point at what exists."""
    objects = render("gie")
    by_kind = {o["kind"]: o for o in objects}
    pool, route = by_kind["InferencePool"], by_kind["HTTPRoute"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    assert set(spec) >= {"selector", "targetPorts", "endpointPickerRef"}
    assert spec["selector"]["matchLabels"]  # v1: matchLabels only
    assert 1 <= len(spec["targetPorts"]) <= 8 and all(
        1 <= p["number"] <= 65535 for p in spec["targetPorts"]
    )
    epp = spec["endpointPickerRef"]
    assert epp["failureMode"] in ("FailOpen", "FailClose") and epp["port"]["number"]
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    picker = services[epp["name"]]  # the picker's Service, to the router's gRPC port
    assert epp["port"]["number"] in [p["port"] for p in picker["spec"]["ports"]]
    router = next(c for n, c, _ in containers(objects) if c["command"] == ["pd-router"])
    assert "--endpoint-picker" in router["args"]
    assert f"--picker-port={epp['port']['number']}" in router["args"]
    decode = next(
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "pd-decode"
    )
    labels = decode["spec"]["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    worker = decode["spec"]["template"]["spec"]["containers"][0]
    assert spec["targetPorts"][0]["number"] in [p["containerPort"] for p in worker["ports"]]
    # D takes the picker's named P only from its own watch of the prefill workers' slices: the
    # router's selector, read with a service account allowed to list and watch them.
    selector = "--prefill-peer-selector=kubernetes.io/service-name=pd-prefill"
    assert selector in worker["args"]
    assert "--k8s-prefill-selector=" + selector.split("=", 1)[1] in router["args"]
    account = decode["spec"]["template"]["spec"]["serviceAccountName"]
    (binding,) = [
        o for o in objects
        if o["kind"] == "RoleBinding" and {"kind": "ServiceAccount", "name": account} in o["subjects"]
    ]  # fmt: skip
    (role,) = [
        o
        for o in objects
        if o["kind"] == "Role" and o["metadata"]["name"] == binding["roleRef"]["name"]
    ]
    assert any(
        "endpointslices" in r["resources"] and {"list", "watch"} <= set(r["verbs"])
        for r in role["rules"]
    )
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["spec"]["parentRefs"] and route["spec"]["rules"]
    backend = route["spec"]["rules"][0]["backendRefs"][0]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io",
        "InferencePool",
        pool["metadata"]["name"],
    )


@needs_kubectl
def test_hpa_and_the_planner_never_both_scale_a_deployment() -> None:
    for overlay in OVERLAYS:
        objects = render(overlay)
        hpa = any(o["kind"] == "HorizontalPodAutoscaler" for o in objects)
        planner = any(c["command"] == ["pd-planner"] for _, c, _ in containers(objects))
        assert not (hpa and planner), overlay


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_is_valid_against_the_api_schemas(overlay: str) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="pip install 'pd[k8s]'")
    objects = render(overlay)
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "Service", "PodDisruptionBudget", "Role"} <= kinds, kinds
    for o in objects:
        if o["apiVersion"].split("/")[0] in CRD_GROUPS:
            continue  # no built-in schema: test_the_gateway_kinds_have_their_required_fields
        kv.validate(o, K8S_VERSION, strict=True)
    # the check itself can fail: a misspelt field is refused
    bad = next(o for o in objects if o["kind"] == "Deployment")
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, K8S_VERSION, strict=True)


def _routes_of_the_worker() -> set[str]:
    with open(os.path.join(ROOT, "pd", "worker", "api", "server.py")) as f:
        return set(re.findall(r'add_get\("(/[^"]*)"', f.read()))


@needs_kubectl
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_flag_port_and_probe_path_exists(overlay: str) -> None:
    router_paths = {r.resource.canonical for r in make_app(RouterConfig()).router.routes()}
    worker_paths = _routes_of_the_worker()
    assert "/ready" in worker_paths and "/health" in worker_paths
    seen = set()
    objects = render(overlay)
    for name, c, grace in containers(objects):
        command = c["command"][0]
        seen.add(command)
        env = {e["name"] for e in c.get("env", [])}
        # $(VAR) is the kubelet's: each must be a variable of the container
        args = []
        for a in c["args"]:
            for var in re.findall(r"\$\((\w+)\)", a):
                assert var in env, (name, var)
            args.append(re.sub(r"\$\(\w+\)", "10.1.2.3", a))
        if command == "pd-router":
            cfg = parse_config(args)
            port, paths = cfg.port, router_paths
            assert cfg.k8s_selectors, name
        elif command == "pd-planner":
            pcfg = parse_planner(args)
            port, paths = pcfg.port, PLANNER_PATHS
            assert pcfg.connector == "kubernetes" and pcfg.router == "http://pd-router:8000"
            deployments = {o["metadata"]["name"] for o in objects if o["kind"] == "Deployment"}
            assert {pcfg.k8s_prefill_deployment, pcfg.k8s_decode_deployment} <= deployments
        elif command == "pd-worker":
            wcfg = parse_args(args)
            port, paths = wcfg.port, worker_paths
            assert wcfg.advertise_url == f"http://10.1.2.3:{wcfg.port}", name
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            assert ports.get("kv-bootstrap") == wcfg.bootstrap_port, name
            # the drain (after the preStop's pause) ends before the kubelet's SIGKILL
            pause = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
            assert pause + wcfg.drain_timeout_s < grace, (name, pause, wcfg.drain_timeout_s, grace)
        else:
            raise AssertionError(f"{name}: unknown command {command}")
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["http"] == port, name
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if probe in c:
                get = c[probe]["httpGet"]
                assert get["port"] in ports and get["path"] in paths, (name, probe, get)
        if command == "pd-worker":
            assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
            assert c["livenessProbe"]["httpGet"]["path"] == "/health"
            for secret in c.get("env", []):
                if "valueFrom" in secret and "secretKeyRef" in secret["valueFrom"]:
                    assert secret["name"] == "PD_CLUSTER_TOKEN"
    assert {"pd-router", "pd-worker"} <= seen
