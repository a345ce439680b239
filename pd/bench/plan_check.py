"""`pd-bench plan-check`: the planner's discrete-event model against the process simulation, on
one cluster at a few rates (issue 23, item 5: "checked against the process simulation at two or
three points").

For each rate, the same requests at the same arrival times go to both:

- the DES (`pd/sim/cluster`, what `pd-bench plan` searches with): `plan_search.summary_at`;
- real processes: `--prefill-workers` + `--decode-workers` simulated workers (`pd-worker
  --simulate`, their steps sleeping K x the cost model's time) behind a real `pd-router`, driven
  by `pd-bench serve`'s own client with `--time-scale K`.

Both use the same workload builder and seed (the DES's stand-in for the tokenizer draws the same
lengths), the same arrivals (one seed per rate), the same scheduler limits (the workers get
`--chunk-size`, `--max-running-requests` and `--page-size` of the DES's `Limits`) and the same
policy (`round-robin` on both sides by default: the DES's `least-loaded` sees the workers
exactly, pd's `load-aware` does not). It prints TTFT, TPOT and ITL percentiles and SLO attainment
side by side, with process / DES ratios; a rate whose workers' clock overshot by more than
`--max-overshoot` is marked refused.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import sys
from typing import Any

import aiohttp
import orjson

from pd.bench import serve
from pd.bench.pd import _spawn, _wait_healthy
from pd.bench.serve.cli import BenchInputError, check_args, measure
from pd.bench.serve.runner import Target
from pd.ports import free_port
from pd.sim.launch import DEFAULT_MAX_OVERSHOOT, clock_counters, overshoot, start_sim_workers

DES_POLICY = {"round-robin": "round-robin", "load-aware": "least-loaded"}
FIGURES = (("ttft_ms", "p50"), ("ttft_ms", "p99"), ("tpot_ms", "p50"), ("tpot_ms", "p99"),
           ("itl_ms", "p50"), ("itl_ms", "p99"))  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    serve.add_arguments(p, targets=False)
    p.set_defaults(warmup=0, rates="2,4")
    c = p.add_argument_group("the cluster (both sides)")
    c.add_argument("--profile", required=True, help="MODEL:DEVICE[:tpN][:LINK], as --simulate")
    c.add_argument("--prefill-workers", type=int, default=2)
    c.add_argument("--decode-workers", type=int, default=1)
    c.add_argument("--policy", default="round-robin", choices=sorted(DES_POLICY),
                   help="pd-router's policy (the DES's: round-robin, or least-loaded for "
                   "load-aware)")  # fmt: skip
    c.add_argument("--chunk-size", type=int, default=8192)
    c.add_argument("--max-running", type=int, default=256)
    c.add_argument("--page-size", type=int, default=16)
    c.add_argument("--workers-per-process", type=int, default=8)
    c.add_argument("--max-overshoot", type=float, default=DEFAULT_MAX_OVERSHOOT)


def _des(args: argparse.Namespace, rate: float) -> dict[str, Any]:
    from pd.bench.plan_search import Search, run_at
    from pd.bench.serve.metrics import SLO, summarize
    from pd.bench.serve.sim_jobs import workload_jobs
    from pd.sim.cluster import ClusterSpec, Limits
    from pd.sim.profile import parse_profile

    profile = parse_profile(args.profile)
    tp = profile.tp
    limits = Limits(args.chunk_size, args.max_running, args.page_size, True)
    spec = ClusterSpec.disaggregated(
        profile, args.prefill_workers, tp, args.decode_workers, tp, limits,
        DES_POLICY[args.policy],
    )  # fmt: skip
    slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_itl_p99_ms)
    search = Search(slo, 0.9, args.arrival, args.seed, 0.02, None)
    jobs = workload_jobs(serve.cli.workload_config(args))
    return summarize(run_at(spec, jobs, rate, search, gaps=True), slo)


async def _process(args: argparse.Namespace, rates: list[float]) -> list[dict[str, Any]]:
    roles = ["prefill"] * args.prefill_workers + ["decode"] * args.decode_workers
    limits = ["--chunk-size", str(args.chunk_size), "--max-running-requests",
              str(args.max_running), "--page-size", str(args.page_size)]  # fmt: skip
    sim = start_sim_workers(args.profile, roles, time_scale=args.time_scale,
                            per_process=args.workers_per_process, worker_args=limits)  # fmt: skip
    router = None
    out = []
    try:
        for url in sim.all_urls:
            await _wait_healthy(url, sim.procs)
        port = free_port()
        router = _spawn(
            "pd.router.main", "--port", str(port), "--policy", args.policy,
            "--local-prefill-max-tokens", "0", "--health-interval", "0.5",
            *[a for u in sim.urls["prefill"] for a in ("--prefill", u)],
            *[a for u in sim.urls["decode"] for a in ("--decode", u)],
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        await _wait_healthy(url, [router, *sim.procs])
        async with aiohttp.ClientSession() as http:
            for rate in rates:
                for u in sim.urls["prefill"]:
                    async with http.post(f"{u}/reset_prefix_cache") as r:
                        r.raise_for_status()
                one = copy.copy(args)
                one.rates = str(rate)  # one phase each: its arrivals' seed is --seed, as the DES's
                before = await clock_counters(http, sim.all_urls)
                got, _ = await measure([Target("process", url)], one)
                clock = overshoot(before, await clock_counters(http, sim.all_urls))
                out.append({**got["results"][0], "overshoot": clock,
                            "refused": clock["worst"] > args.max_overshoot})  # fmt: skip
    finally:
        if router is not None:
            router.terminate()
            router.wait(timeout=30)
        sim.stop()
    return out


def _side(s: dict[str, Any]) -> dict[str, Any]:
    keys = ("requests", "completed", "slo_attainment", "goodput_rps", "ttft_ms", "tpot_ms",
            "itl_ms", "duration_s")  # fmt: skip
    return {k: s[k] for k in keys if k in s}


def compare(des: dict[str, Any], proc: dict[str, Any]) -> dict[str, float | None]:
    """process / DES for each figure of `FIGURES` (None where either is missing or zero)."""
    out: dict[str, float | None] = {}
    for metric, q in FIGURES:
        a, b = (proc.get(metric) or {}).get(q), (des.get(metric) or {}).get(q)
        out[f"{metric.removesuffix('_ms')}_{q}"] = round(a / b, 3) if a and b else None
    return out


def run(args: argparse.Namespace) -> int:
    try:
        check_args(args)
        if args.concurrency is not None or args.trace is not None:
            raise BenchInputError("plan-check runs open-loop rates (--rates), as the planner")
        rates = [float(r) for r in args.rates.split(",")]
        if min(rates) <= 0 or args.prefill_workers < 1 or args.decode_workers < 1:
            raise BenchInputError("rates and worker counts must be > 0")
    except (BenchInputError, ValueError) as e:
        print(f"pd-bench plan-check: {e}", file=sys.stderr)
        return 2
    des = [_des(args, r) for r in rates]
    proc = asyncio.run(_process(args, rates))
    points = [
        {"rate": r, "des": _side(d), "process": _side(p) | {"overshoot": p["overshoot"]["worst"],
         "refused": p["refused"]}, "process_over_des": compare(d, p)}
        for r, d, p in zip(rates, des, proc, strict=True)
    ]  # fmt: skip
    out = {"profile": args.profile, "prefill_workers": args.prefill_workers,
           "decode_workers": args.decode_workers, "policy": args.policy,
           "time_scale": args.time_scale, "points": points}  # fmt: skip
    if args.json:
        print(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode())
    else:
        print(render(out))
    return 0


def render(out: dict[str, Any]) -> str:
    head = ["rate", "side", "attain"] + [f"{m.removesuffix('_ms')} {q}" for m, q in FIGURES]
    lines = ["  ".join(f"{h:>10}" for h in head)]
    for p in out["points"]:
        for side in ("des", "process"):
            s = p[side]
            cells = [f"{p['rate']:g}", side, f"{s.get('slo_attainment', 0):.3f}"]
            cells += [str((s.get(m) or {}).get(q)) for m, q in FIGURES]
            if side == "process" and s["refused"]:
                cells.append(f"REFUSED (overshoot {s['overshoot']:.1%})")
            lines.append("  ".join(f"{c:>10}" for c in cells))
        ratios = p["process_over_des"]
        lines.append("  ".join(f"{c:>10}" for c in
                               [f"{p['rate']:g}", "proc/DES", ""] + [str(v) for v in ratios.values()]))  # fmt: skip
    return "\n".join(lines)
