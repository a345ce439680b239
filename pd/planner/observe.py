"""What the planner reads of a running cluster, each poll: the router's worker list and arrival
counter, and each prefill and decode worker's `/health` (readiness, load) and step record
(`GET /steps?after=N`: totals since start, decode steps since the last poll). Out of them one
`Observation`, in the planner's time: a simulated cluster at time scale K runs K times slower
than the GPUs it models, so seconds read are divided by K and rates multiplied by it.

The arrival rate and the mean lengths are taken over a window of polls (`window_s` of the
planner's time), not one poll: a few seconds of a bursty load say little of its rate.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from pd.planner.signals import Observation, StepSample, WorkerSignals
from pd.planner.trend import trend
from pd.planner.window import Totals, windowed

PLANNED = ("prefill", "decode")  # a co-located ("both") worker is not planned
# Not ready for these: not a worker of its role yet (or any more).
NOT_COUNTED = ("starting", "draining", "parked")
WINDOW_S = 60.0  # the arrival rate's and mean lengths' window (the planner's seconds)


@dataclass
class _Seen:
    """What a worker reported at the last poll (its counters are totals since its start)."""

    steps: int = 0
    prefill_tokens: int = 0
    prefill_busy_s: float = 0.0
    prefills_done: int = 0
    sampled_tokens: int = 0
    prefill_latency_s: float = 0.0

    @classmethod
    def of(cls, record: dict[str, Any]) -> _Seen:
        """The counters of a worker's `/steps` answer."""
        return cls(
            record["steps"],
            record["prefill_tokens"],
            record["prefill_busy_s"],
            record["prefills_done"],
            record["sampled_tokens"],
            float(record.get("prefill_latency_s", 0.0)),
        )


