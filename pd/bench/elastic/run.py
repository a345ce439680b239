"""`pd-bench elastic`: the planner against a fixed split and Kubernetes' HPA, on a simulated GPU
cluster (real router and workers, steps at the profile's costs x the time scale), one load trace
(trace.py) for each, every setup its own process, all at once (`--jobs 1`: in turn).

- `planner`: starts at the fewest workers (`--min-prefill`, `--min-decode`); `pd-planner`'s
  service in the setup's process with the `simulated` connector adds and removes workers, each
  ready only after its start-up (`--startup-s`, modeled);
- `fixed`: the smallest split that meets the SLOs at the peak, measured: the splits tried
  (`--fixed`; by default the discrete-event model's choice and one more prefill worker) run
  beside the others, and the smallest with 90% attainment in every held phase is `fixed`. The
  model's choice (pd/sim/cluster, the planner's own: fewest workers, then fewer prefill, 90% in
  every held phase, each held two modeled minutes at its rate, the peak included) leaves out the
  TTFT outside prefill (router, transfer, the first decode step), so live it can miss the peak;
- `hpa`: HPA v2's algorithm (hpa.py) per role on running requests per worker, through the same
  connector.

Per setup: SLO attainment (TTFT and mean ITL a request, against `--slo-ttft-ms` and
`--slo-itl-ms`) over the run and per phase, GPU-hours (every worker process from its start to
its exit, starting and draining included, x its GPUs), scale-ups and -downs of the targets,
direction changes per held phase, requests lost or cut. For the planner, `fit_error`: the
largest relative error of its decode-step fit against the profile's cost model over the steps
it saw. Seconds are modeled: real seconds over the time scale.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import random
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp

from pd.bench.elastic.cpu import LIMIT, CpuWatch
from pd.bench.elastic.hpa import HPA, PERIOD_S, STABILIZATION_S
from pd.bench.elastic.trace import TRACES, Phase, arrivals, bounds, scaled
from pd.bench.pd import _spawn, _wait_healthy
from pd.bench.plan_search import Search, attainment_at
from pd.bench.serve.client import RequestRecord, stream_request
from pd.bench.serve.metrics import SLO, summarize
from pd.bench.serve.text import TokenText
from pd.planner import Decision
from pd.planner.config import PlannerConfig
from pd.planner.decide import TTFT_QUANTILE
from pd.planner.observe import ClusterReader
from pd.planner.processes import SimulatedConnector
from pd.planner.service import PlannerService
from pd.ports import free_port
from pd.sim import CostModel, parse_profile
from pd.sim.cluster import ClusterSpec, Limits, SimJob, SimTurn
from pd.sim.launch import SimWorkers, clock_counters, overshoot, start_sim_workers
from pd.worker.checkpoint.default_model import default_model_path
from pd.worker.checkpoint.loader import load_tokenizer

ADMIN = "pd-bench-elastic-admin"
SETUPS = ("planner", "fixed", "hpa")
STEADY_S = 120.0  # modeled seconds each held phase runs in the fixed split's model
FULL_PHASE_SCALE = 0.4  # the full trace's default: its 3 setups at once in under 30 min here
SAMPLE_S = 0.5  # real seconds between samples of the workers alive and the targets


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--simulate", default="llama-3.1-70b:h100:tp4", help="the workers' profile")
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="K: modeled seconds run K times slower (raise it if the CPU passes 70%%, or the "
        "clock's overshoot and the step fit's error are large: docs/planner.md)",
    )
    p.add_argument("--trace", default="full", choices=sorted(TRACES),
                   help="the load: full (the issue's), quick, or plateau (1x, then 4x held)")  # fmt: skip
    p.add_argument("--quick", action="store_true",
                   help="--trace quick (under 5 minutes): the planner adds and removes a worker, "
                   "with a 5 s start-up, 2 s polls and a 10 s cool-down")  # fmt: skip
    p.add_argument("--setups", default=",".join(SETUPS), help="which, in this order")
    p.add_argument("--jobs", type=int, default=0,
                   help="setups run at once, each its own process (0: all; 1: in turn, here)")  # fmt: skip
    p.add_argument("--stagger-s", type=float, default=None,
                   help="real seconds between the loads of setups run at once, all set up "
                   "first (default: 1.25 "
                   "x the shortest held phase, the burst, so that no two meet their peak "
                   "together)")  # fmt: skip
    p.add_argument("--base-rate", type=float, default=1.0, help="requests a second at 1x")
    p.add_argument(
        "--phase-scale",
        type=float,
        default=None,
        help=f"every phase, and the default start-up, this many times as long (the full "
        f"trace as written is ~53 modeled minutes; default {FULL_PHASE_SCALE} for it, 1 for "
        f"the others)",
    )
    p.add_argument("--prompt-tokens", type=int, default=4000)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--slo-ttft-ms", type=float, default=1500.0)
    p.add_argument("--slo-itl-ms", type=float, default=25.0)
    p.add_argument("--startup-s", type=float, default=None,
                   help="a new worker's modeled start-up (default: the profile's x the phase "
                   "scale; --quick: 5)")  # fmt: skip
    p.add_argument("--cooldown-s", type=float, default=None,
                   help="the planner's cool-down (default 60 x the phase scale; --quick: 10)")  # fmt: skip
    p.add_argument("--interval-s", type=float, default=None,
                   help="the planner's observation interval (default 5 x the phase scale; "
                   "--quick: 2); its arrival window is 12 of them")  # fmt: skip
    p.add_argument("--spares", type=int, default=None,
                   help="spare workers a role, started parked before the load, activated at "
                   "a scale-up and parked again after a drain (default: as many as a role can "
                   "grow by, --max less --min; 0: a process starts at each scale-up)")  # fmt: skip
    p.add_argument("--headroom", type=headrooms, default=[0.25],
                   help="the planner's --headroom (the floor sizes for 1 + this x the "
                   "arrivals; 0.25: docs/EXPERIMENTS.md section 29); several (0.25,1): a "
                   "planner each, beside the others, the first the `planner`")  # fmt: skip
    p.add_argument("--ttft-quantile", type=quantiles, default=[TTFT_QUANTILE],
                   help="the planner's --ttft-quantile (the share of prompts its prefill floor "
                   "sizes the TTFT for); several: a planner each, paired with --headroom's "
                   "(one value of either goes with each of the other's)")  # fmt: skip
    p.add_argument("--planner", type=planner_spec, action="append", metavar="KEY=VALUE[,...]",
                   help="one more planner beside the others (repeatable): its headroom, "
                   "quantile, cooldown-s (modeled) and min-prefill where not the first "
                   "planner's, e.g. headroom=1,quantile=0.99,cooldown-s=120,min-prefill=2")  # fmt: skip
    p.add_argument("--forecast", action="store_true",
                   help="the planner's --forecast-s at the start-up (a rising rate sized ahead)")  # fmt: skip
    p.add_argument("--fixed", default=None, metavar="P,D[/P,D...]",
                   help="the fixed splits to try (the smallest meeting the SLOs in every held "
                   "phase is `fixed`) instead of the discrete-event model's choice and one "
                   "more prefill worker")  # fmt: skip
    p.add_argument("--min-prefill", type=int, default=1)
    p.add_argument("--min-decode", type=int, default=1)
    p.add_argument("--max-prefill", type=int, default=6)
    p.add_argument("--max-decode", type=int, default=6)
    p.add_argument("--budget", type=int, default=10, help="workers of both roles together")
    p.add_argument("--hpa-prefill-target", type=float, default=0.5,
                   help="HPA's target of running requests per prefill worker (0.5: its best "
                   "attainment at 4x, docs/EXPERIMENTS.md section 29)")  # fmt: skip
    p.add_argument("--hpa-decode-target", type=float, default=16.0,
                   help="HPA's target of running requests per decode worker")  # fmt: skip
    p.add_argument("--hpa-period-s", type=float, default=None,
                   help="HPA's period (default: its 15 s x the phase scale)")  # fmt: skip
    p.add_argument("--hpa-stabilization-s", type=float, default=None,
                   help="HPA's scale-down stabilization (default: its 300 s x the phase scale)")  # fmt: skip
    p.add_argument("--hpa-tune", default=None,
                   help="prefill targets to try first (e.g. 0.5,1,2,4), each on the plateau "
                   "trace at phase scale 1, at once: HPA then runs with the one of the best "
                   "attainment at 4x (the fewest GPU-hours among equals)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default=None, help="worker and router logs here, a folder a setup")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("--out", default=None, help="also write the whole result (JSON) here")
    p.add_argument("--plot", default=None,
                   help="a PNG of the workers per role against the offered load, per setup, "
                   "and each phase's attainment (needs matplotlib: pip install 'pd[bench]')")  # fmt: skip


@dataclass
class Sample:
    at: float  # modeled seconds since the load began
    workers: dict[str, int]  # processes alive per role
    targets: dict[str, int]


@dataclass
class Run:
    kind: str
    records: list[RequestRecord] = field(default_factory=list)
    phase_of: list[int] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    fit_error: float | None = None
    decisions: list[str] = field(default_factory=list)  # the planner's changes, as logged
    overshoot: float | None = None  # the clock check of the workers there from the start
    initial: tuple[int, int] = (1, 1)
    wall_s: float = 0.0


def headrooms(text: str) -> list[float]:
    """`--headroom H[,H...]`: each >= 0."""
    try:
        got = [float(h) for h in text.split(",") if h.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--headroom takes numbers, not {text!r}") from None
    if not got or any(h < 0 for h in got):
        raise argparse.ArgumentTypeError("--headroom takes one number >= 0 or more")
    return got


def quantiles(text: str) -> list[float]:
    """`--ttft-quantile Q[,Q...]`: each > 0 and < 1."""
    try:
        got = [float(q) for q in text.split(",") if q.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ttft-quantile takes numbers, not {text!r}") from None
    if not got or any(not 0 < q < 1 for q in got):
        raise argparse.ArgumentTypeError("--ttft-quantile takes one number in (0, 1) or more")
    return got


@dataclass(frozen=True)
class Variant:
    """One planner of the run: its headroom and TTFT quantile, and where it has its own, its
    cool-down (modeled seconds) and fewest prefill workers (None: the run's)."""

    headroom: float
    quantile: float
    cooldown_s: float | None = None
    min_prefill: int | None = None

    @property
    def name(self) -> str:
        """Its name beside the first planner (`headroom 1 quantile 0.99 min-prefill 2`)."""
        parts = [f"headroom {self.headroom:g}"]
        if self.quantile != TTFT_QUANTILE:
            parts.append(f"quantile {self.quantile:g}")
        if self.cooldown_s is not None:
            parts.append(f"cool-down {self.cooldown_s:g} s")
        if self.min_prefill is not None:
            parts.append(f"min-prefill {self.min_prefill}")
        return " ".join(parts)


SPEC_KEYS = ("headroom", "quantile", "cooldown-s", "min-prefill")


def planner_spec(text: str) -> dict[str, float]:
    """`--planner KEY=VALUE[,KEY=VALUE...]`, keys of `SPEC_KEYS`."""
    got: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",")):
        key, eq, value = part.partition("=")
        if not eq or key not in SPEC_KEYS:
            raise argparse.ArgumentTypeError(
                f"--planner takes KEY=VALUE pairs of {', '.join(SPEC_KEYS)}, not {part!r}"
            )
        try:
            got[key] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"--planner {key} takes a number, not {value!r}"
            ) from None
    bad = (
        got.get("headroom", 0) < 0
        or not 0 < got.get("quantile", 0.5) < 1
        or got.get("cooldown-s", 0) < 0
        or got.get("min-prefill", 0) < 0
        or got.get("min-prefill", 0) != int(got.get("min-prefill", 0))
    )
    if bad:
        raise argparse.ArgumentTypeError(
            f"--planner {text!r}: headroom >= 0, 0 < quantile < 1, cooldown-s >= 0, "
            "min-prefill a whole number >= 0"
        )
    return got


