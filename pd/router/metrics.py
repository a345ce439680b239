"""Prometheus metrics of the router, on a registry of its own (one per app).

Hot-path NOTE: labelled children are looked up once and cached in dicts; per-worker gauges are
read from the registry at scrape time by a collector, so routing never touches them.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pd.router.registry import Registry

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
)


class _WorkerCollector(Collector):
    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def collect(self) -> Iterable[Metric]:
        labels = ["pool", "worker"]
        inflight = GaugeMetricFamily(
            "pd_router_worker_inflight", "Requests the router has in flight on a worker", labels=labels
        )
        healthy = GaugeMetricFamily(
            "pd_router_worker_healthy", "1 when the worker is admitted, 0 when ejected", labels=labels
        )
        queued = GaugeMetricFamily(
            "pd_router_worker_queued_prefill_tokens", "Queued prefill tokens a worker reported",
            labels=labels,
        )
        running = GaugeMetricFamily(
            "pd_router_worker_running", "Running requests a worker reported", labels=labels
        )
        kv = GaugeMetricFamily(
            "pd_router_worker_kv_usage", "KV cache usage (0..1) a worker reported", labels=labels
        )
        for w in self.registry:
            lv = [w.role, w.url]
            inflight.add_metric(lv, w.inflight)
            healthy.add_metric(lv, 1.0 if w.healthy else 0.0)
            if w.load is not None:
                queued.add_metric(lv, w.load.queued_prefill_tokens)
                running.add_metric(lv, w.load.running)
                kv.add_metric(lv, w.load.kv_usage)
        return [inflight, healthy, queued, running, kv]


class RouterMetrics:
    def __init__(self, registry: Registry) -> None:
        self.prom = CollectorRegistry()
        r = self.prom
        self._requests = Counter(
            "pd_router_requests", "Client requests by outcome status, route and policy",
            ["status", "route", "policy"], registry=r,
        )
        self._ttft = Histogram(
            "pd_router_ttft_seconds", "Arrival to first byte to the client (stream) or first "
            "token from the worker (no stream)", ["route"], buckets=LATENCY_BUCKETS, registry=r,
        )
        self._e2e = Histogram(
            "pd_router_e2e_seconds", "Arrival to the end of the answer", ["route"],
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self._prefill = Histogram(
            "pd_router_prefill_seconds", "Time the prefill worker took to answer", [],
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self._retries = Counter(
            "pd_router_retries", "Requests sent again to another worker", ["pool"], registry=r
        )
        self._ejections = Counter(
            "pd_router_ejections", "Workers ejected from a pool", ["pool"], registry=r
        )
        self._health_failures = Counter(
            "pd_router_health_check_failures", "Failed health checks", ["pool"], registry=r
        )
        r.register(_WorkerCollector(registry))
        self.policies = {name: pool.policy.name for name, pool in registry.pools.items()}
        self.policies["pd"] = f"{self.policies['prefill']}/{self.policies['decode']}"
        self._req_children: dict[tuple[str, str], Counter] = {}
        self._ttft_children = {route: self._ttft.labels(route) for route in ("pd", "both")}
        self._e2e_children = {route: self._e2e.labels(route) for route in ("pd", "both", "none")}
        self.retries = {p: self._retries.labels(p) for p in registry.pools}
        self.ejections = {p: self._ejections.labels(p) for p in registry.pools}
        self.health_failures = {p: self._health_failures.labels(p) for p in registry.pools}
        self.prefill_seconds = self._prefill

    def request_done(
        self, status: str, route: str, ttft: float | None, e2e: float
    ) -> None:
        child = self._req_children.get((status, route))
        if child is None:
            policy = self.policies.get(route, "none")
            child = self._req_children[(status, route)] = self._requests.labels(status, route, policy)
        child.inc()
        if ttft is not None:
            self._ttft_children[route].observe(ttft)
        self._e2e_children[route].observe(e2e)

    def render(self) -> bytes:
        return generate_latest(self.prom)
