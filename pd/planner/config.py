"""`pd-planner`'s flags, each written once (pd/cli_args.py)."""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass

from pd.cli_args import add_dataclass_arguments, dataclass_from_args
from pd.cli_args import flag as _flag
from pd.planner.decide import SLO, TTFT_QUANTILE, Bounds, PlannerKnobs
from pd.registration import normalize_url

CONNECTORS = ("local", "simulated", "virtual", "kubernetes")


@dataclass(frozen=True)
class PlannerConfig:
    router: str | None = _flag(None, "URL of the router whose cluster is planned (required)")
    connector: str = _flag("virtual", "what acts on the decisions", choices=CONNECTORS)
    slo_ttft_ms: float | None = _flag(None, "time-to-first-token SLO (required)")
    slo_itl_ms: float | None = _flag(None, "inter-token latency SLO (required)")
    interval_s: float = _flag(
        5.0, "seconds between observations (the planner's: x --time-scale in real time)"
    )
    cooldown_s: float = _flag(60.0, "a role shrinks no sooner than this after its last change")
    window_s: float = _flag(
        60.0, "the arrival rate's and mean lengths' window (a rise beyond its noise shows at once)"
    )
    headroom: float = _flag(
        0.0, "the share of the arrival rate the floor keeps workers ready for beyond it (a "
        "burst shorter than a worker's start-up is met only by workers already there; e.g. "
        "0.25: the floor sizes for 1.25x the arrivals)",
    )  # fmt: skip
    ttft_quantile: float = _flag(
        TTFT_QUANTILE, "the share of prompts whose TTFT the prefill floor sizes for (a queue of random "
        "arrivals, pd/planner/queueing.py; e.g. 0.99: more workers, fewer late first tokens)",
    )  # fmt: skip
    forecast_s: float = _flag(
        0.0, "how far ahead the floor sizes a rising arrival rate (its trend beyond 3 standard "
        "deviations): a worker's start-up (0: no forecast)",
    )  # fmt: skip
    min_prefill: int = _flag(1, "fewest prefill workers")
    max_prefill: int = _flag(8, "most prefill workers")
    min_decode: int = _flag(1, "fewest decode workers")
    max_decode: int = _flag(8, "most decode workers")
    budget: int = _flag(16, "most workers of both roles together (GPUs, or cores here)")
    time_scale: float = _flag(
        1.0,
        "a simulated cluster's --time-scale K: seconds read are divided by K, the interval and "
        "start-up multiplied (1: real time)",
    )
    admin_token: str | None = _flag(
        None, "the router's admin token (started workers register with it; a drained one is "
        "removed with it)", env="PD_ADMIN_TOKEN",
    )  # fmt: skip
    cluster_token: str | None = _flag(
        None, "local, simulated: the cluster token given to the workers started (the router's "
        "and the other workers')", env="PD_CLUSTER_TOKEN",
    )  # fmt: skip
    worker_args: str = _flag(
        "", "local, simulated: flags given to every worker started, one string "
        "(e.g. '--threads 1 --kv-pages 2048')",
    )  # fmt: skip
    simulate: str | None = _flag(None, "simulated: the workers' profile (pd-worker --simulate)")
    startup_s: float = _flag(
        -1.0, "simulated: a new worker's modeled start-up seconds (-1: its profile's)"
    )
    spares: int = _flag(
        0, "simulated: spare workers a role started parked at once, activated at a scale-up "
        "(no process start while the load is on; one started again after each drain)",
    )  # fmt: skip
    log_dir: str | None = _flag(None, "local, simulated: a log file per started worker here")
    decision_file: str | None = _flag(
        None, "virtual: where the decision is written (acknowledged in FILE.ack)"
    )
    ack_timeout_s: float = _flag(300.0, "virtual: how long a decision waits for its ack")
    k8s_api: str | None = _flag(
        None, "kubernetes: the API server's URL (default: the pod's, with its service account)"
    )
    k8s_namespace: str | None = _flag(None, "kubernetes: the Deployments' namespace (the pod's)")
    k8s_prefill_deployment: str = _flag("pd-prefill", "kubernetes: the prefill Deployment")
    k8s_decode_deployment: str = _flag("pd-decode", "kubernetes: the decode Deployment")
    host: str = _flag("127.0.0.1", "address of the planner's own /metrics and /health")
    port: int = _flag(8300, "port of the planner's /metrics and /health (0 picks a free one)")
    log_level: str = _flag("info", "log level", choices=("debug", "info", "warning", "error"))

    def __post_init__(self) -> None:
        def check(ok: bool, why: str) -> None:
            if not ok:
                raise ValueError(why)

        check(self.router is not None, "--router is required: the router whose cluster is planned")
        if self.router is not None:
            object.__setattr__(self, "router", normalize_url(self.router))
        check(
            self.slo_ttft_ms is not None and self.slo_itl_ms is not None,
            "--slo-ttft-ms and --slo-itl-ms are required",
        )
        check((self.slo_ttft_ms or 0) > 0 and (self.slo_itl_ms or 0) > 0, "the SLOs must be > 0 ms")
        check(self.interval_s > 0 and self.time_scale > 0, "--interval-s and --time-scale > 0")
        check(self.cooldown_s >= 0 and self.window_s > 0, "--cooldown-s >= 0, --window-s > 0")
        check(self.headroom >= 0 and self.forecast_s >= 0, "--headroom, --forecast-s >= 0")
        check(0 < self.ttft_quantile < 1, "--ttft-quantile must be > 0 and < 1")
        for role in ("prefill", "decode"):
            low, high = getattr(self, f"min_{role}"), getattr(self, f"max_{role}")
            check(0 <= low <= high, f"--min-{role} must be >= 0 and <= --max-{role}")
        check(
            self.min_prefill + self.min_decode <= self.budget,
            "--budget is below --min-prefill + --min-decode",
        )
        check(
            self.connector != "simulated" or self.simulate is not None,
            "--connector simulated needs --simulate PROFILE (the workers' profile)",
        )
        check(
            self.connector != "virtual" or self.decision_file is not None,
            "--connector virtual needs --decision-file PATH",
        )
        check(self.startup_s >= 0 or self.startup_s == -1, "--startup-s must be >= 0, or -1")
        check(self.spares >= 0, "--spares must be >= 0")
        shlex.split(self.worker_args)  # unbalanced quotes: ValueError, said at start

    @property
    def slo(self) -> SLO:
        assert self.slo_ttft_ms is not None and self.slo_itl_ms is not None
        return SLO(self.slo_ttft_ms / 1000, self.slo_itl_ms / 1000)

    @property
    def bounds(self) -> Bounds:
        return Bounds(
            self.min_prefill, self.max_prefill, self.min_decode, self.max_decode, self.budget
        )

    @property
    def knobs(self) -> PlannerKnobs:
        return PlannerKnobs(
            cooldown_s=self.cooldown_s,
            headroom=self.headroom,
            forecast_s=self.forecast_s,
            ttft_quantile=self.ttft_quantile,
        )

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        add_dataclass_arguments(parser, cls)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> PlannerConfig:
        return dataclass_from_args(cls, args)
