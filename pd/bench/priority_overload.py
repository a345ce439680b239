"""`pd-bench priority-overload`: do priority classes protect interactive requests under overload? (issue 45)

One simulated prefill worker and one simulated decode worker (`pd-worker --simulate PROFILE`,
steps at the profile's GPU costs x the time scale K) behind two real `pd-router`s with the same
concurrency budget (`--max-concurrency`): one with priority classes on (reserved slots, a queue
and a deadline per class, preemption before the first byte), one with `--no-priority` (one
first-come-first-served queue). Only one router is loaded at a time. Then, with a mix of classes
(`--mix`, default 20% interactive, 80% batch) sent as `X-Priority-Class`:

1. capacity: the mix through the `--no-priority` router at each of `--capacity-rates` (Poisson,
   rising, stopping after the first that misses): the highest rate with 90% of its requests
   within the SLOs (`max_rate_at_90pct`), or `--capacity R` to skip the sweep;
2. overload: `--num-requests` of the mix at `--overload` (2) x that capacity, the same requests
   at the same arrival times through each router;
3. unloaded: the overload run's interactive requests alone, at their same arrival times (the
   interactive load without the batch flood: its goodput is the baseline the overloaded runs'
   interactive goodput is held to, in the same requests a second).

Figures per run and class: TTFT and TPOT percentiles, SLO attainment, goodput (requests within
the SLOs a second, over the class's own span: its first send to its last answer, so a class is
not charged for the others' drain), and the requests refused (429), timed out in the router's
queue (408), preempted (503) or failed. Then the issue's targets: with classes on, interactive
TTFT p99 within its SLO and its goodput within 10% of the unloaded run's; with `--no-priority`,
interactive misses its SLO.

Every time is modeled (real over K): the clients send K times slower and divide latencies by K,
and the real-time knobs are scaled here: the routers' `--class-deadline-s` and the workers'
`--priority-aging-s` are given in modeled seconds and passed on x K. The clock check (each
phase's worst worker overshoot, pd/sim/launch.py) is reported; a phase over `--max-overshoot`
is flagged (raise K).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import random
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from pd.bench.engine import stop_workers
from pd.bench.serve.arrivals import arrival_times
from pd.bench.serve.cli import (
    BenchInputError,
    _resolve,
    _token_text,
    add_slo_arguments,
    add_workload_arguments,
    check_workload_args,
    workload_config,
)
from pd.bench.serve.client import OUTCOMES, RequestRecord
from pd.bench.serve.metrics import SLO, max_rate_at, summarize
from pd.bench.serve.priority import CLASSES, assign_classes, parse_mix
from pd.bench.serve.runner import Phase, Target, run_phase
from pd.bench.serve.text import TokenText
from pd.bench.serve.workloads import Job, build

SETUPS = ("priority", "no-priority")  # the two routers
RUNS = ("unloaded", "priority", "no-priority")  # the three phases at the overload's times
DEFAULT_DEADLINES = "system=30,interactive=10,default=30,batch=300"  # the router's, modeled here
MAX_OVERSHOOT = 0.05


def add_arguments(p: argparse.ArgumentParser) -> None:
    c = p.add_argument_group("the cluster")
    c.add_argument("--simulate", default="llama-3.1-8b:h100:tp1", help="the workers' profile")
    c.add_argument("--time-scale", type=float, default=5.0,
                   help="K: modeled seconds run K times slower (5 keeps 2 cores within 1%% of "
                   "the clock here; raise it if the overshoot is flagged)")  # fmt: skip
    c.add_argument("--chunk-size", type=int, default=2048, help="workers' step token budget")
    c.add_argument("--max-running", type=int, default=256, help="workers' running requests")
    c.add_argument("--priority-aging-s", type=float, default=5.0,
                   help="workers' aging, modeled seconds (passed on x K)")  # fmt: skip
    r = p.add_argument_group("the routers (both but --no-priority's classes)")
    r.add_argument("--max-concurrency", type=int, default=24, help="the budget of both routers")
    r.add_argument("--class-reserved", default="system=1", help="CLASS=N,... (priority router)")
    r.add_argument("--class-queue", default="system=64,interactive=64,default=128,batch=512",
                   help="CLASS=N,... (--no-priority queues every request as default)")  # fmt: skip
    r.add_argument("--class-deadline-s", default=DEFAULT_DEADLINES,
                   help="CLASS=S,... in modeled seconds (passed on x K)")  # fmt: skip
    add_workload_arguments(p)
    p.set_defaults(workload="random", input_len=1024, output_len=64, range_ratio=0.5,
                   num_requests=400)  # fmt: skip
    m = p.add_argument_group("the load")
    m.add_argument("--mix", default="interactive=0.2,batch=0.8", help="classes, as --priority-mix")
    m.add_argument("--capacity-rates", default="16,20,24,28",
                   help="rates of the capacity sweep, rising (req/s, modeled)")  # fmt: skip
    m.add_argument("--capacity-requests", type=int, default=150, help="requests per sweep rate")
    m.add_argument("--capacity", type=float, help="skip the sweep: the capacity (req/s)")
    m.add_argument("--overload", type=float, default=2.0, help="the overload, x the capacity")
    m.add_argument("--arrival", default="poisson", help="poisson or uniform")
    m.add_argument("--request-timeout", type=float, default=600.0, help="modeled seconds")
    add_slo_arguments(p)
    p.set_defaults(slo_ttft_ms=250.0, slo_tpot_ms=25.0)
    o = p.add_argument_group("output")
    o.add_argument("--quick", action="store_true",
                   help="a short run (~2 min): 2 sweep rates of 60 requests, 160 at the overload")  # fmt: skip
    o.add_argument("--max-overshoot", type=float, default=MAX_OVERSHOOT)
    o.add_argument("--json", action="store_true", help="print one JSON object")
    o.add_argument("--plot", help="write the figure here (PNG; needs matplotlib)")


# ------------------------------------------------------------------ configuration


def apply_quick(args: argparse.Namespace) -> None:
    if args.quick:
        args.capacity_requests = min(args.capacity_requests, 60)
        args.num_requests = min(args.num_requests, 160)
        rates = parse_rates(args.capacity_rates)
        if len(rates) > 2:
            args.capacity_rates = ",".join(f"{r:g}" for r in rates[1:3])


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise BenchInputError(f"--capacity-rates takes numbers, got {text!r}") from None
    if not rates or any(not r > 0 for r in rates) or rates != sorted(rates):
        raise BenchInputError(f"--capacity-rates must be rising rates > 0, got {text!r}")
    return rates


def scaled_classes(spec: str, factor: float, flag: str) -> str:
    """`CLASS=S,...` with every value x `factor` (modeled seconds to real ones)."""
    out = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        cls, eq, value = part.partition("=")
        if not eq or cls.strip() not in CLASSES:
            raise BenchInputError(f"{flag} {spec!r}: each entry is CLASS=S, CLASS one of "
                                  f"{', '.join(CLASSES)}")  # fmt: skip
        try:
            seconds = float(value)
        except ValueError:
            raise BenchInputError(f"{flag} {spec!r}: {value!r} is not a number") from None
        if not seconds > 0:
            raise BenchInputError(f"{flag} {spec!r}: each value must be > 0")
        out.append(f"{cls.strip()}={seconds * factor:g}")
    return ",".join(out)


def check(args: argparse.Namespace) -> dict[str, float]:
    """The flags, before anything starts; returns the mix."""
    check_workload_args(args)
    for name in ("time_scale", "overload", "request_timeout", "chunk_size", "max_running",
                 "priority_aging_s", "capacity_requests"):  # fmt: skip
        if not getattr(args, name) > 0:
            raise BenchInputError(f"--{name.replace('_', '-')} must be > 0")
    if args.max_concurrency < 1:
        raise BenchInputError("--max-concurrency must be >= 1: the classes act at a budget")
    if args.capacity is not None and not args.capacity > 0:
        raise BenchInputError("--capacity must be > 0")
    parse_rates(args.capacity_rates)
    scaled_classes(args.class_deadline_s, 1.0, "--class-deadline-s")
    try:
        mix = parse_mix(args.mix)
    except ValueError as e:
        raise BenchInputError(f"--mix {e}") from None
    if "interactive" not in mix:
        raise BenchInputError("--mix must send some interactive requests: they are measured")
    return mix


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The workers' flags beyond --simulate and --time-scale (no prefix cache: the same prompts
    go to every phase, and a phase must not find the last one's pages)."""
    return ["--chunk-size", str(args.chunk_size), "--max-running-requests",
            str(args.max_running), "--priority-aging-s", f"{args.priority_aging_s * args.time_scale:g}",
            "--no-prefix-cache"]  # fmt: skip


