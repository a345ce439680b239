"""The planner's search: the P:D splits and TPs of a GPU budget, each one's goodput per GPU on
the DES (pd/sim/cluster), and the co-located cluster of the same GPUs.

Goodput per GPU is DistServe's by default: the highest rate (requests per second, bisected to a
relative `tolerance`) whose SLO attainment is at least `attainment`, over the GPUs the cluster
uses. With `at_rate_per_gpu` it is instead `pd-bench serve`'s goodput (requests meeting every SLO
per second of the run) at that offered rate per GPU, over the GPUs. Attainment and goodput are
pd-bench serve's own (`metrics.SLO.met`, `summarize`) over the DES's requests as records.
Every rate of one search replays the same arrival draw scaled to it (one seed for all), so
attainment falls with the rate but for the queueing itself.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pd.bench.serve.client import RequestRecord
from pd.bench.serve.metrics import SLO, summarize
from pd.bench.serve.sim_jobs import arrivals_at
from pd.sim.cluster import ClusterSim, ClusterSpec, Limits, RequestTiming, SimJob, simulate
from pd.sim.cost import CostModel
from pd.sim.profile import Profile, with_tp

MIN_RATE_FRACTION = 1 / 1024  # below the first guess times this, no rate meets the SLOs
# Above the first guess times this, the search stops: a run of N requests at such a rate is one
# burst, whose attainment no longer falls with the rate (too few requests for the SLOs).
MAX_RATE_FACTOR = 64


@dataclass(frozen=True)
class Search:
    slo: SLO
    attainment: float = 0.9
    arrival: str = "poisson"
    seed: int = 0
    tolerance: float = 0.02  # relative width of the bisected rate
    at_rate_per_gpu: float | None = None  # goodput at this rate instead of the max rate


@dataclass
class Outcome:
    """One cluster's result."""

    spec: ClusterSpec
    goodput_per_gpu: float
    max_rate: float | None = None  # max-rate mode: the rate found (req/s, whole cluster)
    attainment: float | None = None  # at that rate (at-rate mode: at the given one)
    simulations: int = 0
    capped: bool = False  # max-rate mode: still met at MAX_RATE_FACTOR x the first guess
    cpu_s: float = 0.0
    tried: list[tuple[float, float]] = field(default_factory=list)  # (rate, attainment)

    def as_dict(self) -> dict[str, Any]:
        s = self.spec
        out: dict[str, Any]
        if s.is_disaggregated:
            p, d = s.pools
            out = {"prefill_workers": p.workers, "decode_workers": d.workers,
                   "tp": {"prefill": p.tp, "decode": d.tp}}  # fmt: skip
        else:
            out = {"workers": s.pools[0].workers, "tp": s.pools[0].tp}
        out.update(
            name=s.name,
            gpus=s.gpus,
            chunk_size=s.limits.chunk_size,
            goodput_per_gpu=round(self.goodput_per_gpu, 4),
            max_rate=None if self.max_rate is None else round(self.max_rate, 4),
            attainment=None if self.attainment is None else round(self.attainment, 4),
            simulations=self.simulations,
            tried=[[round(r, 4), round(a, 4)] for r, a in self.tried],  # (rate, attainment)
        )
        if self.capped:
            out["capped"] = True
        return out


def records(
    timings: Sequence[RequestTiming], rate: float, name: str, itl: bool
) -> list[RequestRecord]:
    """The DES's requests as pd-bench serve's records (`itl`: with their gaps)."""
    out = []
    for t in timings:
        r = RequestRecord(name, rate, t.job_id, t.turn, t.arrival_s, t.arrival_s)
        r.ttft_s, r.e2e_s = t.ttft_s, t.e2e_s
        r.itl_s = t.itl_s if itl else []
        r.prompt_tokens, r.cached_tokens = t.prompt_tokens, t.cached_tokens
        r.output_tokens = len(t.token_times)
        if not t.ok:
            r.error = t.error or "unfinished"
        out.append(r)
    return out


def run_at(
    spec: ClusterSpec, jobs: list[SimJob], rate: float, search: Search, gaps: bool = False
) -> list[RequestRecord]:
    """`jobs` at `rate` (req/s, whole cluster) on `spec`: pd-bench serve's records (with every
    inter-token gap if `gaps` or an ITL SLO is given)."""
    result = simulate(spec, jobs, arrivals_at(jobs, rate, search.arrival, search.seed))
    return records(result.requests, rate, spec.name, gaps or search.slo.itl_p99_ms is not None)


def attainment_at(spec: ClusterSpec, jobs: list[SimJob], rate: float, search: Search) -> float:
    """The share of requests meeting the SLOs at `rate`. NOTE: the run stops once more requests
    have missed than the attainment allows (the rest count as missed): the answer is then below
    the target, as the full run's would be, and cheaper to get."""
    turns = sum(len(j.turns) for j in jobs)
    allowed = turns - math.ceil(search.attainment * turns - 1e-9)
    itl = search.slo.itl_p99_ms is not None
    missed = 0

    def stop(t: RequestTiming) -> bool:
        nonlocal missed
        missed += not search.slo.met(records([t], rate, spec.name, itl)[0])
        return missed > allowed

    sim = ClusterSim(spec, stop=stop)
    result = sim.run(jobs, arrivals_at(jobs, rate, search.arrival, search.seed))
    met = sum(search.slo.met(r) for r in records(result.requests, rate, spec.name, itl))
    return met / turns


