"""What the planner observes: per worker, what its `/health` load exports; for the cluster, what
the router measures of the requests (their rate and lengths). Never the trace."""

from __future__ import annotations

from dataclasses import dataclass

from pd.planner.trend import Trend


@dataclass(frozen=True)
class StepSample:
    """One decode step a worker reported: its rows, the KV tokens they attend to, its time."""

    rows: int
    kv_tokens: int
    seconds: float


@dataclass(frozen=True)
class WorkerSignals:
    url: str
    role: str  # "prefill" | "decode" (a co-located worker is not planned)
    ready: bool  # takes load (a starting or draining worker does not count)
    queued_prefill_tokens: int = 0  # prompt tokens not yet prefilled (cache hits excluded)
    running: int = 0  # rows in its batch
    inflight: int = 0  # requests the router has on it (what a request-count autoscaler sees)
    kv_tokens: int = 0  # tokens whose KV its running requests hold
    kv_pages_used: int = 0  # of its KV pool (cached pages nobody holds count as free)
    kv_pages_total: int = 0
    kv_page_size: int = 0  # tokens a page
    waiting_for_pages: int = 0  # decode: pulled requests queued until their pages fit
    prefill_tokens: int = 0  # prompt tokens it prefilled since the last observation
    prefill_busy_s: float = 0.0  # of which it spent this long computing (0: idle)
    steps: tuple[StepSample, ...] = ()  # decode steps since the last observation


@dataclass(frozen=True)
class Observation:
    at: float  # seconds, the planner's clock
    workers: tuple[WorkerSignals, ...]
    arrivals_per_s: float = 0.0  # requests a second, recently (the router's)
    prompt_tokens: float = 0.0  # mean uncached prompt tokens a request
    output_tokens: float = 0.0  # mean generated tokens a request
    # the TTFT's mean part that no prefill worker serves (router TTFT less P's latency)
    ttft_overhead_s: float = 0.0
    trend: Trend | None = None  # the arrival rate's trend over two windows (trend.py)

    def of(self, role: str) -> list[WorkerSignals]:
        """The ready workers of `role`."""
        return [w for w in self.workers if w.role == role and w.ready]