def router_argv(args: argparse.Namespace, setup: str) -> list[str]:
    """One router's flags beyond its port and workers."""
    out = ["--local-prefill-max-tokens", "0", "--health-interval", "0.5", "--log-level",
           "warning", "--max-concurrency", str(args.max_concurrency),
           "--class-reserved", args.class_reserved, "--class-queue", args.class_queue,
           "--class-deadline-s",
           scaled_classes(args.class_deadline_s, args.time_scale, "--class-deadline-s")]  # fmt: skip
    return out + (["--no-priority"] if setup == "no-priority" else [])


# ------------------------------------------------------------------ figures


def class_figures(records: list[RequestRecord], slo: SLO, cls: str) -> dict[str, Any]:
    """One class's figures over its own span (first send to last answer)."""
    mine = [r for r in records if r.priority_class == cls]
    if not mine:
        return {"requests": 0}
    s = summarize(mine, slo)
    outcomes = {o: sum(r.outcome == o for r in mine) for o in OUTCOMES}
    span = max(r.planned_s for r in mine) - min(r.planned_s for r in mine)
    offered = (len(mine) - 1) / span if span > 0 else None
    return {
        "requests": len(mine),
        **outcomes,
        "ttft_ms": s["ttft_ms"],
        "tpot_ms": s["tpot_ms"],
        "slo_attainment": s["slo_attainment"],
        "goodput_rps": s["goodput_rps"],
        "offered_rps": None if offered is None else round(offered, 3),
        "duration_s": s["duration_s"],
    }


