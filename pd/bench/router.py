"""`pd-bench router`: what the router costs, measured against talking to decode directly.

Processes: stub P and D workers (no model; D streams `--chunks` fixed SSE chunks) in one, the
router (`pd-router`, production settings: load-aware policies, health polling, metrics, client
auth) in another, optionally a bare relay (aiohttp + uvloop + orjson, P then D, no features) in a
third, and the closed-loop load generator here. Rounds alternate direct / router / bare at each
concurrency, so the figures are side by side under the same noise.

The relay budget (issue 22): at c=1 the router's p50 stays within `TARGET_RELAY_MS` of the bare
relay's (`c1_router_minus_bare_p50_ms`). Because latency moves by a tenth of a millisecond
between rounds on a shared machine, the CPU time each relay process spent a request at c=1 is
reported too (`c1_router_cpu_us`, `c1_bare_cpu_us`: utime + stime from /proc over its own
slices; Linux only, else absent).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from time import perf_counter
from typing import Any

import aiohttp
import orjson

from pd.bench.envoy import start_envoy
from pd.ports import free_port
from pd.router.config import RouterConfig
from pd.router.picker import Picker
from pd.router.registry import Registry

API_KEY = "bench-key"
TARGET_ADDED_P50_MS = 1.0
TARGET_C64_RATIO = 0.45
TARGET_RELAY_MS = 0.25  # router minus bare relay, p50 at c=1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object of the figures")
    p.add_argument(
        "--duration",
        type=float,
        default=3.0,
        help="seconds of each closed-loop phase at high concurrency (default: 3)",
    )
    p.add_argument(
        "--rounds", type=int, default=3, help="alternating rounds of those phases (default: 3)"
    )
    p.add_argument(
        "--c1-requests",
        type=int,
        default=3000,
        help="sequential requests per target at concurrency 1 (default: 3000)",
    )
    p.add_argument("--chunks", type=int, default=32, help="SSE chunks D streams (default: 32)")
    p.add_argument("--concurrency", type=int, default=64, help="high concurrency (default: 64)")
    p.add_argument("--policy", default="load-aware", help="router policy (default: load-aware)")
    p.add_argument("--no-bare", action="store_true", help="skip the bare-relay reference")
    p.add_argument(
        "--picker", action="store_true",
        help="also the gateway path: Envoy consulting pd-router --endpoint-picker (ext_proc), "
        "then straight to D (needs pip install 'pd[k8s]'), and the picker's decision cost",
    )  # fmt: skip
    p.add_argument(
        "--traced", action="store_true",
        help="also a second router exporting every request's spans (--otlp-endpoint, sample "
        "ratio 1) to an OTLP/HTTP sink: what tracing costs",
    )  # fmt: skip
    p.add_argument(
        "--also-concurrency", default="",
        help="more closed-loop concurrencies, comma-separated (e.g. 16): each target at each",
    )  # fmt: skip


# ------------------------------------------------------------------------ helper processes


def _serve_stubs(p_port: int, d_port: int, chunks: int) -> None:
    from aiohttp import web

    from pd.bench.stub_worker import StubWorker

    async def main() -> None:
        runners = []
        for role, port in (("prefill", p_port), ("decode", d_port)):
            runner = web.AppRunner(
                StubWorker(role, chunks=chunks, record=False).app(),
                access_log=None,
                handler_cancellation=True,
            )
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            runners.append(runner)
        await asyncio.Event().wait()

    _run_forever(main())


def _serve_otlp_sink(port: int) -> None:
    """An OTLP/HTTP collector that takes every export and keeps nothing (the traced router's)."""
    from aiohttp import web

    async def main() -> None:
        async def traces(request: web.Request) -> web.Response:
            await request.read()
            return web.Response(body=b"", content_type="application/x-protobuf")

        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/traces", traces)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    _run_forever(main())


def _serve_bare(port: int, p_url: str, d_url: str) -> None:
    """The least a PD relay can do: no validation, policy, metrics, auth or retries."""
    from aiohttp import web

    async def main() -> None:
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        headers = {"Content-Type": "application/json"}

        async def handle(request: web.Request) -> web.StreamResponse:
            body = orjson.loads(await request.read())
            p_body = {
                **body,
                "stream": False,
                "max_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": True},
            }
            async with session.post(
                p_url + request.path, data=orjson.dumps(p_body), headers=headers
            ) as r:
                answer = orjson.loads(await r.read())
            d_body = {**body, "kv_transfer_params": answer["kv_transfer_params"]}
            async with session.post(
                d_url + request.path, data=orjson.dumps(d_body), headers=headers
            ) as r:
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                async for chunk in r.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp

        async def health(request: web.Request) -> web.Response:
            return web.json_response({"status": "ok"})

        app = web.Application()
        app.router.add_post("/v1/completions", handle)
        app.router.add_get("/health", health)
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    _run_forever(main())