def planner_variants(args: argparse.Namespace) -> list[Variant]:
    """Each planner of the run: `--headroom`'s and `--ttft-quantile`'s paired in order (a single
    value of either goes with each of the other's), then each `--planner`'s (its keys not given:
    the first planner's)."""
    hs, qs = list(args.headroom), list(args.ttft_quantile)
    if len(hs) != len(qs) and 1 not in (len(hs), len(qs)):
        raise ValueError(f"--headroom has {len(hs)} values and --ttft-quantile {len(qs)}")
    n = max(len(hs), len(qs))
    paired = [
        Variant(h, q)
        for h, q in zip(hs * n if len(hs) == 1 else hs, qs * n if len(qs) == 1 else qs)
    ]
    for spec in args.planner or []:
        cooldown, least = spec.get("cooldown-s"), spec.get("min-prefill")
        paired.append(Variant(
            spec.get("headroom", hs[0]), spec.get("quantile", qs[0]),
            cooldown, None if least is None else int(least),
        ))  # fmt: skip
    names = [v.name for v in paired]
    if len(set(names)) != len(names):
        raise ValueError(f"two planners are the same: {names}")
    return paired


def with_variant(args: argparse.Namespace, variant: Variant) -> argparse.Namespace:
    """`args` for one planner of `planner_variants`."""
    one = argparse.Namespace(**vars(args))
    one.headroom, one.ttft_quantile = [variant.headroom], [variant.quantile]
    if variant.cooldown_s is not None:
        one.cooldown_s = variant.cooldown_s
    if variant.min_prefill is not None:
        one.min_prefill = variant.min_prefill
    return one