def run_figures(
    records: list[RequestRecord], slo: SLO, classes: Sequence[str], clock: dict[str, Any]
) -> dict[str, Any]:
    s = summarize(records, slo)
    return {
        "requests": s["requests"],
        "completed": s["completed"],
        "slo_attainment": s["slo_attainment"],
        "duration_s": s["duration_s"],
        "overshoot": clock["worst"],
        "classes": {c: class_figures(records, slo, c) for c in classes},
    }


def targets(out: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets, from the three runs."""
    slo_ttft = out["slo"].get("ttft_ms")
    runs = out["runs"]
    got: dict[str, Any] = {}
    pri = runs.get("priority", {}).get("classes", {}).get("interactive")
    base = runs.get("unloaded", {}).get("classes", {}).get("interactive")
    fcfs = runs.get("no-priority", {}).get("classes", {}).get("interactive")
    if pri and pri.get("requests"):
        p99 = pri["ttft_ms"]["p99"]
        got["priority_interactive_ttft_p99_ms"] = p99
        got["priority_interactive_ttft_p99_within_slo"] = (
            None if slo_ttft is None else bool(p99 is not None and p99 <= slo_ttft)
        )
        if base and base.get("goodput_rps"):
            ratio = pri["goodput_rps"] / base["goodput_rps"]
            got["priority_interactive_goodput_vs_unloaded"] = round(ratio, 3)
            got["priority_interactive_goodput_within_10pct"] = ratio >= 0.9
    if fcfs and fcfs.get("requests"):
        p99 = fcfs["ttft_ms"]["p99"]
        got["no_priority_interactive_ttft_p99_ms"] = p99
        got["no_priority_interactive_attainment"] = fcfs["slo_attainment"]
        got["no_priority_interactive_misses_slo"] = bool(
            fcfs["slo_attainment"] < 0.9
            or (slo_ttft is not None and (p99 is None or p99 > slo_ttft))
        )
    batch = runs.get("priority", {}).get("classes", {}).get("batch")
    if batch and batch.get("requests"):
        lost = batch["refused"] + batch["timed_out"] + batch["preempted"]
        got["priority_batch_not_served"] = lost
        got["priority_batch_ttft_p99_ms"] = batch["ttft_ms"]["p99"]
    return got


# ------------------------------------------------------------------ the phases


@dataclass
class Cluster:
    """What the phases are sent to: the routers by setup, and the workers (for the clock)."""

    routers: dict[str, str]
    workers: list[str]


async def _clock(http: aiohttp.ClientSession, workers: list[str]) -> dict[str, Any]:
    from pd.sim.launch import clock_counters

    return await clock_counters(http, workers)


async def _phase(
    cluster: Cluster,
    target: Target,
    jobs: list[Job],
    phase: Phase,
) -> tuple[list[RequestRecord], dict[str, Any]]:
    """One phase and its clock check; waits for the workers to be idle before and after."""
    from pd.sim.launch import overshoot

    async with aiohttp.ClientSession() as http:
        await _idle(http, cluster.workers)
        before = await _clock(http, cluster.workers)
        records = await run_phase(target, jobs, phase)
        await _idle(http, cluster.workers)
        clock = overshoot(before, await _clock(http, cluster.workers))
    return records, clock


async def _idle(http: aiohttp.ClientSession, workers: list[str], timeout_s: float = 60) -> None:
    """Until no worker runs or holds a request (a preempted one's abort lands after its 503)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = 0
        for url in workers:
            async with http.get(f"{url}/health") as r:
                h = await r.json()
            busy += h.get("running", 0) + h.get("waiting", 0) + h.get("inflight_transfers", 0)
        if not busy:
            return
        await asyncio.sleep(0.2)


def timed_jobs(jobs: list[Job], rate: float, arrival: str, seed: int) -> list[Job]:
    """Copies of `jobs` carrying their arrival times at `rate` (so a subset keeps its times)."""
    times = arrival_times(len(jobs), rate, arrival, random.Random(seed))
    return [dataclasses.replace(j, at_s=t) for j, t in zip(jobs, times, strict=True)]


def _progress(args: argparse.Namespace, text: str) -> None:
    """A line on stderr as each phase ends (the run takes minutes)."""
    print(text, file=sys.stderr, flush=True)


async def measure(
    cluster: Cluster, args: argparse.Namespace, text: TokenText, mix: dict[str, float]
) -> tuple[dict[str, Any], dict[str, list[RequestRecord]]]:
    """The sweep, the two overloaded runs and the unloaded one; the output object and each
    overload-time run's records."""
    t_start = time.perf_counter()
    slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_itl_p99_ms)
    classes = list(mix)
    scale = args.time_scale
    targets_ = {s: await _resolve(Target(s, u), None) for s, u in cluster.routers.items()}
    timeout = args.request_timeout
    out: dict[str, Any] = {
        "profile": args.simulate,
        "time_scale": scale,
        "workload": {
            "name": args.workload,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "range_ratio": args.range_ratio,
        },
        "mix": mix,
        "slo": {k: v for k, v in vars(slo).items() if v is not None},
        "routers": {
            "max_concurrency": args.max_concurrency,
            "class_reserved": args.class_reserved,
            "class_queue": args.class_queue,
            "class_deadline_s_modeled": args.class_deadline_s,
        },
        "workers": {
            "chunk_size": args.chunk_size,
            "max_running": args.max_running,
            "priority_aging_s_modeled": args.priority_aging_s,
        },
    }
    # Warm-up: one request through each router (connections, the first tokenization).
    warm = build(dataclasses.replace(workload_config(args), num_requests=1), text)
    for t in targets_.values():
        await run_phase(t, warm, Phase(concurrency=1, request_timeout_s=timeout, time_scale=scale))

    # 1. capacity: the mix under --no-priority, rising rates, until one misses.
    sweep: list[dict[str, Any]] = []
    capacity = args.capacity
    if capacity is None:
        cfg = dataclasses.replace(workload_config(args), num_requests=args.capacity_requests)
        jobs = build(cfg, text)
        assign_classes(jobs, mix, args.seed)
        for i, rate in enumerate(parse_rates(args.capacity_rates)):
            phase = Phase(rate, args.arrival, request_timeout_s=timeout, seed=args.seed + 1000 + i,
                          time_scale=scale)  # fmt: skip
            records, clock = await _phase(cluster, targets_["no-priority"], jobs, phase)
            s = summarize(records, slo)
            point = {"rate": rate, "slo_attainment": s["slo_attainment"],
                     "goodput_rps": s["goodput_rps"], "req_per_s": s["req_per_s"],
                     "ttft_ms": s["ttft_ms"], "tpot_ms": s["tpot_ms"],
                     "errors": s["errors"], "overshoot": clock["worst"]}  # fmt: skip
            sweep.append(point)
            _progress(args, f"capacity sweep {rate:g} req/s: attainment {s['slo_attainment']:.3f}, "
                      f"TTFT p99 {s['ttft_ms']['p99']} ms, overshoot {clock['worst']:.2%}")  # fmt: skip
            if s["slo_attainment"] < 0.9:
                break
        capacity = max_rate_at(sweep)
        if capacity is None:
            raise BenchInputError(
                "no rate of --capacity-rates kept 90% within the SLOs under --no-priority: "
                f"give lower rates (or --capacity): {[(p['rate'], p['slo_attainment']) for p in sweep]}"
            )
    out["capacity"] = {"points": sweep, "max_rate_at_90pct": capacity,
                       "given": args.capacity is not None}  # fmt: skip

    # 2. the overload: the same requests at the same times through each router; 3. unloaded.
    rate = args.overload * capacity
    jobs = build(workload_config(args), text)
    assign_classes(jobs, mix, args.seed)
    jobs = timed_jobs(jobs, rate, args.arrival, args.seed)
    interactive = [j for j in jobs if j.priority_class == "interactive"]
    out["overload"] = {
        "factor": args.overload,
        "rate": round(rate, 3),
        "requests": len(jobs),
        "by_class": {c: sum(j.priority_class == c for j in jobs) for c in classes},
        "arrivals_s": round(max(j.at_s or 0.0 for j in jobs), 3),
    }
    runs: dict[str, Any] = {}
    kept: dict[str, list[RequestRecord]] = {}
    plan = [("priority", "priority", jobs), ("no-priority", "no-priority", jobs),
            ("unloaded", "priority", interactive)]  # fmt: skip
    for name, setup, phase_jobs in plan:
        phase = Phase(rate, args.arrival, request_timeout_s=timeout, time_scale=scale)
        records, clock = await _phase(cluster, targets_[setup], phase_jobs, phase)
        kept[name] = records
        runs[name] = run_figures(records, slo, classes if name != "unloaded" else ["interactive"],
                                 clock)  # fmt: skip
        runs[name]["flagged"] = clock["worst"] > args.max_overshoot
        i = runs[name]["classes"]["interactive"]
        _progress(args, f"{name}: interactive TTFT p99 {i['ttft_ms']['p99']} ms, attainment "
                  f"{i['slo_attainment']:.3f}, goodput {i['goodput_rps']} req/s; overshoot "
                  f"{clock['worst']:.2%}")  # fmt: skip
    out["runs"] = {n: runs[n] for n in RUNS}
    out["targets"] = targets(out)
    out["wall_s"] = round(time.perf_counter() - t_start, 1)
    return out, kept


# ------------------------------------------------------------------ output


def render(out: dict[str, Any]) -> str:
    lines = []
    cap = out["capacity"]
    if cap["points"]:
        lines.append("capacity sweep (--no-priority, the mix):")
        for p in cap["points"]:
            lines.append(f"  {p['rate']:>6g} req/s: attainment {p['slo_attainment']:.3f}  "
                         f"TTFT p50/p99 {p['ttft_ms']['p50']}/{p['ttft_ms']['p99']} ms  "
                         f"TPOT p50 {p['tpot_ms']['p50']} ms")  # fmt: skip
    ov = out["overload"]
    lines.append(f"capacity {cap['max_rate_at_90pct']:g} req/s; overload {ov['factor']:g}x = "
                 f"{ov['rate']:g} req/s, {ov['requests']} requests {ov['by_class']}")  # fmt: skip
    head = (f"{'run':>12} {'class':>12} {'sent':>5} {'ok':>5} {'429':>5} {'408':>5} {'503':>5} "
            f"{'fail':>5} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'attain':>7} "
            f"{'goodput':>8}")  # fmt: skip
    lines.append(head)
    for run, r in out["runs"].items():
        for cls, c in r["classes"].items():
            if not c.get("requests"):
                continue
            lines.append(
                f"{run:>12} {cls:>12} {c['requests']:>5} {c['completed']:>5} {c['refused']:>5} "
                f"{c['timed_out']:>5} {c['preempted']:>5} {c['failed']:>5} "
                f"{_ms(c['ttft_ms']['p50']):>9} {_ms(c['ttft_ms']['p99']):>9} "
                f"{_ms(c['tpot_ms']['p50']):>9} {c['slo_attainment']:>7.3f} "
                f"{c['goodput_rps']:>8.3f}"
            )
        if r.get("flagged"):
            lines.append(f"{run:>12} CLOCK OVERSHOT {r['overshoot']:.1%}: raise --time-scale")
    lines.append("targets: " + ", ".join(f"{k}={v}" for k, v in out["targets"].items()))
    return "\n".join(lines)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def plot(out: dict[str, Any], records: dict[str, list[RequestRecord]], path: str) -> None:
    """Interactive TTFT CDFs, then TTFT p99 and goodput per class, for the three runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"unloaded": "tab:green", "priority": "tab:blue", "no-priority": "tab:red"}
    slo_ttft = out["slo"].get("ttft_ms")
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), dpi=110)
    ax = axes[0]
    for run, recs in records.items():
        for cls, style in (("interactive", "-"), ("batch", ":")):
            xs = sorted(1000 * r.ttft_s for r in recs
                        if r.priority_class == cls and r.ttft_s is not None)  # fmt: skip
            sent = sum(r.priority_class == cls for r in recs)
            if xs:  # the share of the class's requests sent: refused ones never reach 1
                ax.plot(xs, [(i + 1) / sent for i in range(len(xs))], style,
                        color=colors[run], label=f"{run} {cls}")  # fmt: skip
    if slo_ttft is not None:
        ax.axvline(slo_ttft, color="grey", ls="--", lw=1, label="TTFT SLO")
    ax.set(xscale="log", xlabel="TTFT (ms, modeled)", ylabel="share of the class's requests",
           title="TTFT CDF at the overload's arrivals")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    classes = list(out["mix"])
    width = 0.8 / len(RUNS)
    for ax, key, title in ((axes[1], "ttft_p99", "TTFT p99 (ms, modeled; log)"),
                           (axes[2], "goodput_rps", "goodput (req/s within the SLOs)")):  # fmt: skip
        for k, run in enumerate(RUNS):
            ys = []
            for cls in classes:
                c = out["runs"][run]["classes"].get(cls) or {}
                if not c.get("requests"):
                    ys.append(math.nan)
                elif key == "ttft_p99":
                    ys.append(c["ttft_ms"]["p99"] if c["ttft_ms"]["p99"] is not None else math.nan)
                else:
                    ys.append(c["goodput_rps"])
            xs = [i + (k - (len(RUNS) - 1) / 2) * width for i in range(len(classes))]
            bars = ax.bar(xs, ys, width, color=colors[run], label=run)
            for b, y in zip(bars, ys):
                if not math.isnan(y):
                    ax.annotate(f"{y:.0f}" if key == "ttft_p99" else f"{y:.2f}",
                                (b.get_x() + b.get_width() / 2, y), ha="center", va="bottom",
                                fontsize=7)  # fmt: skip
        ax.set_xticks(range(len(classes)), classes)
        ax.set_title(title)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    if slo_ttft is not None:
        axes[1].axhline(slo_ttft, color="grey", ls="--", lw=1)
    axes[1].set_yscale("log")
    ov = out["overload"]
    fig.suptitle(f"{out['profile']}, 1 P + 1 D, budget {out['routers']['max_concurrency']}: "
                 f"{ov['factor']:g}x capacity ({ov['rate']:g} req/s), mix {out['mix']}",
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ------------------------------------------------------------------ the processes


def start_cluster(args: argparse.Namespace) -> tuple[Cluster, list[subprocess.Popen], Any]:
    from pd.bench.pd import _spawn, _wait_healthy
    from pd.ports import free_port
    from pd.sim.launch import start_sim_workers

    sim = start_sim_workers(args.simulate, ["prefill", "decode"], time_scale=args.time_scale,
                            per_process=1, worker_args=worker_argv(args))  # fmt: skip
    routers: list[subprocess.Popen] = []
    try:
        for url in sim.all_urls:
            asyncio.run(_wait_healthy(url, sim.procs))
        urls = {}
        for setup in SETUPS:
            port = free_port()
            routers.append(_spawn("pd.router.main", "--port", str(port),
                                  "--prefill", sim.urls["prefill"][0],
                                  "--decode", sim.urls["decode"][0],
                                  *router_argv(args, setup)))  # fmt: skip
            urls[setup] = f"http://127.0.0.1:{port}"
        for url in urls.values():
            asyncio.run(_wait_healthy(url, routers + sim.procs))
    except BaseException:
        stop(routers, sim)
        raise
    return Cluster(urls, sim.all_urls), routers, sim


def stop(routers: list[subprocess.Popen], sim: Any) -> None:
    stop_workers(routers)
    sim.stop()


def run(args: argparse.Namespace) -> int:
    try:
        apply_quick(args)
        mix = check(args)
        text = _token_text(None)
    except BenchInputError as e:
        print(f"pd-bench priority-overload: {e}", file=sys.stderr)
        return 2
    cluster, routers, sim = start_cluster(args)
    try:
        out, records = asyncio.run(measure(cluster, args, text, mix))
    except BenchInputError as e:
        print(f"pd-bench priority-overload: {e}", file=sys.stderr)
        return 1
    finally:
        stop(routers, sim)
    if args.plot:
        try:
            plot(out, records, args.plot)
            out["plot"] = args.plot
        except ImportError:
            print("pd-bench priority-overload: no plot (pip install matplotlib)", file=sys.stderr)
    if args.json:
        print(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode())
    else:
        print(render(out))
    return 0
