"""`pd-bench serve`: an open-loop serving benchmark for any OpenAI-compatible endpoint.

Streams requests of a workload at each rate of `--rates` (Poisson arrivals by default), or with
`--concurrency N` clients, or at a `--trace`'s timestamps, against `--url` and/or `--compare
NAME=URL` targets (phases alternate between targets at each rate, so their ratios come from one
machine state). Prints throughput, TTFT/TPOT/ITL percentiles, SLO attainment and goodput per
rate (`--json`: one object); `--output-dir` adds a CSV of every request and PNG plots.
`--priority-mix CLASS=WEIGHT,...` sends each request with a priority class drawn from the mix
(priority.py) and reports the figures per class as well.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson

from pd.bench.serve.arrivals import ARRIVALS
from pd.bench.serve.client import RequestRecord
from pd.bench.serve.metrics import SLO, max_rate_at, summarize, summarize_classes
from pd.bench.serve.priority import CLASSES, assign_classes, parse_mix
from pd.bench.serve.runner import Phase, Target, run_phase
from pd.bench.serve.text import TokenText
from pd.bench.serve.trace import TraceError, read_trace, trace_jobs
from pd.bench.serve.workloads import WORKLOADS, Job, WorkloadConfig, build


class BenchInputError(ValueError):
    """Bad input: reported as one line, exit status 2."""


def add_arguments(p: argparse.ArgumentParser, *, targets: bool = True) -> None:
    if targets:
        p.add_argument("--url", help="the endpoint (e.g. http://127.0.0.1:8000)")
        p.add_argument("--compare", nargs="+", default=[], metavar="NAME=URL",
                       help="targets measured side by side, phases alternated per rate")  # fmt: skip
        p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                       help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")  # fmt: skip
    g = p.add_argument_group("arrivals")
    g.add_argument("--rates", help="requests per second, one or comma-separated (default: 1)")
    g.add_argument(
        "--arrival", default="poisson", help=f"open-loop arrivals: {', '.join(ARRIVALS)}"
    )
    g.add_argument("--concurrency", type=int, help="closed loop with this many clients instead")
    g.add_argument("--trace", help="replay a Mooncake-style JSONL trace at its timestamps instead")
    g.add_argument("--trace-time-scale", type=float, default=1.0, help="trace timestamps x this")
    g.add_argument("--max-duration", type=float, help="stop starting requests after this (s)")
    g.add_argument("--request-timeout", type=float, default=600.0, help="one request's limit (s)")
    g.add_argument("--warmup", type=int, default=1, help="requests per target before measuring")
    g.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="the target runs this many times slower than the time it models (simulated "
        "workers with --time-scale K): rates, durations, timeouts and SLOs are in modeled time; "
        "requests are sent K times slower and every latency is divided by K",
    )
    add_workload_arguments(p)
    w = p.add_argument_group("requests")
    w.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    w.add_argument("--tokenizer", help="tokenizer (.gguf or HF dir; default: the embedded model's)")
    w.add_argument("--model", help="model name in the body (default: the first of /v1/models)")
    w.add_argument(
        "--priority-mix",
        metavar="CLASS=WEIGHT,...",
        help=f"send each request (conversation) with a priority class drawn from this mix with "
        f"--seed, as header X-Priority-Class, and report per class; classes {', '.join(CLASSES)}; "
        "weights > 0, normalised (e.g. interactive=0.2,batch=0.8)",
    )
    add_slo_arguments(p)
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print one JSON object")
    o.add_argument("--output-dir", help="also write records.csv and PNG plots there")
    o.add_argument("--cdf-rate", type=float, help="rate of the CDF plots (default: the middle one)")


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """The workload's flags (shared with `pd-bench plan`)."""
    w = p.add_argument_group("workload")
    w.add_argument("--workload", default="random", help=f"one of {', '.join(WORKLOADS)}")
    w.add_argument("--num-requests", type=int, help="per rate (multi-turn: conversations x turns)")
    w.add_argument(
        "--input-len", type=int, help="prompt tokens (shared-prefix, multi-turn: the user turn)"
    )
    w.add_argument("--output-len", type=int, help="max_tokens of each request")
    w.add_argument("--range-ratio", type=float, default=0.0, help="random: spread of the lengths")
    w.add_argument(
        "--prefix-len", type=int, help="shared-prefix / multi-turn: system prompt tokens"
    )
    w.add_argument("--conversations", type=int, default=8, help="multi-turn: conversations")
    w.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    w.add_argument("--long-input-len", type=int, default=1024, help="mixed: long prompt tokens")
    w.add_argument("--long-output-len", type=int, default=8, help="mixed: long prompts' max_tokens")
    w.add_argument("--long-every", type=int, default=8, help="mixed: every n-th request is long")
    w.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="generate max_tokens tokens (default: on for random and mixed)")  # fmt: skip
    w.add_argument("--seed", type=int, default=0, help="seed of the workload and the arrivals")