def fewest(args: argparse.Namespace) -> tuple[int, int]:
    """The workers a scaling setup starts at: the fewest a role (`--min-prefill`, `--min-decode`)."""
    return args.min_prefill, args.min_decode


def trace_of(args: argparse.Namespace) -> str:
    return "quick" if args.quick else str(args.trace)


def phase_scale_of(args: argparse.Namespace) -> float:
    """`--phase-scale`, else `FULL_PHASE_SCALE` for the full trace and 1 for the others."""
    if args.phase_scale is not None:
        return float(args.phase_scale)
    return FULL_PHASE_SCALE if trace_of(args) == "full" else 1.0


def phases_of(args: argparse.Namespace, trace: str | None = None) -> list[Phase]:
    make = TRACES[trace or trace_of(args)]
    return scaled(
        make(args.base_rate, args.prompt_tokens, args.output_tokens), phase_scale_of(args)
    )


def startup_of(args: argparse.Namespace) -> float:
    """A new worker's modeled start-up: `--startup-s`, else (`--quick`: 5 s) the profile's x the
    phase scale (the run shrunk in time as a whole, so a phase keeps its length in start-ups)."""
    given = knob(args, "startup_s", 5.0, -1.0)
    return given if given >= 0 else parse_profile(args.simulate).startup_s * phase_scale_of(args)


def knob(args: argparse.Namespace, name: str, quick_value: float, default: float) -> float:
    value = getattr(args, name)
    return value if value is not None else (quick_value if args.quick else default)


def spares_of(args: argparse.Namespace) -> int:
    """Spare workers a role, started parked before the load: `--spares`, else as many as a
    role can grow by, so that no process starts while the load runs (a drained one parks
    again)."""
    most = max(args.max_prefill - args.min_prefill, args.max_decode - args.min_decode)
    return int(args.spares if args.spares is not None else most)


def controller_s(args: argparse.Namespace, name: str, quick_value: float, default: float) -> float:
    """A controller's modeled seconds (the planner's interval and cool-down, HPA's period and
    stabilization): the flag's, else (`--quick`: `quick_value`) its default x the phase scale.
    The run is the trace shrunk in time as a whole: a phase keeps its length in cool-downs and
    in HPA periods as it keeps it in start-ups; at phase scale 1 they are the defaults."""
    return knob(args, name, quick_value, default * phase_scale_of(args))


def planner_seconds(args: argparse.Namespace) -> tuple[float, float, float]:
    """The planner's interval, cool-down and arrival window (12 intervals), modeled seconds."""
    interval = controller_s(args, "interval_s", 2.0, 5.0)
    return interval, controller_s(args, "cooldown_s", 10.0, 60.0), 12 * interval


def hpa_seconds(args: argparse.Namespace) -> tuple[float, float]:
    """HPA's period and scale-down stabilization, modeled seconds (its defaults in --quick)."""
    return (
        controller_s(args, "hpa_period_s", PERIOD_S, PERIOD_S),
        controller_s(args, "hpa_stabilization_s", STABILIZATION_S, STABILIZATION_S),
    )


# ----------------------------------------------------------------------------- the fixed split


def fixed_split(args: argparse.Namespace, phases: list[Phase]) -> tuple[int, int]:
    """The fewest workers (then fewer prefill) meeting 90% attainment in every held phase on
    the discrete-event model (the planner's own: pd-bench plan), each phase held for
    `STEADY_S` at its rate whatever its length: the split meets the SLOs at the peak (the 8x
    burst held, not only its first seconds from an empty queue)."""
    profile = parse_profile(args.simulate)
    search = Search(SLO(args.slo_ttft_ms, args.slo_itl_ms), 0.9, "poisson", args.seed)
    held = [ph for ph in phases if ph.plateau]
    for total in range(2, args.budget + 1):
        for p in range(1, total):
            spec = ClusterSpec.disaggregated(
                profile, p, profile.tp, total - p, profile.tp, Limits()
            )
            if all(
                attainment_at(spec, [
                    SimJob(f"{ph.name}-{i}", (SimTurn(ph.prompt_tokens, ph.output_tokens),))
                    for i in range(max(50, int(ph.rate * STEADY_S)))
                ], ph.rate, search) >= 0.9
                for ph in held
            ):  # fmt: skip
                return p, total - p
    return args.max_prefill, args.max_decode


