"""`pd-bench plan`: the P:D split and TP per role with the best goodput per GPU for a workload,
SLOs, a simulated device and a GPU budget, beside the co-located cluster of the same GPUs
(DistServe's question), searched on the in-process DES (pd/sim/cluster, docs/simulation.md).

Every split of at most `--gpus` GPUs (P workers x TP_p + D workers x TP_d, each TP from `--tp`
that the model fits at) and every co-located cluster of the budget (`--gpus` // TP workers) is
simulated; goodput per GPU is defined in plan_search.py. `--json` prints one object:
{"splits": [...], "best": {...}, "colocated": {...}, ...}.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import TYPE_CHECKING, Any

import orjson

from pd.bench.serve.arrivals import ARRIVALS
from pd.bench.serve.cli import (
    BenchInputError,
    add_slo_arguments,
    add_workload_arguments,
    check_workload_args,
    workload_config,
)
from pd.bench.serve.metrics import SLO
from pd.bench.serve.trace import TraceError, read_trace

if TYPE_CHECKING:  # the simulator is imported when the subcommand runs, not with pd-bench
    from pd.bench.plan_search import Outcome, Search
    from pd.sim.cluster import ClusterSpec, Limits, SimJob
    from pd.sim.profile import Profile

DEFAULT_REQUESTS = 1000  # per simulation, when --num-requests is not given


def add_arguments(p: argparse.ArgumentParser) -> None:
    c = p.add_argument_group("cluster")
    c.add_argument("--profile", required=True,
                   help="MODEL:DEVICE[:LINK] or a .toml (`pd-worker --simulate list`); the TP "
                   "is searched")  # fmt: skip
    c.add_argument("--gpus", type=int, default=8, help="the GPU budget")
    c.add_argument("--tp", default="1,2,4,8", help="TPs to try, each role its own")
    c.add_argument("--policy", default="least-loaded", help="router: least-loaded, round-robin")
    c.add_argument("--chunk-size", type=int, default=8192, help="every worker's step token budget")
    c.add_argument("--colocated-chunk-sizes",
                   help="co-located: chunk sizes to try, comma-separated (default: --chunk-size); "
                   "a smaller one trades prefill speed for shorter decode gaps")  # fmt: skip
    c.add_argument("--max-running", type=int, default=256, help="every worker's running batch cap")
    c.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    c.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="prefix cache on P and co-located workers")  # fmt: skip
    g = p.add_argument_group("arrivals")
    g.add_argument(
        "--arrival", default="poisson", help=f"open-loop arrivals: {', '.join(ARRIVALS)}"
    )
    g.add_argument("--trace", help="a Mooncake-style JSONL trace instead of --workload (its "
                   "timestamps scaled to each rate tried)")  # fmt: skip
    add_workload_arguments(p)
    add_slo_arguments(p)
    s = p.add_argument_group("search")
    s.add_argument("--attainment", type=float, default=0.9,
                   help="goodput: the highest rate at which this share of requests meets "
                   "the SLOs")  # fmt: skip
    s.add_argument("--at-rate", type=float,
                   help="instead: goodput (req/s meeting the SLOs) at this offered rate "
                   "per GPU")  # fmt: skip
    s.add_argument("--rate-tolerance", type=float, default=0.02, help="relative, of the max rate")
    s.add_argument("--sweep", help="per-GPU rates: also run the best split and the co-located "
                   "cluster at each (goodput per GPU against rate)")  # fmt: skip
    s.add_argument("--plot", help="with --sweep: write that plot to this PNG")
    s.add_argument("--jobs", type=int, default=1, help="simulations in parallel (processes)")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    try:
        out = plan(args)
    except (BenchInputError, TraceError, ValueError) as e:
        print(f"pd-bench plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode())
    else:
        print(render(out))
    if args.plot and out.get("sweep"):
        write_plot(args.plot, out)
    return 0


def plan(args: argparse.Namespace) -> dict[str, Any]:
    from pd.bench.plan_search import colocated, splits, summary_at

    profile, tps, limits, search, jobs = _inputs(args)
    t0 = time.perf_counter()
    pd_specs = splits(profile, args.gpus, tps, limits, args.policy)
    co_specs = []
    for chunk in _ints(
        args.colocated_chunk_sizes or str(args.chunk_size), "--colocated-chunk-sizes"
    ):
        co_limits = dataclasses.replace(limits, chunk_size=chunk)
        co_specs += colocated(profile, args.gpus, tps, co_limits, args.policy)
    if not pd_specs or not co_specs:
        raise BenchInputError(f"{profile.model.name} fits no split of {args.gpus} GPUs at tp {tps}")
    outcomes = _evaluate_all(pd_specs + co_specs, jobs, search, args.jobs)
    tried, co_tried = outcomes[: len(pd_specs)], outcomes[len(pd_specs) :]
    best = max(tried, key=lambda o: (o.goodput_per_gpu, -o.spec.gpus))
    co = max(co_tried, key=lambda o: (o.goodput_per_gpu, -o.spec.gpus))
    out: dict[str, Any] = {
        "profile": f"{profile.model.name}:{profile.device.name}"
        + (f":{profile.link.name}" if profile.link else ""),
        "gpus": args.gpus,
        "workload": "trace" if args.trace else args.workload,
        "requests": sum(len(j.turns) for j in jobs),
        "slo": {k: v for k, v in vars(search.slo).items() if v is not None},
        "goodput": "at-rate" if search.at_rate_per_gpu is not None else "max-rate",
        "attainment_target": search.attainment,
        "at_rate_per_gpu": search.at_rate_per_gpu,
        "limits": dataclasses.asdict(limits),
        "policy": args.policy,
        "tp_skipped": [tp for tp in _ints(args.tp, "--tp") if tp not in tps],
        "splits": [o.as_dict() for o in sorted(tried, key=lambda o: -o.goodput_per_gpu)],
        "best": best.as_dict(),
        "colocated": co.as_dict(),
        "colocated_tried": [o.as_dict() for o in co_tried],
        "simulations": sum(o.simulations for o in outcomes),
        "search_cpu_s": round(sum(o.cpu_s for o in outcomes), 1),
    }
    if args.sweep:
        rates = _rates(args.sweep)
        out["sweep"] = {
            name: [_point(summary_at(o.spec, jobs, r * o.spec.gpus, search)) for r in rates]
            for name, o in (("best", best), ("colocated", co))
        }
    out["search_s"] = round(time.perf_counter() - t0, 1)
    return out


def _point(s: dict[str, Any]) -> dict[str, Any]:
    keys = ("rate", "rate_per_gpu", "slo_attainment", "goodput_rps", "goodput_per_gpu")
    return {k: s[k] for k in keys} | {m: s[m] for m in ("ttft_ms", "tpot_ms", "itl_ms")}


def _evaluate_all(specs: list[ClusterSpec], jobs: list[SimJob], search: Search,
                  workers: int) -> list[Outcome]:  # fmt: skip
    from pd.bench.plan_search import evaluate

    if workers <= 1:
        return [_progress(i, len(specs), evaluate(s, jobs, search)) for i, s in enumerate(specs, 1)]
    with ProcessPoolExecutor(workers) as pool:
        results = pool.map(evaluate, specs, [jobs] * len(specs), [search] * len(specs))
        return [_progress(i, len(specs), o) for i, o in enumerate(results, 1)]


def _progress(i: int, n: int, o: Outcome) -> Outcome:
    """One line on stderr per cluster done (a search of a large budget takes minutes)."""
    print(f"[{i}/{n}] {o.spec.name} (chunk {o.spec.limits.chunk_size}): "
          f"{o.goodput_per_gpu:.3f} req/s per GPU, {o.simulations} runs, {o.cpu_s:.1f} s CPU",
          file=sys.stderr, flush=True)  # fmt: skip
    return o


def _inputs(args: argparse.Namespace) -> tuple[Profile, list[int], Limits, Search, list[SimJob]]:
    from pd.bench.plan_search import Search, fits
    from pd.bench.serve.sim_jobs import natural_rate, trace_jobs, workload_jobs
    from pd.sim.cluster import POLICIES, Limits
    from pd.sim.profile import parse_profile

    check_workload_args(args)
    profile = parse_profile(args.profile)
    tps = _ints(args.tp, "--tp")
    limits = Limits(args.chunk_size, args.max_running, args.page_size, args.prefix_cache)
    if args.policy not in POLICIES:
        raise BenchInputError(f"unknown policy {args.policy!r}: one of {', '.join(POLICIES)}")
    if args.gpus < 1 or args.jobs < 1:
        raise BenchInputError("--gpus and --jobs must be >= 1")
    if not 0 < args.attainment <= 1 or not 0 < args.rate_tolerance < 1:
        raise BenchInputError("--attainment must be in (0, 1] and --rate-tolerance in (0, 1)")
    if args.at_rate is not None and not args.at_rate > 0:
        raise BenchInputError("--at-rate must be > 0")
    slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_itl_p99_ms)
    if not slo.given:
        raise BenchInputError(
            "give at least one SLO (--slo-ttft-ms, --slo-tpot-ms, --slo-itl-p99-ms)"
        )
    if args.plot and not args.sweep:
        raise BenchInputError("--plot needs --sweep")
    search = Search(
        slo, args.attainment, args.arrival, args.seed, args.rate_tolerance, args.at_rate
    )
    if args.trace:
        jobs = trace_jobs(read_trace(args.trace))
        if natural_rate(jobs) is None:
            raise BenchInputError(f"{args.trace}: needs two distinct timestamps")
    else:
        cfg = workload_config(args)
        if cfg.num_requests is None:
            cfg = dataclasses.replace(cfg, num_requests=DEFAULT_REQUESTS)
        jobs = workload_jobs(cfg)
    usable = [tp for tp in tps if fits(profile, tp, limits.page_size)]
    if not usable:
        raise BenchInputError(
            f"{profile.model.name} fits on {profile.device.name} at none of tp {tps}"
        )
    return profile, usable, limits, search, jobs


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        raise BenchInputError(f"{flag} takes integers separated by commas, got {text!r}") from None
    if not values or values[0] < 1:
        raise BenchInputError(f"{flag} values must be >= 1, got {text!r}")
    return values


def _rates(text: str) -> list[float]:
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise BenchInputError(f"--sweep takes numbers separated by commas, got {text!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise BenchInputError(f"--sweep rates must be > 0, got {text!r}")
    return rates


def render(out: dict[str, Any]) -> str:
    slo = ", ".join(f"{k.removesuffix('_ms')} <= {v:g} ms" for k, v in out["slo"].items())
    if out["goodput"] == "max-rate":
        how = f"max rate at {100 * out['attainment_target']:g}% attainment"
    else:
        how = f"goodput at {out['at_rate_per_gpu']:g} req/s per GPU"
    lines = [f"{out['profile']}, {out['gpus']} GPUs; {out['workload']} ({out['requests']} "
             f"requests); SLOs {slo}; goodput per GPU = {how}",
             f"{'split':30} {'GPUs':>4} {'chunk':>6} {'rate':>9} {'attain':>7} "
             f"{'goodput/GPU':>12}"]  # fmt: skip

    def row(o: dict[str, Any]) -> str:
        rate = "-" if o["max_rate"] is None else f"{o['max_rate']:.2f}"
        rate = (">=" if o.get("capped") else "") + rate
        att = "-" if o["attainment"] is None else f"{o['attainment']:.3f}"
        return (f"{o['name']:30} {o['gpus']:>4} {o['chunk_size']:>6} {rate:>9} {att:>7} "
                f"{o['goodput_per_gpu']:>12.3f}")  # fmt: skip

    lines += [row(o) for o in out["splits"]] + [row(o) for o in out["colocated_tried"]]
    best, co = out["best"], out["colocated"]
    ratio = best["goodput_per_gpu"] / co["goodput_per_gpu"] if co["goodput_per_gpu"] else None
    lines.append(f"best split: {best['name']} ({best['gpus']} GPUs): "
                 f"{best['goodput_per_gpu']:.3f} req/s per GPU")  # fmt: skip
    lines.append(f"co-located: {co['name']} ({co['gpus']} GPUs, chunk {co['chunk_size']}): "
                 f"{co['goodput_per_gpu']:.3f} req/s per GPU"
                 + (f"; best split / co-located = {ratio:.2f}x" if ratio else ""))  # fmt: skip
    for name, points in out.get("sweep", {}).items():
        pts = ", ".join(f"{p['rate_per_gpu']:g}: {p['goodput_per_gpu']:.3f} "
                        f"({100 * p['slo_attainment']:.0f}%)" for p in points)  # fmt: skip
        lines.append(f"sweep {name} (rate/GPU: goodput/GPU (attainment)): {pts}")
    if any(o.get("capped") for o in out["splits"] + out["colocated_tried"]):
        lines.append(">= : still within the SLOs at 64 x the first guess, where the requests "
                     "come as one burst: give more --num-requests")  # fmt: skip
    lines.append(f"{out['simulations']} simulations, {out['search_s']} s")
    return "\n".join(lines)


def write_plot(path: str, out: dict[str, Any]) -> None:
    """Goodput per GPU and SLO attainment against the offered rate per GPU: best vs co-located."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("best", out["best"]["name"]), ("colocated", out["colocated"]["name"])):
        pts = out["sweep"][key]
        x = [p["rate_per_gpu"] for p in pts]
        ax1.plot(x, [p["goodput_per_gpu"] for p in pts], marker="o", label=label)
        ax2.plot(x, [100 * p["slo_attainment"] for p in pts], marker="o", label=label)
    if out["goodput"] == "max-rate":
        ax2.axhline(100 * out["attainment_target"], color="gray", linestyle="--", linewidth=1)
    ax1.set(xlabel="offered rate per GPU (req/s)", ylabel="goodput per GPU (req/s)")
    ax2.set(xlabel="offered rate per GPU (req/s)", ylabel="SLO attainment (%)", ylim=(0, 105))
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    slo = ", ".join(f"{k.removesuffix('_ms')} {v:g} ms" for k, v in out["slo"].items())
    fig.suptitle(f"{out['profile']}, {out['gpus']} GPUs, {out['workload']}; SLOs {slo}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