@dataclass
class ClusterReader:
    router_url: str
    time_scale: float = 1.0
    window_s: float = WINDOW_S
    timeout_s: float = 5.0
    admin_token: str | None = None  # the router's: its worker list needs it when it has one
    clock: Callable[[], float] = time.monotonic
    _seen: dict[str, _Seen] = field(default_factory=dict)
    _listed: set[str] = field(default_factory=set)  # the workers of the last poll
    _totals: deque[Totals] = field(default_factory=deque)
    # (at, arrivals) of the polls over two windows: the rate's trend (trend.py)
    _arrived: deque[tuple[float, float]] = field(default_factory=deque)
    _start: float | None = None
    _counters: dict[str, float] = field(
        default_factory=lambda: {"tokens": 0, "done": 0, "sampled": 0, "latency": 0.0}
    )

    def now(self) -> float:
        """The planner's clock: seconds since the first poll, in the modeled time."""
        t = self.clock()
        if self._start is None:
            self._start = t
        return (t - self._start) / self.time_scale

    async def observe(self, http: aiohttp.ClientSession) -> Observation:
        at = self.now()
        headers = {"Authorization": f"Bearer {self.admin_token}"} if self.admin_token else {}
        async with http.get(
            f"{self.router_url}/workers",
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
        ) as r:
            if r.status != 200:  # no observation: never a cluster of no workers
                raise RuntimeError(f"the router's /workers answered {r.status}: {await r.text()}")
            listed = await r.json()
        workers = [w for w in (listed or {}).get("workers", []) if w.get("role") in PLANNED]
        urls = {w["url"] for w in workers}
        # One seen before but not at the last poll (a spare parked and activated again): what
        # it did while out of the list is not this poll's
        back = {url for url in urls - self._listed if url in self._seen}
        self._listed = urls
        reports = await asyncio.gather(*(self._worker(http, w, w["url"] in back) for w in workers))
        signals = tuple(s for s in reports if s is not None)
        arrivals, ttft_s, ttfts = await self._router_counters(http)
        self._totals.append(
            Totals(
                at,
                arrivals,
                int(self._counters["tokens"]),
                int(self._counters["done"]),
                int(self._counters["sampled"]),
                self._counters["latency"],
                ttft_s,
                ttfts,
                sum(s.queued_prefill_tokens for s in signals if s.role == "prefill"),
            )
        )
        while len(self._totals) > 2 and at - self._totals[1].at >= self.window_s:
            self._totals.popleft()
        self._arrived.append((at, arrivals))
        while len(self._arrived) > 2 and at - self._arrived[1][0] >= 2 * self.window_s:
            self._arrived.popleft()
        w = windowed(self._totals)
        return Observation(
            at,
            signals,
            w.arrivals_per_s,
            w.prompt_tokens,
            w.output_tokens,
            w.ttft_overhead_s / self.time_scale,
            trend(self._arrived),
        )

    async def _worker(
        self, http: aiohttp.ClientSession, listed: dict[str, Any], back: bool = False
    ) -> WorkerSignals | None:
        url, role = listed["url"], listed["role"]
        health = await self._get_json(http, f"{url}/health")
        seen = self._seen.setdefault(url, _Seen())
        record = await self._get_json(http, f"{url}/steps?after={seen.steps}")
        if health is None or record is None:
            if back:  # its counters are read again from the next poll on, not from before
                self._listed.discard(url)
            return None  # unreachable: not a worker this poll
        k = self.time_scale
        now = _Seen.of(record)
        if record["steps"] < seen.steps:  # it restarted: its counters too
            seen = _Seen()
        elif back:  # counted from now: its counters as they are, its steps so far read
            seen, record = now, {**record, "samples": []}
        tokens = now.prefill_tokens - seen.prefill_tokens
        busy = now.prefill_busy_s - seen.prefill_busy_s
        self._counters["tokens"] += tokens
        self._counters["done"] += now.prefills_done - seen.prefills_done
        self._counters["latency"] += now.prefill_latency_s - seen.prefill_latency_s
        if role == "decode":
            self._counters["sampled"] += now.sampled_tokens - seen.sampled_tokens
        self._seen[url] = now
        load = health.get("load") or {}
        why = health.get("not_ready_reason")
        running = int(load.get("running", 0))
        last = record.get("last_sample") or {}
        return WorkerSignals(
            url=url,
            role=role,
            ready=why not in NOT_COUNTED,
            queued_prefill_tokens=int(load.get("queued_prefill_tokens", 0)),
            running=running,
            inflight=int(listed.get("inflight", 0)),
            kv_tokens=int(last.get("kv_tokens", 0)) if running else 0,
            kv_pages_used=int(load.get("kv_pages_total", 0)) - int(load.get("kv_pages_free", 0)),
            kv_pages_total=int(load.get("kv_pages_total", 0)),
            kv_page_size=int(load.get("kv_page_size", 0)),
            waiting_for_pages=int(load.get("waiting_for_pages", 0)),
            prefill_tokens=tokens,
            prefill_busy_s=busy / k,
            steps=tuple(StepSample(r, kv, s / k) for r, kv, s in record["samples"]),
        )

    async def _router_counters(self, http: aiohttp.ClientSession) -> tuple[float, float, float]:
        """The router's arrivals, and the sum and count of its TTFTs of requests prefilled on a
        prefill worker (route `pd`: those served decode-local, or by a `both` worker, have no
        part in P's latency, which the TTFT outside prefill is taken against)."""
        try:
            async with http.get(
                f"{self.router_url}/metrics", timeout=aiohttp.ClientTimeout(total=self.timeout_s)
            ) as r:
                text = await r.text()
        except (aiohttp.ClientError, TimeoutError):
            last = self._totals[-1] if self._totals else None
            return (last.arrivals, last.ttft_s, last.ttfts) if last else (0.0, 0.0, 0.0)
        arrivals = ttft_s = ttfts = 0.0
        for family in text_string_to_metric_families(text):
            if family.name == "pd_router_arrivals":
                arrivals = sum(s.value for s in family.samples if s.name.endswith("_total"))
            elif family.name == "pd_router_ttft_seconds":
                pd = [s for s in family.samples if s.labels.get("route") == "pd"]
                ttft_s = sum(s.value for s in pd if s.name.endswith("_sum"))
                ttfts = sum(s.value for s in pd if s.name.endswith("_count"))
        return arrivals, ttft_s, ttfts

    async def _get_json(self, http: aiohttp.ClientSession, url: str) -> Any:
        try:
            async with http.get(url, timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as r:
                if r.status != 200:
                    return None
                return await r.json()
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