def given_split(text: str) -> tuple[int, int]:
    """One `P,D` of `--fixed`."""
    try:
        p, d = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError("--fixed takes P,D: two whole numbers") from None
    if p < 1 or d < 1:
        raise ValueError("--fixed needs at least one worker a role")
    return p, d


def given_splits(text: str) -> list[tuple[int, int]]:
    """`--fixed P,D[/P,D...]`, smallest first (fewest workers, then fewer prefill)."""
    return sorted({given_split(part) for part in text.split("/")}, key=lambda s: (sum(s), s))


def fixed_candidates(args: argparse.Namespace, phases: list[Phase]) -> list[tuple[int, int]]:
    """The fixed splits to run: `--fixed`'s, else the model's and one more prefill worker (what
    the model leaves out, the TTFT outside prefill, is missed in prefill)."""
    if args.fixed:
        return given_splits(args.fixed)
    p, d = fixed_split(args, phases)
    return [(p, d)] + ([(p + 1, d)] if p + 1 + d <= args.budget else [])


def meets_peak(result: dict[str, Any], phases: list[Phase]) -> bool:
    """90% attainment in every held phase (the peak included)."""
    held = [ph.name for ph in phases if ph.plateau and ph.name in result["phases"]]
    return all(result["phases"][name]["attainment"] >= 0.9 for name in held)


# ----------------------------------------------------------------------------- one setup


@dataclass(frozen=True)
class Job:
    """One setup to run: its kind, the name its logs and results go under, its workers at the
    start, and the arguments and trace it runs with."""

    kind: str
    name: str
    initial: tuple[int, int]
    args: argparse.Namespace
    phases: list[Phase]
    # Setups at once: every one set up before the first load begins (`ready`, a barrier of
    # them all and `run_jobs`), the loads `delay_s` apart after it; None: at once when ready
    ready: Any = None
    delay_s: float = 0.0
    # ... and none torn down before every load has ended (`done`: its process exits, spares
    # stop, a summary is built: CPU on the cores a later load still runs on)
    done: Any = None


def stagger_of(args: argparse.Namespace, phases: list[Phase]) -> float:
    """Real seconds between the starts of setups run at once: `--stagger-s`, else 1.25 x the
    shortest held phase (the burst), so that no two setups meet their peak together on a
    machine whose few cores they share."""
    if args.stagger_s is not None:
        return float(args.stagger_s)
    held = [ph.seconds for ph in phases if ph.plateau]
    return 1.25 * min(held, default=0.0) * args.time_scale


def run_job(job: Job) -> dict[str, Any]:
    """One setup from start to summary (in a process of its own under `run_jobs`)."""
    started = time.perf_counter()
    print(f"pd-bench elastic: {job.name} ...", file=sys.stderr, flush=True)
    try:
        got = asyncio.run(run_setup(job.kind, job.args, job.phases, job.initial, job.name, job))
    except BaseException:
        for barrier in (job.ready, job.done):
            if barrier is not None:
                barrier.abort()  # the others go on without this one
        raise
    print(
        f"pd-bench elastic: {job.name} done in {time.perf_counter() - started:.0f} s",
        file=sys.stderr, flush=True,
    )  # fmt: skip
    return summary(got, job.args, job.phases)


def run_jobs(
    jobs: list[Job], at_once: int, stagger_s: float = 0.0
) -> tuple[list[dict[str, Any]], tuple[float | None, float | None]]:
    """Every job's summary, in order, and when the first load began and the last ended
    (`time.time()`; None: in turn): `at_once` at a time, each in a fresh process (0: all at
    once), the first of those all set up before any load begins and torn down after every
    load ended (a setup's process starts and stops take the cores a running load's simulated
    hosts need), their loads `stagger_s` apart; or in turn in this one (1)."""
    if at_once == 1 or len(jobs) == 1:
        return [run_job(job) for job in jobs], (None, None)
    spawn = multiprocessing.get_context("spawn")  # no event loop nor thread carried over
    workers = len(jobs) if at_once <= 0 else min(at_once, len(jobs))
    with spawn.Manager() as manager, ThreadPoolExecutor(1) as waiter:
        # the first setups and this process: all set up, then all loads ended
        ready, done = manager.Barrier(workers + 1), manager.Barrier(workers + 1)
        delayed = [
            replace(job, ready=ready, delay_s=i * stagger_s, done=done) if i < workers else job
            for i, job in enumerate(jobs)
        ]
        began = waiter.submit(_passed, ready)
        ended = waiter.submit(_passed, done)  # after `began`: one thread
        try:
            with ProcessPoolExecutor(max_workers=workers, mp_context=spawn) as pool:
                summaries = list(pool.map(run_job, delayed))
        except BaseException:
            ready.abort()  # a setup's process died before a barrier: none waits on it
            done.abort()
            raise
        return summaries, (began.result(), ended.result())


def _passed(barrier: Any) -> float | None:
    """When every setup passed `barrier` (None: one failed before)."""
    try:
        barrier.wait()
    except threading.BrokenBarrierError:
        return None
    return time.time()


async def _until_loaded(job: Job | None) -> None:
    """Wait for the other setups run at once, then this one's share of the stagger."""
    if job is None or job.ready is None:
        return
    await _wait(job, job.ready)
    await asyncio.sleep(job.delay_s)


async def _until_unloaded(job: Job | None) -> None:
    """Wait until the loads of the other setups run at once have ended too."""
    if job is not None and job.done is not None:
        await _wait(job, job.done)


async def _wait(job: Job, barrier: Any) -> None:
    try:
        await asyncio.to_thread(barrier.wait)
    except threading.BrokenBarrierError:
        print(f"pd-bench elastic: {job.name}: a setup beside it failed", file=sys.stderr)