def add_slo_arguments(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("SLOs (per request)")
    s.add_argument("--slo-ttft-ms", type=float, help="time to first token")
    s.add_argument("--slo-tpot-ms", type=float, help="time per output token after the first")
    s.add_argument("--slo-itl-p99-ms", type=float, help="p99 of the request's inter-token gaps")


def run(args: argparse.Namespace) -> int:
    try:
        targets = parse_targets(args.url, args.compare, args.api_key)
        out, records = asyncio.run(measure(targets, args))
    except (BenchInputError, TraceError) as e:
        print(f"pd-bench serve: {e}", file=sys.stderr)
        return 2
    emit(out, records, args)
    return 0


def parse_targets(url: str | None, compare: list[str], api_key: str | None) -> list[Target]:
    pairs = [("target", url)] if url else []
    for item in compare:
        name, sep, target_url = item.partition("=")
        if not sep or not name or not target_url:
            raise BenchInputError(f"--compare takes NAME=URL, got {item!r}")
        pairs.append((name, target_url))
    if not pairs:
        raise BenchInputError("give --url URL or --compare NAME=URL ...")
    names = [n for n, _ in pairs]
    if len(set(names)) != len(names):
        raise BenchInputError(f"target names must differ, got {names}")
    for name, u in pairs:
        if not u.startswith(("http://", "https://")):
            raise BenchInputError(f"target {name}: {u!r} is not an http(s) URL")
    return [Target(n, u.rstrip("/"), api_key=api_key) for n, u in pairs]


def parse_rates(text: str | None) -> list[float]:
    try:
        rates = [float(r) for r in (text or "1").split(",") if r.strip()]
    except ValueError:
        raise BenchInputError(f"--rates takes numbers separated by commas, got {text!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise BenchInputError(f"every rate must be > 0 requests per second, got {text!r}")
    return rates


def check_args(args: argparse.Namespace) -> None:
    check_workload_args(args)
    positive = ("concurrency", "request_timeout", "max_duration", "trace_time_scale", "time_scale")
    for name in positive:
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise BenchInputError(f"--{name.replace('_', '-')} must be > 0, got {value}")
    if args.warmup < 0:
        raise BenchInputError("--warmup must be >= 0")
    if sum(x is not None for x in (args.rates, args.concurrency, args.trace)) > 1:
        raise BenchInputError("give one of --rates, --concurrency, --trace")
    priority_mix(args)


def priority_mix(args: argparse.Namespace) -> dict[str, float] | None:
    """`--priority-mix` as class -> share (None when not given)."""
    if args.priority_mix is None:
        return None
    try:
        return parse_mix(args.priority_mix)
    except ValueError as e:
        raise BenchInputError(f"--priority-mix {e}") from None


def check_workload_args(args: argparse.Namespace) -> None:
    """The workload's and the arrival's flags (`add_workload_arguments`, `--arrival`)."""
    if args.workload not in WORKLOADS:
        raise BenchInputError(
            f"unknown workload {args.workload!r}: choose from {', '.join(WORKLOADS)}"
        )
    if args.arrival not in ARRIVALS:
        raise BenchInputError(
            f"unknown arrival {args.arrival!r}: choose from {', '.join(ARRIVALS)}"
        )
    positive = ("num_requests", "input_len", "output_len", "prefix_len", "conversations",
                "turns", "long_input_len", "long_output_len")  # fmt: skip
    for name in positive:
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise BenchInputError(f"--{name.replace('_', '-')} must be > 0, got {value}")
    if args.long_every < 0 or not 0 <= args.range_ratio < 1:
        raise BenchInputError("--long-every must be >= 0 and --range-ratio in [0, 1)")


async def measure(
    targets: list[Target], args: argparse.Namespace
) -> tuple[dict[str, Any], list[RequestRecord]]:
    """Run every phase; returns the output object and every request's record."""
    check_args(args)
    rates: list[float | None] = [None]
    if args.trace is None and args.concurrency is None:
        rates = list(parse_rates(args.rates))
    entries = read_trace(args.trace) if args.trace is not None else None
    targets = [await _resolve(t, args.model) for t in targets]
    text = _token_text(args.tokenizer)
    if entries is not None:
        jobs = trace_jobs(entries, text, args.trace_time_scale)
    else:
        jobs = build(workload_config(args), text)
    mix = priority_mix(args)
    if mix is not None:
        assign_classes(jobs, mix, args.seed)
    slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_itl_p99_ms)
    progress = _progress(sum(len(j.turns) for j in jobs) * len(rates) * len(targets))
    for t in targets:
        await _warm_up(t, jobs, args)
    records: list[RequestRecord] = []
    results = []
    for i, rate in enumerate(rates):
        for t in targets:  # alternated at each rate: ratios from one machine state
            phase = Phase(rate, args.arrival, args.concurrency, args.max_duration,
                          args.request_timeout, args.temperature, args.seed + i,
                          args.time_scale)  # fmt: skip
            got = await run_phase(t, jobs, phase, progress)
            records.extend(got)
            result: dict[str, Any] = (
                summarize(got, slo) if got else {"target": t.name, "rate": rate}
            )
            if got and mix is not None:
                result["classes"] = summarize_classes(got, slo, list(mix))
            results.append(result)
    out: dict[str, Any] = {
        "workload": "trace" if args.trace else args.workload,
        "slo": {k: v for k, v in vars(slo).items() if v is not None},
        "time_scale": args.time_scale,  # every figure is in modeled time
        "results": results,
    }
    best = {t.name: max_rate_at([r for r in results if r["target"] == t.name]) for t in targets}
    out["max_rate_at_90pct"] = best[targets[0].name] if len(targets) == 1 else best
    if mix is not None:
        out["priority_mix"] = mix
        by_class = {t.name: _max_rate_by_class(results, t.name, mix) for t in targets}
        out["max_rate_at_90pct_by_class"] = (
            by_class[targets[0].name] if len(targets) == 1 else by_class
        )
    return out, records


def _max_rate_by_class(
    results: list[dict[str, Any]], target: str, mix: dict[str, float]
) -> dict[str, float | None]:
    mine = [r for r in results if r["target"] == target and "classes" in r]
    return {
        cls: max_rate_at([{"rate": r["rate"], **r["classes"][cls]} for r in mine]) for cls in mix
    }


def emit(out: dict[str, Any], records: list[RequestRecord], args: argparse.Namespace) -> None:
    if args.output_dir:
        from pd.bench.serve.report import write_csv, write_plots

        os.makedirs(args.output_dir, exist_ok=True)
        write_csv(os.path.join(args.output_dir, "records.csv"), records)
        try:
            out["plots"] = write_plots(args.output_dir, records, out["results"], args.cdf_rate)
        except ImportError:
            print("pd-bench serve: no plots (pip install matplotlib)", file=sys.stderr)
    if args.json:
        print(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode())
        return
    for r in out["results"]:
        if "requests" not in r:
            continue
        rate = "closed" if r["rate"] is None else f"{r['rate']:g}/s"
        print(
            f"{r['target']:>10} {rate:>8}: {r['completed']}/{r['requests']} ok "
            f"{r['req_per_s']:.2f} req/s {r['output_tok_per_s']:.1f} tok/s  "
            f"TTFT p50/p99 {r['ttft_ms']['p50']}/{r['ttft_ms']['p99']} ms  "
            f"TPOT p50/p99 {r['tpot_ms']['p50']}/{r['tpot_ms']['p99']} ms  "
            f"goodput {r['goodput_rps']:.2f} req/s ({100 * r['slo_attainment']:.0f}%)"
            + (f"  errors {r['errors']}" if r["errors"] else "")
        )
        for line in _class_lines(r.get("classes", {})):
            print(line)
    print(f"max rate at 90% attainment: {out['max_rate_at_90pct']}")
    if "max_rate_at_90pct_by_class" in out:
        print(f"max rate at 90% attainment by class: {out['max_rate_at_90pct_by_class']}")


def _class_lines(classes: dict[str, dict[str, Any]]) -> list[str]:
    """The per-class table under a result's line (--priority-mix)."""
    if not classes:
        return []
    lines = [
        f"{'class':>19} {'sent':>5} {'ok':>5} {'refused':>7} {'timed_out':>9} {'preempted':>9} "
        f"{'failed':>6}  {'TTFT p50/p99 ms':>17}  {'TPOT p50/p99 ms':>17}  goodput"
    ]
    for cls, c in classes.items():
        ttft = f"{c['ttft_ms']['p50']}/{c['ttft_ms']['p99']}"
        tpot = f"{c['tpot_ms']['p50']}/{c['tpot_ms']['p99']}"
        lines.append(
            f"{cls:>19} {c['requests']:>5} {c['completed']:>5} {c['refused']:>7} "
            f"{c['timed_out']:>9} {c['preempted']:>9} {c['failed']:>6}  {ttft:>17}  {tpot:>17}  "
            f"{c['goodput_rps']:.2f} req/s ({100 * c['slo_attainment']:.0f}%)"
        )
    return lines


def workload_config(args: argparse.Namespace) -> WorkloadConfig:
    return WorkloadConfig(
        args.workload, args.num_requests, args.input_len, args.output_len, args.range_ratio,
        args.prefix_len, args.conversations, args.turns, args.long_input_len,
        args.long_output_len, args.long_every, args.ignore_eos, args.seed,
    )  # fmt: skip


async def _resolve(target: Target, model: str | None) -> Target:
    """Check that the target answers, and take its first model id unless one was given."""
    headers = target.auth_headers()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            async with http.get(f"{target.url}/v1/models", headers=headers) as resp:
                body = await resp.json(content_type=None) if resp.status == 200 else None
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        raise BenchInputError(f"cannot reach {target.url}: {type(e).__name__} {e}") from None
    if model is None:
        models = (body or {}).get("data") if isinstance(body, dict) else None
        if not models:
            raise BenchInputError(f"{target.url}/v1/models lists no model: give --model")
        model = str(models[0]["id"])
    return Target(target.name, target.url, model, target.api_key)


def _token_text(path: str | None) -> TokenText:
    from pd.worker.checkpoint import default_model_path, load_tokenizer

    try:
        return TokenText(load_tokenizer(path or default_model_path()))
    except (OSError, ValueError) as e:
        raise BenchInputError(f"cannot load the tokenizer: {e}") from None


async def _warm_up(target: Target, jobs: list[Job], args: argparse.Namespace) -> None:
    if not args.warmup:
        return
    warm = [Job(f"warmup{i}", j.turns[:1], j.ignore_eos) for i, j in enumerate(jobs[: args.warmup])]
    await run_phase(target, warm, Phase(concurrency=1, request_timeout_s=args.request_timeout))


def _progress(total: int) -> Callable[[RequestRecord], None] | None:
    """A progress bar on stderr when it is a terminal (tqdm), else nothing."""
    if not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    bar = tqdm(total=total, unit="req", file=sys.stderr)
    return lambda record: bar.update(1)