def _run_forever(coro: Any) -> None:
    import uvloop

    uvloop.run(coro)


def _cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) process `pid` has used, or None where /proc has no figure."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _spawn(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )


async def _wait_ready(session: aiohttp.ClientSession, url: str, procs: list) -> None:
    end = time.monotonic() + 30
    while time.monotonic() < end:
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"a helper exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            async with session.get(url + "/health") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not become ready")


# ------------------------------------------------------------------------------ load


async def _one(
    session: aiohttp.ClientSession, url: str, payload: bytes, headers: dict[str, str]
) -> float:
    t = perf_counter()
    async with session.post(url, data=payload, headers=headers) as r:
        if r.status != 200:
            raise RuntimeError(f"{url} answered {r.status}: {(await r.read())[:300]!r}")
        last = b""
        async for chunk in r.content.iter_any():
            last = chunk
    if not last.endswith(b"data: [DONE]\n\n"):
        raise RuntimeError(f"{url}: the stream did not end with [DONE]")
    return perf_counter() - t


async def _closed_loop(
    session: aiohttp.ClientSession,
    url: str,
    payload: bytes,
    headers: dict[str, str],
    concurrency: int,
    duration: float,
) -> tuple[list[float], float]:
    latencies: list[float] = []
    stop = perf_counter() + duration

    async def client() -> None:
        while perf_counter() < stop:
            latencies.append(await _one(session, url, payload, headers))

    start = perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return latencies, perf_counter() - start


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] * 1000.0