async def run_setup(
    kind: str,
    args: argparse.Namespace,
    phases: list[Phase],
    initial: tuple[int, int],
    name: str | None = None,
    job: Job | None = None,
) -> Run:
    k = args.time_scale
    roles = ["prefill"] * initial[0] + ["decode"] * initial[1]
    folder = (name or kind).replace(" ", "-").replace(",", "-")
    log_dir = (
        os.path.join(args.log_dir, folder)
        if args.log_dir
        else tempfile.mkdtemp(prefix=f"pd-elastic-{folder}-")
    )
    os.makedirs(log_dir, exist_ok=True)
    sim = start_sim_workers(args.simulate, roles, time_scale=k, log_dir=log_dir)
    router = None
    run = Run(kind, initial=initial)
    try:
        for url in sim.all_urls:
            await _wait_healthy(url, sim.procs)
        port = free_port()
        router = _spawn(
            "pd.router.main", "--port", str(port), "--admin-token", ADMIN,
            "--local-prefill-max-tokens", "0", "--health-interval", "0.5",
            *[a for u in sim.urls.get("prefill", []) for a in ("--prefill", u)],
            *[a for u in sim.urls.get("decode", []) for a in ("--decode", u)],
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        await _wait_healthy(url, [router, *sim.procs])
        async with aiohttp.ClientSession() as http:
            before = await clock_counters(http, sim.all_urls)
        run = await _drive(kind, args, phases, url, sim, log_dir, run, job)
        async with aiohttp.ClientSession() as http:
            clock = overshoot(before, await clock_counters(http, sim.all_urls))
        run.overshoot = clock["worst"]
    finally:
        if router is not None:
            router.terminate()
            router.wait(timeout=30)
        sim.stop()
    return run


async def _drive(
    kind: str,
    args: argparse.Namespace,
    phases: list[Phase],
    url: str,
    sim: SimWorkers,
    log_dir: str,
    run: Run,
    job: Job | None = None,
) -> Run:
    k = args.time_scale
    interval, cooldown, window = planner_seconds(args)
    cfg = PlannerConfig(
        router=url, connector="simulated", slo_ttft_ms=args.slo_ttft_ms,
        slo_itl_ms=args.slo_itl_ms, interval_s=interval, cooldown_s=cooldown, window_s=window,
        min_prefill=args.min_prefill, max_prefill=args.max_prefill, min_decode=args.min_decode,
        max_decode=args.max_decode, budget=args.budget, time_scale=k, admin_token=ADMIN,
        cluster_token=os.environ["PD_CLUSTER_TOKEN"], simulate=args.simulate,
        startup_s=startup_of(args), log_dir=log_dir, port=0,
        spares=spares_of(args), headroom=args.headroom[0],
        ttft_quantile=args.ttft_quantile[0],
        forecast_s=startup_of(args) if args.forecast else 0.0,
    )  # fmt: skip
    stop = asyncio.Event()
    service: PlannerService | None = None
    controller: asyncio.Task[None] | None = None
    connector: SimulatedConnector | None = None
    hpa_targets = {"prefill": run.initial[0], "decode": run.initial[1]}
    if kind == "planner":
        service = PlannerService(cfg)
        assert isinstance(service.connector, SimulatedConnector)
        connector = service.connector
        await connector.start()  # its spares, before the load
    elif kind == "hpa":
        connector = SimulatedConnector(
            url, args.simulate, time_scale=k, startup_s=cfg.startup_s, admin_token=ADMIN,
            cluster_token=cfg.cluster_token, log_dir=log_dir, spares=cfg.spares,
        )  # fmt: skip
        await connector.start()
    await _until_loaded(job)
    if service is not None:
        controller = asyncio.create_task(service.run(stop))
    elif kind == "hpa" and connector is not None:
        controller = asyncio.create_task(_hpa(args, url, connector, hpa_targets, stop))

    def sample(at: float) -> Sample:
        alive = {"prefill": run.initial[0], "decode": run.initial[1]}
        for m in connector.workers.values() if connector else ():
            alive[m.role] += m.proc.poll() is None
        if service is not None:
            targets = {r: s.target or 0 for r, s in service.planner.roles.items()}
        elif kind == "hpa":
            targets = dict(hpa_targets)
        else:
            targets = {"prefill": run.initial[0], "decode": run.initial[1]}
        return Sample(at, alive, targets)

    schedule = arrivals(phases, args.seed)
    prompts = _prompts(args, phases, schedule)
    t0 = time.perf_counter()

    async def sampler() -> None:
        while True:
            run.samples.append(sample((time.perf_counter() - t0) / k))
            await asyncio.sleep(SAMPLE_S)

    sampling = asyncio.create_task(sampler())
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as http:

        async def one(i: int, at: float, phase: int) -> RequestRecord:
            delay = t0 + at * k - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            ph = phases[phase]
            record = RequestRecord(kind, None, str(i), 0, at)
            record.sent_s = (time.perf_counter() - t0) / k
            body = {"model": "default", "prompt": prompts[i], "max_tokens": ph.output_tokens,
                    "ignore_eos": True}  # fmt: skip
            await stream_request(http, url, body, record, chat=False, timeout_s=600 * k)
            _scale(record, k)
            return record

        run.records = list(
            await asyncio.gather(*(one(i, at, ph) for i, (at, ph) in enumerate(schedule)))
        )
        run.phase_of = [ph for _, ph in schedule]
    run.wall_s = time.perf_counter() - t0
    sampling.cancel()
    run.samples.append(sample((time.perf_counter() - t0) / k))
    await _until_unloaded(job)  # the workers it holds from here on are not counted
    stop.set()
    if controller is not None:
        await controller
    if kind == "hpa" and connector is not None:
        await connector.close()
    if service is not None:
        run.fit_error = fit_error(service, args.simulate)
        run.decisions = [
            f"{d.at:.0f} s: {d.line()}"
            for d in service.planner.decisions
            if d.reasons != ("holds",)
        ]
    return run


async def _hpa(
    args: argparse.Namespace,
    url: str,
    connector: SimulatedConnector,
    targets: dict[str, int],
    stop: asyncio.Event,
) -> None:
    """HPA v2 per role every period (15 s x the phase scale, modeled) on the router's running
    requests per worker."""
    k = args.time_scale
    reader = ClusterReader(url, k, admin_token=ADMIN)
    period, stabilization = hpa_seconds(args)
    hpas = {
        role: HPA(target, low, high, stabilization_s=stabilization)
        for role, target, low, high in (
            ("prefill", args.hpa_prefill_target, args.min_prefill, args.max_prefill),
            ("decode", args.hpa_decode_target, args.min_decode, args.max_decode),
        )
    }
    async with aiohttp.ClientSession() as http:
        while not stop.is_set():
            try:
                obs = await reader.observe(http)
            except Exception:  # the next period tries again
                obs = None
            if obs is not None:
                for role, hpa in hpas.items():
                    ready = obs.of(role)
                    per = sum(w.inflight for w in ready) / len(ready) if ready else 0.0
                    targets[role] = hpa.desired(obs.at, len(ready), per)
                decision = Decision(obs.at, targets["prefill"], targets["decode"], ("hpa",))
                await connector.apply(decision, obs)
            try:
                await asyncio.wait_for(stop.wait(), period * k)
            except TimeoutError:
                pass


def _prompts(
    args: argparse.Namespace, phases: list[Phase], schedule: list[tuple[float, int]]
) -> list[list[int]]:
    """One prompt of its phase's length a request, token ids of random words (nothing shared,
    nothing cached). Ids, not text: the workers model GPUs, and tokenizing 8 prompts of 4000
    tokens a second would take their host a third of a core that no GPU spends (a setup's
    CPU at the 8x burst, with three more setups beside it, slowed every simulated step)."""
    text = TokenText(load_tokenizer(default_model_path()))
    rng = random.Random(args.seed)
    return [text.random_ids(phases[ph].prompt_tokens, rng) for _, ph in schedule]


def _scale(r: RequestRecord, k: float) -> None:
    """Real seconds to modeled ones."""
    if r.ttft_s is not None:
        r.ttft_s /= k
    if r.e2e_s is not None:
        r.e2e_s /= k
    r.itl_s = [g / k for g in r.itl_s]


def fit_error(service: PlannerService, profile_name: str) -> float | None:
    """The largest relative error of the planner's decode-step fit against the profile's cost
    model, over the steps it fitted (their rows and KV tokens)."""
    fit = service.planner.step_fit
    if fit.coefficients is None:
        return None
    cost = CostModel(parse_profile(profile_name))
    worst = 0.0
    for s in fit.samples:
        true = cost.batch_s(s.rows, s.kv_tokens - s.rows)
        pred = fit.predict(s.rows, s.kv_tokens)
        assert pred is not None
        worst = max(worst, abs(pred - true) / true)
    return worst


# ----------------------------------------------------------------------------- the figures


def summary(run: Run, args: argparse.Namespace, phases: list[Phase]) -> dict[str, Any]:
    slo = SLO(args.slo_ttft_ms, args.slo_itl_ms)
    gpus = _tp(args.simulate)
    gpu_s = 0.0
    for before, after in zip(run.samples, run.samples[1:]):
        gpu_s += (after.at - before.at) * sum(before.workers.values()) * gpus
    ups = downs = 0
    turns: dict[str, int] = {}  # every reversal, by the phase it fell in
    within: dict[str, int] = {}  # reversals between two moves of one phase
    spans = bounds(phases)

    def phase_at(at: float) -> str:
        i = next((j for j, (s, e) in enumerate(spans) if s <= at < e), len(spans) - 1)
        return phases[i].name

    for role in ("prefill", "decode"):
        series = [(s.at, s.targets[role]) for s in run.samples]
        last_dir, last_phase = 0, None
        for (_, was), (at, now) in zip(series, series[1:]):
            if was == now:
                continue
            step = 1 if now > was else -1
            ups += step > 0
            downs += step < 0
            phase = phase_at(at)
            if last_dir and step != last_dir:
                turns[phase] = turns.get(phase, 0) + 1
                if phase == last_phase:
                    within[phase] = within.get(phase, 0) + 1
            last_dir, last_phase = step, phase
    per_phase = {}
    for i, ph in enumerate(phases):
        recs = [r for r, p in zip(run.records, run.phase_of) if p == i]
        if recs:
            s = summarize(recs, slo)
            per_phase[ph.name] = {
                "requests": s["requests"], "attainment": s["slo_attainment"],
                "ttft_p90_ms": s["ttft_ms"]["p90"], "tpot_p90_ms": s["tpot_ms"]["p90"],
            }  # fmt: skip
    whole = summarize(run.records, slo) if run.records else {"slo_attainment": 0.0, "requests": 0}
    return {
        "attainment": whole["slo_attainment"],
        "requests": whole["requests"],
        "gpu_hours": round(gpu_s / 3600, 4),
        "scale_ups": ups,
        "scale_downs": downs,
        "direction_changes": sum(turns.values()),
        "direction_changes_per_phase": turns,
        # the "per plateau": a phase's first move follows the load into it; a reversal
        # after a move of the same phase is the controller turning back on one load
        "direction_changes_within_phase": within,
        "lost": sum(not r.ok for r in run.records),
        "errors": whole.get("errors", {}),
        "initial": {"prefill": run.initial[0], "decode": run.initial[1]},
        "most_workers": {
            r: max((s.workers[r] for s in run.samples), default=0) for r in ("prefill", "decode")
        },
        "phases": per_phase,
        "wall_s": round(run.wall_s, 1),
        # (real - K x modeled) / (K x modeled) step seconds of the worst initial worker: what
        # this machine added to every simulated step (docs/simulation.md, the clock check)
        "clock_overshoot": run.overshoot,
        "timeline": _timeline(run.samples),
        **({"fit_error": round(run.fit_error, 4)} if run.fit_error is not None else {}),
        **({"decisions": run.decisions} if run.decisions else {}),
        # each request: [due s, phase, TTFT s, time per output token s] (None: none)
        "requests_detail": [
            [round(r.planned_s, 2), p, _round(r.ttft_s), _round(r.tpot_s)]
            for r, p in zip(run.records, run.phase_of)
        ],
    }


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 4)