def summary_at(
    spec: ClusterSpec, jobs: list[SimJob], rate: float, search: Search
) -> dict[str, Any]:
    """pd-bench serve's figures of one phase (`metrics.summarize`) at `rate`, plus per GPU."""
    out = summarize(run_at(spec, jobs, rate, search), search.slo)
    out["rate_per_gpu"] = round(rate / spec.gpus, 4)
    out["goodput_per_gpu"] = round(out["goodput_rps"] / spec.gpus, 4)
    return out


def evaluate(spec: ClusterSpec, jobs: list[SimJob], search: Search) -> Outcome:
    """`spec`'s goodput per GPU, by the search's definition."""
    t0 = time.process_time()
    if search.at_rate_per_gpu is not None:
        s = summary_at(spec, jobs, search.at_rate_per_gpu * spec.gpus, search)
        out = Outcome(spec, s["goodput_per_gpu"], attainment=s["slo_attainment"], simulations=1)
    else:
        out = max_rate(spec, jobs, search)
    out.cpu_s = time.process_time() - t0
    return out


def max_rate(spec: ClusterSpec, jobs: list[SimJob], search: Search) -> Outcome:
    """Bracket the highest rate meeting the attainment (doubling or halving from a first guess),
    then bisect it to the tolerance."""
    out = Outcome(spec, 0.0)

    def ok(rate: float) -> bool:
        a = attainment_at(spec, jobs, rate, search)
        out.tried.append((rate, a))
        out.simulations += 1
        return a >= search.attainment

    first = 0.5 * capacity_estimate(spec, jobs)
    lo, hi = 0.0, first
    if ok(first):
        lo, hi = first, 2 * first
        while ok(hi):
            lo, hi = hi, 2 * hi
            if lo >= first * MAX_RATE_FACTOR:
                out.capped = True
                hi = lo
                break
    else:
        while hi > first * MIN_RATE_FRACTION:
            hi /= 2
            if ok(hi):
                lo, hi = hi, 2 * hi
                break
        else:
            return out  # no rate meets the SLOs
    while hi - lo > search.tolerance * hi:
        mid = (lo + hi) / 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    out.max_rate = lo
    out.attainment = max(a for r, a in out.tried if r == lo)
    out.goodput_per_gpu = lo / spec.gpus
    return out


def capacity_estimate(spec: ClusterSpec, jobs: list[SimJob]) -> float:
    """A rough rate (req/s) the cluster can serve, from the cost model: full prefill chunks on
    P, batches as large as the KV and `max_running` allow on D. Only the search's first guess."""
    turns = [t for j in jobs for t in j.turns]
    prompt = sum(t.prompt_tokens for t in turns) / len(turns)
    output = sum(t.output_tokens for t in turns) / len(turns)
    limits = spec.limits
    per_worker = []
    for pool in spec.pools:
        profile = spec.pool_profile(pool)
        cost = CostModel(profile)
        chunk = limits.chunk_size
        prefill_s = prompt * cost.batch_s(0, 0, [(0, chunk)]) / chunk  # a prompt's share
        rows = max(1, min(limits.max_running, int(profile.kv_tokens() // (prompt + output))))
        decode_s = output * cost.batch_s(rows, int(rows * (prompt + output / 2))) / rows
        seconds = {"prefill": prefill_s, "decode": decode_s, "both": prefill_s + decode_s}
        per_worker.append(pool.workers / seconds[pool.role])
    return min(per_worker) * len(jobs) / len(turns)


def fits(profile: Profile, tp: int, page_size: int) -> bool:
    try:
        with_tp(profile, tp).kv_pages(page_size)
    except ValueError:
        return False
    return True


def splits(profile: Profile, gpus: int, tps: Sequence[int], limits: Limits,
           policy: str) -> list[ClusterSpec]:  # fmt: skip
    """Every P:D split of at most `gpus` GPUs, each role at each TP of `tps` it fits at."""
    ok = [tp for tp in tps if fits(profile, tp, limits.page_size)]
    out = []
    for tp_p in ok:
        for tp_d in ok:
            for p in range(1, gpus // tp_p + 1):
                for d in range(1, (gpus - p * tp_p) // tp_d + 1):
                    out.append(ClusterSpec.disaggregated(profile, p, tp_p, d, tp_d, limits, policy))
    return out


def colocated(profile: Profile, gpus: int, tps: Sequence[int], limits: Limits,
              policy: str) -> list[ClusterSpec]:  # fmt: skip
    """The co-located clusters of the budget: as many workers of each TP as it holds."""
    return [ClusterSpec.colocated(profile, gpus // tp, tp, limits, policy)
            for tp in tps if gpus >= tp and fits(profile, tp, limits.page_size)]  # fmt: skip
