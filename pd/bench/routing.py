"""`pd-bench routing`: routing policies and decode-local prefill on one multi-turn load.

A preset of `pd-bench serve` over one fixed set of workers: two prefill workers (`--p-kv-pages`
each: about half of the conversations) and one decode worker, each with `--threads` cores
(default 1: this machine's two cores are shared three ways, with the router and the client).
For each setup (`POLICY:LOCAL`, a routing policy and a `--local-prefill-max-tokens`) in turn, and
`--rounds` times over in alternation, it:

1. drops every worker's prefix cache (`POST /reset_prefix_cache`: each phase starts cold),
2. starts a router with that setup,
3. runs the workload (default: 16 conversations of 4 turns, each with its own 1,500-token system
   prompt, 50-token questions and 64-token answers (`--ignore-eos`), all 16 in flight: a closed
   loop of 16 clients; `--rates R` starts conversations at R per second instead),
4. reads what it cost from the workers' own counters: prompt tokens the prefill workers computed
   (`pd_prefix_cache_queries_total` minus `_hits_total`), requests that reached them
   (`pd_requests_total`), and from the router the requests served decode-local.

It prints a table (or `--json`) with, per setup, the medians over rounds and the ratios against
the first setup (prefill tokens, TTFT p50 of turns 2 and later) and, for each policy run with and
without decode-local prefill, local against off, and the router's mean routing decision time and
prefix-index size.

At GPU costs (issue 23): `--simulate PROFILE` runs `--prefill-workers` and `--decode-workers`
simulated workers instead (pd/sim: real workers whose steps sleep for the cost model's time),
`--workers-per-process` to a process, with `--time-scale K` (every modeled time stretched by K,
every reported latency divided by K). A setup whose workers' clock overshot their modeled time by
more than `--max-overshoot` is reported as refused.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from pd.bench import serve
from pd.bench.pd import _spawn, _wait_healthy
from pd.bench.serve.cli import BenchInputError, check_args, measure
from pd.bench.serve.runner import Target
from pd.ports import free_port
from pd.sim.launch import (
    DEFAULT_MAX_OVERSHOOT,
    clock_counters,
    overshoot,
    start_sim_workers,
)

DEFAULT_SETUPS = "round-robin:0,cache-aware:0,sticky-to-room:0,cache-aware:256,sticky-to-room:256"
POLICIES = ("round-robin", "load-aware", "sticky-to-room", "cache-aware")


@dataclass(frozen=True)
class Setup:
    policy: str
    local: int  # --local-prefill-max-tokens
    flags: tuple[str, ...] = ()  # more router flags, e.g. ("--cache-balance-abs", "8")
    spec: str = ""

    @property
    def name(self) -> str:
        return self.spec or f"{self.policy}:{self.local}"


def parse_setups(text: str) -> list[Setup]:
    """`POLICY:LOCAL[:FLAG=VALUE+FLAG=VALUE...]`, comma-separated; FLAG is a pd-router flag
    without its dashes (`cache-aware:0:cache-balance-abs=8`)."""
    setups = []
    for item in text.split(","):
        item = item.strip()
        policy, _, rest = item.partition(":")
        local, _, extra = rest.partition(":")
        flags: list[str] = []
        for opt in filter(None, extra.split("+")):
            name, eq, value = opt.partition("=")
            if not eq or not name or name.startswith("-"):
                raise BenchInputError(f"--setups: {opt!r} in {item!r} is not FLAG=VALUE")
            flags += [f"--{name}", value]
        if policy not in POLICIES or not local.isdigit():
            raise BenchInputError(
                f"--setups: {item!r} is not POLICY:LOCAL[:FLAG=VALUE+...] (policy one of "
                f"{', '.join(POLICIES)}, LOCAL a token count, 0 for off)"
            )
        setups.append(Setup(policy, int(local), tuple(flags), item))
    return setups


def add_arguments(p: argparse.ArgumentParser) -> None:
    serve.add_arguments(p, targets=False)
    p.set_defaults(
        workload="multi-turn",
        conversations=16,
        turns=4,
        prefix_len=1500,
        input_len=50,
        output_len=64,
        warmup=0,
        # Every answer is 64 tokens: an answer that ends on its first token is served by P alone
        # and never reaches D, which would then have nothing of that conversation to reuse.
        ignore_eos=True,
    )
    g = p.add_argument_group("setups")
    g.add_argument(
        "--setups",
        default=DEFAULT_SETUPS,
        help="POLICY:LOCAL[:FLAG=VALUE+...],... measured in turn (FLAG: a pd-router flag)",
    )
    g.add_argument("--rounds", type=int, default=1, help="times each setup is measured")
    g.add_argument("--threads", type=int, default=1, help="cores of each worker")
    g.add_argument("--dtype", default="auto", help="compute dtype of the workers")
    g.add_argument(
        "--p-kv-pages",
        type=int,
        help="KV pages of each prefill worker (default 1000, 16,000 tokens: 8 conversations at "
        "their last turn; simulated: the profile's GPU memory)",
    )
    g.add_argument(
        "--d-kv-pages",
        type=int,
        help="KV pages of each decode worker (default 2600; simulated: the profile's)",
    )
    s = p.add_argument_group("a simulated cluster (GPU costs, pd/sim)")
    s.add_argument("--simulate", metavar="PROFILE", help="e.g. llama-3.1-8b:h100:tp1")
    s.add_argument("--prefill-workers", type=int, default=2, help="prefill workers")
    s.add_argument("--decode-workers", type=int, default=1, help="decode workers")
    s.add_argument(
        "--workers-per-process", type=int, default=8, help="simulated workers in one process"
    )
    s.add_argument(
        "--max-overshoot",
        type=float,
        default=DEFAULT_MAX_OVERSHOOT,
        help="refuse a setup whose workers' steps ran past their modeled time by more than this "
        "share (then raise --time-scale)",
    )


def prometheus_sum(text: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples (those with the given label values), from Prometheus text."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


async def _scrape(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(f"{url}/metrics") as r:
        return await r.text()


async def _reset(http: aiohttp.ClientSession, urls: list[str]) -> None:
    for url in urls:
        async with http.post(f"{url}/reset_prefix_cache") as r:
            if r.status != 200:
                raise RuntimeError(f"{url}/reset_prefix_cache answered {r.status}")


async def _prefill_counts(http: aiohttp.ClientSession, p_urls: list[str]) -> tuple[float, float]:
    """(prompt tokens computed, requests) summed over the prefill workers."""
    computed = requests = 0.0
    for url in p_urls:
        text = await _scrape(http, url)
        computed += prometheus_sum(text, "pd_prefix_cache_queries_total") - prometheus_sum(
            text, "pd_prefix_cache_hits_total"
        )
        requests += prometheus_sum(text, "pd_requests_total")
    return computed, requests


def _decisions(router_metrics: str) -> dict[str, int]:
    """The router's policy decisions, as {"pool/decision": count}."""
    return {
        f"{sample.labels['pool']}/{sample.labels['decision']}": int(sample.value)
        for family in text_string_to_metric_families(router_metrics)
        for sample in family.samples
        if sample.name == "pd_router_policy_decisions_total"
    }


