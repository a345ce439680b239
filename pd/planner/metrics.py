"""The planner's Prometheus metrics: its estimates against the SLOs, its online fits, what it
read of the load, its targets and the workers on their way, and its decisions. Read from the
planner and its connector when `/metrics` is scraped. Seconds are the planner's (modeled seconds
of a simulated cluster: its time scale divided out)."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pd.planner.connector import Connector
from pd.planner.decide import ROLES, Planner


class PlannerMetrics(Collector):
    def __init__(self, planner: Planner, connector: Connector) -> None:
        self.planner = planner
        self.connector = connector
        self.observations = 0
        self.failed_polls = 0
        self.prom = CollectorRegistry()
        self.prom.register(self)

    def render(self) -> bytes:
        return generate_latest(self.prom)

    def collect(self) -> Iterable[Metric]:
        p = self.planner
        obs = p.last
        pending = self.connector.pending()
        workers = GaugeMetricFamily(
            "pd_planner_workers",
            "Workers per role: the planner's target, those ready (taking load), and those its "
            "connector is starting or draining",
            labels=["role", "state"],
        )
        for role in ROLES:
            workers.add_metric([role, "target"], p.roles[role].target or 0)
            workers.add_metric([role, "ready"], len(obs.of(role)) if obs else 0)
            for state in ("starting", "leaving"):
                workers.add_metric([role, state], pending.get(role, {}).get(state, 0))
        yield workers
        floor = GaugeMetricFamily(
            "pd_planner_floor_workers",
            "The predictive floor per role: the workers the arrival rate and lengths need",
            labels=["role"],
        )
        for role in ROLES:
            floor.add_metric([role], p.roles[role].floor)
        yield floor
        last = p.decisions[-1] if p.decisions else None
        estimate = GaugeMetricFamily(
            "pd_planner_estimate_seconds",
            "The last estimate with the workers there were (ttft: a new request's, from the "
            "queued prompt tokens and the fitted prefill rate; itl: the fitted decode step at the "
            "running rows and KV tokens); absent until it can be made",
            labels=["slo"],
        )
        slo = GaugeMetricFamily("pd_planner_slo_seconds", "The SLOs planned for", labels=["slo"])
        for name, est, target in (
            ("ttft", last.ttft_s if last else None, p.slo.ttft_s),
            ("itl", last.itl_s if last else None, p.slo.itl_s),
        ):
            if est is not None:
                estimate.add_metric([name], est)
            slo.add_metric([name], target)
        yield estimate
        yield slo
        fit = GaugeMetricFamily(
            "pd_planner_step_fit_seconds",
            "The decode step-time fit: seconds = fixed + per_row x rows + per_kv_token x KV "
            "tokens (least squares over the latest steps the decode workers reported)",
            labels=["term"],
        )
        if p.step_fit.coefficients is not None:
            for term, value in zip(("fixed", "per_row", "per_kv_token"), p.step_fit.coefficients):
                fit.add_metric([term], value)
        yield fit
        rate = GaugeMetricFamily(
            "pd_planner_prefill_tokens_per_second",
            "The fitted prefill rate: prompt tokens a prefill worker computes a busy second",
        )
        if p.rate_fit.tokens_per_s is not None:
            rate.add_metric([], p.rate_fit.tokens_per_s)
        yield rate
        for name, doc, value in (
            ("pd_planner_arrivals_per_second", "Requests a second, over the recent window",
             obs.arrivals_per_s if obs else 0.0),
            ("pd_planner_mean_prompt_tokens", "Mean uncached prompt tokens a request, recently",
             obs.prompt_tokens if obs else 0.0),
            ("pd_planner_mean_output_tokens", "Mean generated tokens a request, recently",
             obs.output_tokens if obs else 0.0),
            ("pd_planner_ttft_overhead_seconds",
             "The TTFT's mean part outside prefill: the router's TTFT less the prefill workers'",
             obs.ttft_overhead_s if obs else 0.0),
        ):  # fmt: skip
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], value)
            yield g
        decisions = CounterMetricFamily(
            "pd_planner_decisions",
            "Decisions that changed a role's target, by role and direction",
            labels=["role", "direction"],
        )
        turns = CounterMetricFamily(
            "pd_planner_direction_changes",
            "Times a role's target turned (a growth after a shrink, or the reverse)",
            labels=["role"],
        )
        for role in ROLES:
            s = p.roles[role]
            decisions.add_metric([role, "up"], s.ups)
            decisions.add_metric([role, "down"], s.downs)
            turns.add_metric([role], s.direction_changes)
        yield decisions
        yield turns
        polls = CounterMetricFamily(
            "pd_planner_observations", "Polls of the cluster, by outcome", labels=["outcome"]
        )
        polls.add_metric(["ok"], self.observations)
        polls.add_metric(["failed"], self.failed_polls)
        yield polls