async def _drive(
    args: argparse.Namespace, targets: dict[str, tuple[str, bytes, dict]], pids: dict[str, int]
) -> dict:
    """c=1: slices of 100 sequential requests, alternating targets (drift hits all alike), the
    CPU of the process serving each (`pids`) counted over its slices. c=N: closed-loop phases of
    `duration` seconds, alternating targets, `rounds` times."""
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    results: dict[str, dict[str, Any]] = {}

    def add(key: str, lat: list[float], elapsed: float, cpu: float | None = None) -> None:
        r = results.setdefault(key, {"lat": [], "elapsed": 0.0, "rps": [], "cpu": 0.0})
        r["lat"] += lat
        r["elapsed"] += elapsed
        r["rps"].append(len(lat) / elapsed)
        r["cpu"] = None if cpu is None or r["cpu"] is None else r["cpu"] + cpu

    async with aiohttp.ClientSession(connector=connector) as session:
        for url, payload, headers in targets.values():  # warm connections and caches
            await _closed_loop(session, url, payload, headers, args.concurrency, 0.5)
        for _ in range(max(1, args.c1_requests // 100)):
            for name, (url, payload, headers) in targets.items():
                pid = pids.get(name)
                cpu0 = _cpu_s(pid) if pid is not None else None
                start = perf_counter()
                lat = [await _one(session, url, payload, headers) for _ in range(100)]
                elapsed = perf_counter() - start
                cpu1 = _cpu_s(pid) if pid is not None else None
                cpu = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
                add(f"c1_{name}", lat, elapsed, cpu)
        levels = [int(c) for c in args.also_concurrency.split(",") if c] + [args.concurrency]
        for _ in range(args.rounds):
            for level in levels:
                for name, (url, payload, headers) in targets.items():
                    lat, elapsed = await _closed_loop(
                        session, url, payload, headers, level, args.duration
                    )
                    add(f"c{level}_{name}", lat, elapsed)
    return results


# ------------------------------------------------------------------------------ run


def _router_argv(port: int, p_url: str, d_url: str, args: argparse.Namespace) -> list[str]:
    return [
        "-m", "pd.router.main", "--port", str(port), "--prefill", p_url, "--decode", d_url,
        "--policy", args.policy, "--api-key", API_KEY, "--admin-token", "bench-admin",
        "--health-interval", "1", "--log-level", "warning",
        "--local-prefill-max-tokens", "0",  # the PD flow, P then D, as the bare relay does
    ]  # fmt: skip


def run(args: argparse.Namespace) -> int:
    p_port, d_port, r_port, b_port, picker_port = (free_port() for _ in range(5))
    p_url, d_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
    me = "pd.bench.router"
    procs = [
        _spawn(["-m", me, "_stubs", str(p_port), str(d_port), str(args.chunks)]),
        _spawn(
            [
                *_router_argv(r_port, p_url, d_url, args),
                *(["--endpoint-picker", "--picker-port", str(picker_port)] if args.picker else []),
            ]
        ),
    ]
    if not args.no_bare:
        procs.append(_spawn(["-m", me, "_bare", str(b_port), p_url, d_url]))
    pids = {"router": procs[1].pid, **({} if args.no_bare else {"bare": procs[2].pid})}
    t_port = free_port()
    if args.traced:  # the same router, its spans exported to a sink that keeps nothing
        sink = free_port()
        procs.append(_spawn(["-m", me, "_otlp_sink", str(sink)]))
        procs.append(_spawn([*_router_argv(t_port, p_url, d_url, args), "--otlp-endpoint",
                             f"http://127.0.0.1:{sink}"]))  # fmt: skip
        pids["traced"] = procs[-1].pid
    body = {
        "model": "stub-model",
        "prompt": "The quick brown fox jumps over the lazy dog. " * 8,
        "max_tokens": args.chunks,
        "stream": True,
    }
    direct_body = {**body, "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": "b"}}
    json_headers = {"Content-Type": "application/json"}
    targets = {
        "direct": (d_url + "/v1/completions", orjson.dumps(direct_body), json_headers),
        "router": (
            f"http://127.0.0.1:{r_port}/v1/completions",
            orjson.dumps(body),
            {**json_headers, "Authorization": f"Bearer {API_KEY}"},
        ),
    }
    if args.traced:
        targets["traced"] = (
            f"http://127.0.0.1:{t_port}/v1/completions",
            orjson.dumps(body),
            {**json_headers, "Authorization": f"Bearer {API_KEY}"},
        )
    if not args.no_bare:
        targets["bare"] = (
            f"http://127.0.0.1:{b_port}/v1/completions",
            orjson.dumps(body),
            json_headers,
        )

    envoy = None

    async def main() -> dict:
        nonlocal envoy
        async with aiohttp.ClientSession() as s:
            for url in (
                p_url,
                d_url,
                f"http://127.0.0.1:{r_port}",
                *([] if args.no_bare else [f"http://127.0.0.1:{b_port}"]),
                *([f"http://127.0.0.1:{t_port}"] if args.traced else []),
            ):
                await _wait_ready(s, url, procs)
        if args.picker:  # Envoy in front, consulting the router's picker; D answers directly
            envoy = await asyncio.to_thread(start_envoy, picker_port)
            targets["gateway"] = (envoy.url + "/v1/completions", orjson.dumps(body), json_headers)
            await asyncio.sleep(1.5)  # the router's health check has admitted D (the picker's)
        return await _drive(args, targets, pids)

    try:
        import uvloop

        raw = uvloop.run(main())
    finally:
        if envoy is not None:
            envoy.stop()
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            proc.wait(timeout=10)

    out: dict[str, Any] = {
        "chunks": args.chunks,
        "concurrency": args.concurrency,
        "duration_s": args.duration,
        "rounds": args.rounds,
        "c1_requests": args.c1_requests,
        "policy": args.policy,
        "cpus": os.cpu_count(),
    }
    for key, r in raw.items():
        out[f"{key}_p50_ms"] = round(_pct(r["lat"], 0.50), 3)
        out[f"{key}_p90_ms"] = round(_pct(r["lat"], 0.90), 3)
        out[f"{key}_p99_ms"] = round(_pct(r["lat"], 0.99), 3)
        out[f"{key}_rps"] = round(len(r["lat"]) / r["elapsed"], 1)
        if not key.startswith("c1_"):
            out[f"{key}_rps_per_round"] = [round(x, 1) for x in r["rps"]]
        elif r["cpu"] is not None and key != "c1_direct":  # (direct: the stubs' process)
            out[f"{key}_cpu_us"] = round(r["cpu"] / len(r["lat"]) * 1e6, 1)
    c = args.concurrency
    out["c1_added_p50_ms"] = round(out["c1_router_p50_ms"] - out["c1_direct_p50_ms"], 3)
    out[f"c{c}_ratio"] = round(out[f"c{c}_router_rps"] / out[f"c{c}_direct_rps"], 3)
    out["c64_router_rps"] = out.get("c64_router_rps", out[f"c{c}_router_rps"])
    out["c64_direct_rps"] = out.get("c64_direct_rps", out[f"c{c}_direct_rps"])
    out["c64_ratio"] = out.get("c64_ratio", out[f"c{c}_ratio"])
    # Per-round ratios (each round's phases ran back to back): the spread shows the noise.
    out["c64_ratio_per_round"] = [
        round(a / b, 3)
        for a, b in zip(raw[f"c{c}_router"]["rps"], raw[f"c{c}_direct"]["rps"], strict=True)
    ]
    if not args.no_bare:
        out["c1_bare_added_p50_ms"] = round(out["c1_bare_p50_ms"] - out["c1_direct_p50_ms"], 3)
        out["c64_bare_ratio"] = round(out[f"c{c}_bare_rps"] / out[f"c{c}_direct_rps"], 3)
        relay = round(out["c1_router_p50_ms"] - out["c1_bare_p50_ms"], 3)
        out["c1_router_minus_bare_p50_ms"] = relay
        if "c1_router_cpu_us" in out and "c1_bare_cpu_us" in out:
            cpu = out["c1_router_cpu_us"] - out["c1_bare_cpu_us"]
            out["c1_router_minus_bare_cpu_us"] = round(cpu, 1)
        out["meets_relay_budget"] = bool(relay <= TARGET_RELAY_MS)
    if args.picker:
        out["picker_decision_us"] = picker_decision_us()
        for level in [int(x) for x in args.also_concurrency.split(",") if x] + [c]:
            out[f"c{level}_gateway_vs_router"] = round(
                out[f"c{level}_gateway_rps"] / out[f"c{level}_router_rps"], 3
            )
    if args.traced:  # tracing's cost: the traced router against the same router untraced
        for level in [int(x) for x in args.also_concurrency.split(",") if x] + [c]:
            out[f"c{level}_traced_vs_router"] = round(
                out[f"c{level}_traced_rps"] / out[f"c{level}_router_rps"], 3
            )
        out["c1_traced_added_p50_ms"] = round(out["c1_traced_p50_ms"] - out["c1_router_p50_ms"], 3)
    out["meets_targets"] = bool(
        out["c1_added_p50_ms"] <= TARGET_ADDED_P50_MS and out["c64_ratio"] >= TARGET_C64_RATIO
    )
    if args.json:
        print(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode())
    else:
        _print_table(out, list(targets), c)
    return 0


def picker_decision_us(n: int = 20000) -> float:
    """The endpoint picker's decision alone (pd/router/picker.py `Picker.pick`: the body parsed,
    the prompt hashed for the prefix index, the decode pool's load-aware choice and the prefill
    worker's), in process, over two decode workers and one prefill worker."""
    reg = Registry(RouterConfig(prefill=("http://p:1",), decode=("http://d1:1", "http://d2:1")))
    for pool in (reg.prefill, reg.decode):
        for w in list(pool.workers.values()):
            pool.set_healthy(w, True)
    picker = Picker(reg)
    body = orjson.dumps({"model": "m", "prompt": "The quick brown fox. " * 8, "max_tokens": 32})
    for _ in range(1000):
        picker.pick("/v1/completions", {}, body, None)
    t = perf_counter()
    for _ in range(n):
        picker.pick("/v1/completions", {}, body, None)
    return round((perf_counter() - t) / n * 1e6, 1)


def _print_table(out: dict, names: list[str], c: int) -> None:
    print(f"{'':10}{'req/s':>10}{'p50 ms':>10}{'p90 ms':>10}{'p99 ms':>10}")
    for conc in (1, c):
        for name in names:
            k = f"c{conc}_{name}"
            print(
                f"{k:10}{out[k + '_rps']:>10}{out[k + '_p50_ms']:>10}"
                f"{out[k + '_p90_ms']:>10}{out[k + '_p99_ms']:>10}"
            )
    print(
        f"router adds {out['c1_added_p50_ms']} ms to p50 at c=1 (target <= "
        f"{TARGET_ADDED_P50_MS}); c={c} ratio {out['c64_ratio']} (target >= {TARGET_C64_RATIO})"
        + (
            f"; bare relay: +{out['c1_bare_added_p50_ms']} ms, ratio {out['c64_bare_ratio']}"
            if "c64_bare_ratio" in out
            else ""
        )
    )
    if "c1_router_minus_bare_p50_ms" in out:
        cpu = out.get("c1_router_minus_bare_cpu_us")
        print(
            f"router minus bare relay at c=1: {out['c1_router_minus_bare_p50_ms']} ms p50 "
            f"(budget <= {TARGET_RELAY_MS})"
            + (f", {cpu} us of CPU a request" if cpu is not None else "")
        )


if __name__ == "__main__":
    if sys.argv[1:2] == ["_stubs"]:
        _serve_stubs(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    elif sys.argv[1:2] == ["_otlp_sink"]:
        _serve_otlp_sink(int(sys.argv[2]))
    elif sys.argv[1:2] == ["_bare"]:
        _serve_bare(int(sys.argv[2]), sys.argv[3], sys.argv[4])
    else:
        from pd.bench.cli import main as cli_main

        sys.exit(cli_main(["router", *sys.argv[1:]]))