def start_workers(args: argparse.Namespace) -> tuple[list[str], list[str], list]:
    """(prefill URLs, decode URLs, processes): real workers, or simulated ones (--simulate)."""
    if args.simulate:
        roles = ["prefill"] * args.prefill_workers + ["decode"] * args.decode_workers
        sim = start_sim_workers(
            args.simulate,
            roles,
            time_scale=args.time_scale,
            per_process=args.workers_per_process,
        )
        return sim.urls.get("prefill", []), sim.urls.get("decode", []), sim.procs
    common = ["--dtype", args.dtype, "--max-model-len", "4096", "--threads", str(args.threads)]
    procs: list = []
    p_urls: list[str] = []
    d_urls: list[str] = []
    for role, n, pages in (
        ("prefill", args.prefill_workers, args.p_kv_pages or 1000),
        ("decode", args.decode_workers, args.d_kv_pages or 2600),
    ):
        for _ in range(n):
            port = free_port()
            procs.append(
                _spawn("pd.worker.main", "--role", role, "--port", str(port),
                       "--kv-pages", str(pages), *common)
            )  # fmt: skip
            (p_urls if role == "prefill" else d_urls).append(f"http://127.0.0.1:{port}")
    return p_urls, d_urls, procs


def router_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


async def run_setup(
    setup: Setup, p_urls: list[str], d_urls: list[str], args: argparse.Namespace, worker_procs: list
) -> dict[str, Any]:
    port = free_port()
    router = _spawn(
        "pd.router.main", "--port", str(port), "--policy", setup.policy,
        "--local-prefill-max-tokens", str(setup.local), "--health-interval", "0.5",
        *[a for u in p_urls for a in ("--prefill", u)],
        *[a for u in d_urls for a in ("--decode", u)], *setup.flags,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    clock: dict[str, Any] | None = None
    try:
        await _wait_healthy(url, [router, *worker_procs])
        async with aiohttp.ClientSession() as http:
            await _reset(http, [*p_urls, *d_urls])
            computed0, requests0 = await _prefill_counts(http, p_urls)
            if args.simulate:
                before = await clock_counters(http, [*p_urls, *d_urls])
            out, _ = await measure([Target(setup.name, url)], args)
            if args.simulate:
                clock = overshoot(before, await clock_counters(http, [*p_urls, *d_urls]))
            computed1, requests1 = await _prefill_counts(http, p_urls)
            router_metrics = await _scrape(http, url)
            local = prometheus_sum(router_metrics, "pd_router_requests_total", route="local")
            rss = router_rss_bytes(router.pid)
    finally:
        router.terminate()
        router.wait(timeout=30)
    r = out["results"][0]
    decisions = prometheus_sum(router_metrics, "pd_router_route_decision_seconds_count")
    decision_s = prometheus_sum(router_metrics, "pd_router_route_decision_seconds_sum")
    extra: dict[str, Any] = {
        "workers": len(p_urls) + len(d_urls),
        "route_decision_mean_us": round(decision_s / decisions * 1e6, 2) if decisions else None,
        "prefix_index_blocks": int(prometheus_sum(router_metrics, "pd_router_prefix_index_blocks")),
        "router_rss_mb": round(rss / 2**20, 1),
    }
    if clock is not None:
        extra["overshoot"] = clock
        extra["refused"] = clock["worst"] > args.max_overshoot
    return {
        **extra,
        "setup": setup.name,
        "policy": setup.policy,
        "local_prefill_max_tokens": setup.local,
        "requests": r["requests"],
        "completed": r["completed"],
        "errors": r["errors"],
        "p_prefill_tokens": int(computed1 - computed0),
        "p_requests": int(requests1 - requests0),
        "local_requests": int(local),
        "ttft_first_turn_p50_ms": r["ttft_first_turn_ms"]["p50"],
        "ttft_later_turns_p50_ms": r["ttft_later_turns_ms"]["p50"],
        "ttft_later_turns_p90_ms": r["ttft_later_turns_ms"]["p90"],
        "tpot_p50_ms": r["tpot_ms"]["p50"],
        "duration_s": r["duration_s"],
        "decisions": _decisions(router_metrics),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def summarize_runs(runs: list[dict[str, Any]], setups: list[Setup]) -> dict[str, Any]:
    keys = ("p_prefill_tokens", "p_requests", "local_requests", "ttft_first_turn_p50_ms",
            "ttft_later_turns_p50_ms", "ttft_later_turns_p90_ms", "tpot_p50_ms",
            "route_decision_mean_us", "prefix_index_blocks", "router_rss_mb")  # fmt: skip
    medians: dict[str, dict[str, Any]] = {}
    refused = sorted({r["setup"] for r in runs if r.get("refused")})
    for s in setups:
        # A run whose simulated clock overshot is no figure (issue 23): refused, never averaged.
        mine = [r for r in runs if r["setup"] == s.name and not r.get("refused")]
        medians[s.name] = {
            k: statistics.median(v) if (v := [r[k] for r in mine if r.get(k) is not None]) else None
            for k in keys
        }
    base = setups[0].name
    vs_base = {
        name: {
            "p_prefill_tokens": _ratio(m["p_prefill_tokens"], medians[base]["p_prefill_tokens"]),
            "ttft_later_turns_p50": _ratio(
                m["ttft_later_turns_p50_ms"], medians[base]["ttft_later_turns_p50_ms"]
            ),
        }
        for name, m in medians.items()
    }
    local_vs_off = {}
    for s in setups:
        off = f"{s.policy}:0"
        if s.local and not s.flags and off in medians:
            local_vs_off[s.name] = {
                "ttft_later_turns_p50": _ratio(
                    medians[s.name]["ttft_later_turns_p50_ms"],
                    medians[off]["ttft_later_turns_p50_ms"],
                ),
                "p_requests": medians[s.name]["p_requests"],
                "p_requests_off": medians[off]["p_requests"],
            }
    return {
        "medians": medians,
        f"vs_{base}": vs_base,
        "local_vs_off": local_vs_off,
        "refused": refused,
    }


def _print_table(summary: dict[str, Any], base: str) -> None:
    cols = ("p_prefill_tokens", "p_requests", "local_requests", "ttft_first_turn_p50_ms",
            "ttft_later_turns_p50_ms", "tpot_p50_ms")  # fmt: skip
    print("setup".ljust(22) + "".join(c.replace("_ms", "").rjust(24) for c in cols))
    for name, m in summary["medians"].items():
        cells = "".join(("-" if m[c] is None else f"{m[c]:.0f}").rjust(24) for c in cols)
        print(name.ljust(22) + cells)
    print(f"\nagainst {base}:")
    for name, r in summary[f"vs_{base}"].items():
        print(f"  {name:22} prefill tokens x{r['p_prefill_tokens']}, "
              f"TTFT p50 of later turns x{r['ttft_later_turns_p50']}")  # fmt: skip
    for name, r in summary["local_vs_off"].items():
        print(f"  {name:22} vs local off: TTFT p50 of later turns x{r['ttft_later_turns_p50']}, "
              f"requests at P {r['p_requests']} (off: {r['p_requests_off']})")  # fmt: skip
    for name in summary["refused"]:
        print(f"  {name:22} REFUSED in some rounds: the simulated clock overshot; raise "
              "--time-scale")  # fmt: skip


def _write(out_dir: str, runs: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    """runs.json and routing.png (bars per setup: prefill tokens, TTFT p50 of later turns)."""
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import orjson

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "runs.json"), "wb") as f:
        f.write(orjson.dumps({"runs": runs, **summary}, option=orjson.OPT_INDENT_2))
    names = list(summary["medians"])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, key, label in (
        (axes[0], "p_prefill_tokens", "prompt tokens the prefill workers computed"),
        (axes[1], "ttft_later_turns_p50_ms", "TTFT p50, turns 2 and later (ms)"),
        (axes[2], "p_requests", "requests that reached a prefill worker"),
    ):
        values = [summary["medians"][n][key] or 0 for n in names]
        ax.bar(range(len(names)), values, color="tab:blue")
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_title(label, fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "routing.png"), dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    if args.rates is None and args.concurrency is None and args.trace is None:
        args.concurrency = 16  # the default load: every conversation in flight
    try:
        setups = parse_setups(args.setups)
        check_args(args)
        if args.rounds < 1 or args.threads < 1:
            raise BenchInputError("--rounds and --threads must be >= 1")
        if args.prefill_workers < 1 or args.decode_workers < 1:
            raise BenchInputError("--prefill-workers and --decode-workers must be >= 1")
        if args.time_scale != 1.0 and not args.simulate:
            raise BenchInputError("--time-scale stretches simulated workers: give --simulate")
    except BenchInputError as e:
        print(f"pd-bench routing: {e}", file=sys.stderr)
        return 2
    p_urls, d_urls, procs = start_workers(args)
    runs = []
    try:
        for url in (*p_urls, *d_urls):
            asyncio.run(_wait_healthy(url, procs))
        for round_no in range(args.rounds):
            for setup in setups:
                r = asyncio.run(run_setup(setup, p_urls, d_urls, args, procs))
                r["round"] = round_no
                runs.append(r)
                print(f"  {setup.name} round {round_no}: {r}", file=sys.stderr)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=60)
    summary = summarize_runs(runs, setups)
    if args.output_dir:
        _write(args.output_dir, runs, summary)
    if args.json:
        import orjson

        sys.stdout.write(orjson.dumps({"runs": runs, **summary}).decode() + "\n")
    else:
        _print_table(summary, setups[0].name)
    return 0