def _timeline(samples: list[Sample]) -> list[list[float]]:
    """[modeled s, prefill workers, decode workers], one a modeled second at most."""
    out: list[list[float]] = []
    for s in samples:
        if not out or s.at - out[-1][0] >= 1.0:
            out.append([round(s.at, 1), s.workers["prefill"], s.workers["decode"]])
    return out


def offered_line(phases: list[Phase]) -> tuple[list[float], list[float]]:
    """The offered rate's corners (seconds, requests a second): held phases flat, a ramp a
    slope from the rate before it."""
    ts: list[float] = []
    rates: list[float] = []
    before = phases[0].rate if phases else 0.0
    for (start, end), ph in zip(bounds(phases), phases):
        ts += [start, end]
        rates += [before if ph.ramp else ph.rate, ph.rate]
        before = ph.rate
    return ts, rates


def rows_of(out: dict[str, Any], setups: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """(name, summary) of each setup run, the planners beside the first included."""
    return [(kind, out[kind]) for kind in setups] + [
        (f"planner {name}", got) for name, got in out.get("planners", {}).items()
    ]


def _without_detail(v: Any) -> Any:
    """`v` without any `requests_detail` (the per-request figures: --out's file only)."""
    if isinstance(v, dict):
        return {k: _without_detail(x) for k, x in v.items() if k != "requests_detail"}
    return v


def write_plot(path: str, out: dict[str, Any], setups: list[str], phases: list[Phase]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = rows_of(out, setups)
    fig, axes = plt.subplots(len(rows), 1, figsize=(9, 2.6 * len(rows)), sharex=True)
    axes = [axes] if len(rows) == 1 else list(axes)
    edges = bounds(phases)
    for ax, (kind, got_kind) in zip(axes, rows):
        line = got_kind["timeline"]
        t = [p[0] for p in line]
        ax.step(t, [p[1] for p in line], where="post", label="prefill workers")
        ax.step(t, [p[2] for p in line], where="post", label="decode workers")
        load = ax.twinx()
        load.plot(*offered_line(phases), color="gray", alpha=0.5, label="offered req/s")
        load.set_ylabel("req/s", color="gray")
        for (start, _), ph in zip(edges, phases):
            got = got_kind["phases"].get(ph.name)
            if got:
                ax.text(
                    start + 1, 0.04, f"{ph.name}\n{100 * got['attainment']:.0f}%", fontsize=7,
                    transform=ax.get_xaxis_transform(),
                )  # fmt: skip
        ax.set_ylabel("workers")
        ax.set_title(
            f"{kind}: attainment {100 * got_kind['attainment']:.0f}%, "
            f"{got_kind['gpu_hours']:.3f} GPU-h", fontsize=9,
        )  # fmt: skip
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    axes[-1].set_xlabel("modeled seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _tp(profile: str) -> int:
    return parse_profile(profile).tp


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("PD_CLUSTER_TOKEN", "pd-bench-elastic")
    # the arguments alone (no module the command line carries) travel to each setup's process
    args = argparse.Namespace(**{k: v for k, v in vars(args).items() if not k.startswith("_")})
    phases = phases_of(args)
    setups = [s for s in args.setups.split(",") if s]
    bad = [s for s in setups if s not in SETUPS]
    if bad:
        print(f"pd-bench elastic: unknown setups {bad} (of {', '.join(SETUPS)})", file=sys.stderr)
        return 2
    try:
        variants = planner_variants(args)
    except ValueError as e:
        print(f"pd-bench elastic: {e}", file=sys.stderr)
        return 2
    if args.fixed:
        try:
            given_splits(args.fixed)
        except ValueError as e:
            print(f"pd-bench elastic: --fixed {args.fixed!r}: {e}", file=sys.stderr)
            return 2
    stagger = stagger_of(args, phases)
    out: dict[str, Any] = {
        "profile": args.simulate,
        "trace": trace_of(args), "phase_scale": phase_scale_of(args),
        "startup_s": round(startup_of(args), 1),
        "time_scale": args.time_scale, "quick": args.quick,
        "slo": {"ttft_ms": args.slo_ttft_ms, "itl_ms": args.slo_itl_ms},
        "phases": [ph.__dict__ for ph in phases],
        "headroom": args.headroom[0], "ttft_quantile": args.ttft_quantile[0],
        "planner_s": dict(zip(("interval", "cooldown", "window"), planner_seconds(args))),
        "hpa_s": dict(zip(("period", "stabilization"), hpa_seconds(args))),
        "stagger_s": round(stagger, 1),
        "hpa_targets": {"prefill": args.hpa_prefill_target, "decode": args.hpa_decode_target},
    }  # fmt: skip
    started = time.perf_counter()
    if "hpa" in setups and args.hpa_tune:
        out["hpa_tuning"] = tune_hpa(args)
        best = max(out["hpa_tuning"], key=lambda t: (round(t["attainment_4x"], 2), -t["gpu_hours"]))
        args.hpa_prefill_target = best["target"]
        out["hpa_targets"]["prefill"] = best["target"]
    fixed = fixed_candidates(args, phases) if "fixed" in setups else []
    first, *more = variants
    if "planner" not in setups:
        more = []
    beside = [(v, with_variant(args, v)) for v in more]
    jobs = [
        Job(kind, kind, fewest(args), with_variant(args, first), phases)
        for kind in setups if kind != "fixed"
    ] + [
        Job("planner", f"planner {v.name}", fewest(one), one, phases) for v, one in beside
    ] + [Job("fixed", f"fixed {p},{d}", (p, d), args, phases) for p, d in fixed]  # fmt: skip
    with CpuWatch() as cpu:
        done, (began, ended) = run_jobs(jobs, args.jobs, stagger)
    results = dict(zip((j.name for j in jobs), done))
    out["cpu"] = cpu.summary(since=began, until=ended)  # the loads, not the set-ups and after
    for kind in setups:
        if kind != "fixed":
            out[kind] = results[kind]
    if more:
        out["planners"] = {v.name: results[f"planner {v.name}"] for v in more}
    if fixed:
        tried = [(split, results[f"fixed {split[0]},{split[1]}"]) for split in fixed]
        met = [(split, r) for split, r in tried if meets_peak(r, phases)]
        split, out["fixed"] = met[0] if met else tried[-1]
        out["fixed_split"] = {"prefill": split[0], "decode": split[1], "meets_peak": bool(met)}
        out["fixed_tried"] = [
            {"prefill": p, "decode": d, "attainment": r["attainment"],
             "gpu_hours": r["gpu_hours"], "meets_peak": meets_peak(r, phases),
             "phases": {n: ph["attainment"] for n, ph in r["phases"].items()}}
            for (p, d), r in tried
        ]  # fmt: skip
    else:
        out["fixed_split"] = None
    out["wall_s"] = round(time.perf_counter() - started, 1)
    if "fit_error" in out.get("planner", {}):
        out["fit_error"] = out["planner"]["fit_error"]
    if "planner" in out and "fixed" in out and out["fixed"]["gpu_hours"]:
        out["gpu_hours_vs_fixed"] = round(
            out["planner"]["gpu_hours"] / out["fixed"]["gpu_hours"], 3
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    if args.plot:
        write_plot(args.plot, out, setups, phases)
    if args.json:  # the per-request detail only in --out's file
        print(json.dumps(_without_detail(out)))
    else:
        print(render(out, setups))
    return 0


def tune_hpa(args: argparse.Namespace) -> list[dict[str, Any]]:
    """HPA's prefill target tried on the plateau trace at phase scale 1 (its 4x plateau longer
    than five start-ups of the run's), the targets at once: each target's attainment at 4x."""
    targets = [float(t) for t in args.hpa_tune.split(",") if t]
    jobs = []
    for target in targets:
        tuned = argparse.Namespace(**vars(args))
        tuned.hpa_prefill_target, tuned.phase_scale = target, 1.0
        tuned.startup_s = startup_of(args)  # the run's start-up and HPA seconds
        tuned.hpa_period_s, tuned.hpa_stabilization_s = hpa_seconds(args)
        jobs.append(Job("hpa", f"hpa-tune {target:g}", (1, 1), tuned, phases_of(tuned, "plateau")))
    return [
        {"target": target, "attainment_4x": got["phases"]["hold-4x"]["attainment"],
         "gpu_hours": got["gpu_hours"], "most_workers": got["most_workers"]}
        for target, got in zip(targets, run_jobs(
            jobs, args.jobs, stagger_of(args, jobs[0].phases)
        )[0])
    ]  # fmt: skip


def render(out: dict[str, Any], setups: list[str]) -> str:
    lines = [
        f"pd-bench elastic: {out['profile']}, trace {out['trace']} at phase scale "
        f"{out['phase_scale']:g} (start-up {out['startup_s']:g} s), time scale "
        f"{out['time_scale']:g}, SLO TTFT {out['slo']['ttft_ms']:g} ms, ITL "
        f"{out['slo']['itl_ms']:g} ms; planner headroom {out['headroom']:g}, TTFT quantile "
        f"{out.get('ttft_quantile', TTFT_QUANTILE):g}, cool-down "
        f"{out['planner_s']['cooldown']:g} s, window {out['planner_s']['window']:g} s; HPA "
        f"target {out['hpa_targets']['prefill']:g} a P, period {out['hpa_s']['period']:g} s, "
        f"stabilization {out['hpa_s']['stabilization']:g} s; fixed split "
        f"{out.get('fixed_split')}; "
        f"setups {out['stagger_s']:g} s apart, {out['wall_s']:.0f} s in all",
        f"{'setup':8} {'attain':>7} {'GPU-h':>8} {'ups':>4} {'downs':>5} {'turns':>5} "
        f"{'in-phase':>8} {'lost':>4} {'overshoot':>9}",
    ]
    rows = rows_of(out, setups)
    for kind, s in rows:
        lines.append(
            f"{kind:8} {s['attainment']:7.3f} {s['gpu_hours']:8.4f} {s['scale_ups']:4d} "
            f"{s['scale_downs']:5d} {s['direction_changes']:5d} "
            f"{max(s['direction_changes_within_phase'].values(), default=0):8d} {s['lost']:4d}"
            f" {s['clock_overshoot'] or 0:9.3f}"
        )
    for kind, s in rows:
        lines.append(f"{kind}: " + ", ".join(
            f"{name} {p['attainment']:.2f}" for name, p in s["phases"].items()
        ))  # fmt: skip
    for t in out.get("fixed_tried", []):
        verdict = "90% in every held phase" if t["meets_peak"] else "under 90% in a held phase"
        lines.append(
            f"fixed {t['prefill']} P + {t['decode']} D: {t['attainment']:.3f} at "
            f"{t['gpu_hours']:.3f} GPU-h, {verdict} ("
            + ", ".join(f"{n} {a:.2f}" for n, a in t["phases"].items())
            + ")"
        )
    if "hpa_tuning" in out:
        lines.append("HPA prefill targets tried at 4x: " + ", ".join(
            f"{t['target']:g}: {t['attainment_4x']:.2f} ({t['gpu_hours']:.3f} GPU-h)"
            for t in out["hpa_tuning"]
        ) + f"; chose {out['hpa_targets']['prefill']:g}")  # fmt: skip
    if "fit_error" in out:
        lines.append(f"planner fit error: {out['fit_error']:.3f}")
    if out.get("cpu"):
        cpu = out["cpu"]
        lines.append(
            f"CPU busy: {100 * cpu['mean']:.0f}% mean, {100 * cpu['max_window']:.0f}% in the "
            f"busiest {cpu['window_s']:g} s"
            + (f" (over {100 * LIMIT:.0f}%: raise --time-scale)" if cpu["over_limit"] else "")
            + (
                f", ending {cpu['max_window_end_s']:g} s into the loads; "
                f"{cpu['windows_over_limit']} of {cpu['windows']} windows over the line"
                if "windows" in cpu
                else ""
            )
        )
    if math.isfinite(out.get("gpu_hours_vs_fixed", math.nan)):
        lines.append(f"planner GPU-hours / fixed: {out['gpu_hours_vs_fixed']:.3f}")
    return "\n".join(lines)
