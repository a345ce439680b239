"""Prometheus metrics of the router, on a registry of its own (one per app).

Hot-path NOTE: the router's counters and histograms are plain ints and lists bumped on the
event loop (one thread, so no locks), and turned into Prometheus families only when
`/metrics` is scraped; per-worker gauges are read from the registry at scrape time. Routing a
request costs a few dict and list operations, no label lookups and no locks.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from pd.router.admission import CLASSES, Admission
from pd.router.hist import Hist
from pd.router.pairing import unpaired
from pd.router.picker import Picker
from pd.router.registry import Registry

# "local": decode-local prefill; "none": answered before a route was chosen (bad input, 503)
ROUTES = ("pd", "local", "both", "none")
MIGRATION_REASONS = ("broken", "eof", "ejected", "idle", "draining")
# A worker's connection broke before its first byte; a health check right after it: passed
# (the request may try one other worker) or failed (the worker is ejected, no retry).
DISCONNECT_OUTCOMES = ("alive", "dead")


class RouterMetrics(Collector):
    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.policies = {name: pool.policy.name for name, pool in registry.pools.items()}
        self.policies["pd"] = f"{self.policies['prefill']}/{self.policies['decode']}"
        self.policies["local"] = self.policies["decode"]
        self.requests: dict[tuple[str, str], int] = {}  # (status, route) -> count
        self.arrivals = 0  # client requests as they arrive (the planner's arrival rate)
        self.ttft = {route: Hist() for route in ROUTES}
        self.e2e = {route: Hist() for route in ROUTES}
        self.prefill = Hist()
        self.retries = dict.fromkeys(registry.pools, 0)
        self.ejections = dict.fromkeys(registry.pools, 0)
        self.health_failures = dict.fromkeys(registry.pools, 0)
        self.local_fallbacks = 0  # decode-local requests that failed first and went through P
        self.unpaired_refusals = 0  # PD requests refused: no healthy worker on the format needed
        self.prefill_releases = 0  # transfers P was told to drop: no decode worker will pull them
        self.prefill_release_failures = 0  # ... whose release P refused or never got
        # Prompt tokens the prefix index expected a worker to have cached, and what it reported,
        # summed over the answers that reported them (estimates vs the workers' counts).
        self.cached_expected = dict.fromkeys(registry.pools, 0)
        self.cached_actual = dict.fromkeys(registry.pools, 0)
        self.migrations: dict[str, int] = {}  # reason -> broken streams continued elsewhere
        self.migration_wait = Hist()  # from a break to the continuation's first byte
        self.disconnects = {(p, o): 0 for p in registry.pools for o in DISCONNECT_OUTCOMES}
        self.picker: Picker | None = None  # --endpoint-picker's decisions
        self.admission: Admission | None = None  # priority classes (admission.py)
        self.prom = CollectorRegistry()
        self.prom.register(self)

    def request_done(self, status: str, route: str, ttft: float | None, e2e: float) -> None:
        key = (status, route)
        self.requests[key] = self.requests.get(key, 0) + 1
        if ttft is not None:
            self.ttft[route].observe(ttft)
        self.e2e[route].observe(e2e)

    def cached_tokens(self, pool: str, expected: int, actual: int) -> None:
        self.cached_expected[pool] += expected
        self.cached_actual[pool] += actual

    def render(self) -> bytes:
        return generate_latest(self.prom)

    # ---------------------------------------------------------------------- exposition

    def collect(self) -> Iterable[Metric]:
        requests = CounterMetricFamily(
            "pd_router_requests",
            "Client requests by outcome status (499: the client went "
            "away; stream_error: cut after the first byte), route and policy",
            labels=["status", "route", "policy"],
        )
        for (status, route), n in sorted(self.requests.items()):
            requests.add_metric([status, route, self.policies.get(route, "none")], n)
        yield requests
        arrivals = CounterMetricFamily(
            "pd_router_arrivals",
            "Client requests as they arrived, before any check (the planner's arrival rate)",
        )
        arrivals.add_metric([], self.arrivals)
        yield arrivals
        if self.admission is not None:
            yield from _admission_families(self.admission)
        if self.picker is not None:
            decisions = CounterMetricFamily(
                "pd_router_picker_decisions",
                "--endpoint-picker: requests a worker was picked for (Envoy ext_proc)",
            )
            decisions.add_metric([], self.picker.decisions)
            yield decisions
            picks = CounterMetricFamily(
                "pd_router_picker_picks",
                "--endpoint-picker: picks by decode endpoint (ip:port)",
                labels=["endpoint"],
            )
            for endpoint, n in sorted(self.picker.picked.items()):
                picks.add_metric([endpoint], n)
            yield picks
            refusals = CounterMetricFamily(
                "pd_router_picker_refusals",
                "--endpoint-picker: requests answered by the picker itself (400, 503), by status",
                labels=["status"],
            )
            for code, n in sorted(self.picker.refusals.items()):
                refusals.add_metric([str(code)], n)
            yield refusals
        for name, doc, hists in (
            (
                "pd_router_ttft_seconds",
                "Arrival to the first byte to the client (stream) or the "
                "first token from the worker (no stream)",
                self.ttft,
            ),
            ("pd_router_e2e_seconds", "Arrival to the end of the answer", self.e2e),
        ):
            family = HistogramMetricFamily(name, doc, labels=["route"])
            for route, h in hists.items():
                family.add_metric([route], h.buckets(), h.sum)
            yield family
        prefill = HistogramMetricFamily(
            "pd_router_prefill_seconds", "Time the prefill worker took to answer"
        )
        prefill.add_metric([], self.prefill.buckets(), self.prefill.sum)
        yield prefill
        for name, doc, counts in (
            ("pd_router_retries", "Requests sent again to another worker", self.retries),
            ("pd_router_ejections", "Workers ejected from a pool", self.ejections),
            ("pd_router_health_check_failures", "Failed health checks", self.health_failures),
            (
                "pd_router_cached_tokens_expected",
                "Prompt tokens the router's prefix index expected workers to have cached "
                "(an estimate: bytes over the calibrated bytes per token)",
                self.cached_expected,
            ),
            (
                "pd_router_cached_tokens_actual",
                "Prompt tokens the same workers reported cached (usage.cached_tokens)",
                self.cached_actual,
            ),
        ):
            counter = CounterMetricFamily(name, doc, labels=["pool"])
            for pool_name, n in counts.items():
                counter.add_metric([pool_name], n)
            yield counter
        local = CounterMetricFamily(
            "pd_router_local_prefill_fallbacks",
            "Decode-local requests that failed before their first byte and went through P",
        )
        local.add_metric([], self.local_fallbacks)
        yield local
        releases = CounterMetricFamily(
            "pd_router_prefill_releases",
            "Prefilled KV that P was told to release because no decode worker would pull it",
        )
        releases.add_metric([], self.prefill_releases)
        yield releases
        release_failures = CounterMetricFamily(
            "pd_router_prefill_release_failures",
            "Releases P answered with an error or did not get (its lease frees the pages later)",
        )
        release_failures.add_metric([], self.prefill_release_failures)
        yield release_failures
        migrations = CounterMetricFamily(
            "pd_router_migrations",
            "Broken streams continued on another worker, by why they broke (broken: a "
            "connection error; eof: ended before [DONE]; ejected; idle: silent past "
            "--stream-idle-timeout-s; draining: the worker sent pd-migrate)",
            labels=["reason"],
        )
        for reason in sorted({*MIGRATION_REASONS, *self.migrations}):
            migrations.add_metric([reason], self.migrations.get(reason, 0))
        yield migrations
        wait = HistogramMetricFamily(
            "pd_router_migration_wait_seconds",
            "What the client waited at a migration: from the break to the continuation's "
            "first byte",
        )
        wait.add_metric([], self.migration_wait.buckets(), self.migration_wait.sum)
        yield wait
        disconnects = CounterMetricFamily(
            "pd_router_disconnects",
            "Worker connections that broke before the first byte of an answer, by the outcome "
            "of a health check right after (alive: one other worker may be tried; dead: the "
            "worker is ejected and the request not retried)",
            labels=["pool", "outcome"],
        )
        for (pool_name, outcome), n in self.disconnects.items():
            disconnects.add_metric([pool_name, outcome], n)
        yield disconnects
        decisions = CounterMetricFamily(
            "pd_router_policy_decisions",
            "Routing decisions by pool, policy and kind",
            labels=["pool", "policy", "decision"],
        )
        for name, pool in self.registry.pools.items():
            for decision, n in sorted(pool.policy.decisions.items()):
                decisions.add_metric([name, pool.policy.name, decision], n)
        yield decisions
        busy = CounterMetricFamily(
            "pd_router_busy_choices",
            "Workers chosen while none of their pool was ready (/ready 503): the fallback that "
            "queues on a busy worker rather than refusing, by pool",
            labels=["pool"],
        )
        for name, pool in self.registry.pools.items():
            busy.add_metric([name], pool.busy_choices)
        yield busy
        decision_s = HistogramMetricFamily(
            "pd_router_route_decision_seconds",
            "The routing policy's time to choose a worker, by pool",
            labels=["pool"],
        )
        for name, pool in self.registry.pools.items():
            decision_s.add_metric([name], pool.decision_s.buckets(), pool.decision_s.sum)
        yield decision_s
        ratio = GaugeMetricFamily(
            "pd_router_bytes_per_token",
            "Prompt bytes per token, calibrated from the workers' usage (the token estimate)",
        )
        ratio.add_metric([], self.registry.estimate.bytes_per_token)
        yield ratio
        apart = unpaired(self.registry.prefill.healthy, self.registry.decode.healthy)
        unpaired_g = GaugeMetricFamily(
            "pd_router_unpaired_workers",
            "Pairs of a healthy prefill and decode worker that are never paired: their runtime "
            "formats (compute dtype, linear and LM head formats, attention) differ",
        )
        unpaired_g.add_metric([], len(apart))
        yield unpaired_g
        refused = CounterMetricFamily(
            "pd_router_unpaired_refusals",
            "PD requests refused (503) because no healthy worker ran the format of the other "
            "side of the pair",
        )
        refused.add_metric([], self.unpaired_refusals)
        yield refused
        yield from self._workers()

    def _workers(self) -> Iterable[Metric]:
        labels = ["pool", "worker"]
        inflight = GaugeMetricFamily(
            "pd_router_worker_inflight",
            "Requests the router has in flight on a worker",
            labels=labels,
        )
        healthy = GaugeMetricFamily(
            "pd_router_worker_healthy",
            "1 when the worker is admitted, 0 when ejected",
            labels=labels,
        )
        queued = GaugeMetricFamily(
            "pd_router_worker_queued_prefill_tokens",
            "Queued prefill tokens a worker reported",
            labels=labels,
        )
        running = GaugeMetricFamily(
            "pd_router_worker_running", "Running requests a worker reported", labels=labels
        )
        kv = GaugeMetricFamily(
            "pd_router_worker_kv_usage", "KV cache usage (0..1) a worker reported", labels=labels
        )
        index = GaugeMetricFamily(
            "pd_router_prefix_index_blocks",
            "Prompt blocks (64 bytes) the router's prefix index expects a worker to hold",
            labels=labels,
        )
        for w in self.registry:
            lv = [w.role, w.url]
            index.add_metric(lv, self.registry.pools[w.role].index.blocks(w.url))
            inflight.add_metric(lv, w.inflight)
            healthy.add_metric(lv, 1.0 if w.healthy else 0.0)
            if w.load is not None:
                queued.add_metric(lv, w.load.queued_prefill_tokens)
                running.add_metric(lv, w.load.running)
                kv.add_metric(lv, w.load.kv_usage)
        return [inflight, healthy, queued, running, kv, index]


def _admission_families(admission: Admission) -> Iterable[Metric]:
    outcomes = CounterMetricFamily(
        "pd_router_class_requests",
        "Requests by priority class and admission outcome (admitted, queued: waited for a "
        "slot first, refused: 429, its queue full, timed_out: 408, preempted: 503 before its "
        "first byte, for a higher class)",
        labels=["class", "outcome"],
    )
    for (cls, outcome), n in admission.counts.items():
        outcomes.add_metric([cls, outcome], n)
    yield outcomes
    for name, doc, values in (
        ("pd_router_class_queued", "Requests waiting for a slot, by class", admission.queued),
        ("pd_router_class_inflight", "Requests holding a slot, by class", admission.inflight),
    ):
        gauge = GaugeMetricFamily(name, doc, labels=["class"])
        for cls in CLASSES:
            gauge.add_metric([cls], values[cls])
        yield gauge
    budget = GaugeMetricFamily(
        "pd_router_concurrency_budget", "--max-concurrency (0: no budget, all admitted)"
    )
    budget.add_metric([], admission.budget)
    yield budget
