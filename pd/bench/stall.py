"""`pd-bench stall`: how long one large request holds a worker's event loop.

`/health` is polled every `--poll-ms` while prompts of `--sizes` MiB arrive, one at a time, as
text, as a chat message and as a token-id list; the worst `/health` latency while each is in
flight is what a router's health check (and every other request on that worker) waited. A
request must be answered (200, or a clear 4xx: a prompt that cannot fit the context) and no
check may wait longer than `--max-stall-ms`, else the exit code is 1.

Without `--url` it starts one prefill worker (the issue's case: a prompt sent straight to P) on
the default model and stops it at the end; `--url` measures any running worker or router.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import aiohttp
import orjson


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="a running worker or router (default: start a prefill worker)")
    p.add_argument("--sizes", default="1,4,7", help="prompt sizes in MiB, comma-separated")
    p.add_argument("--kinds", default="text,chat,ids", help="prompt forms: text, chat, ids")
    p.add_argument("--poll-ms", type=float, default=10.0, help="/health poll interval")
    p.add_argument("--max-stall-ms", type=float, default=50.0, help="worst /health wait allowed")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the started worker")
    p.add_argument("--json", action="store_true", help="print the results as JSON")


def body_of(kind: str, nbytes: int) -> tuple[str, bytes]:
    """(path, body) of a prompt of about `nbytes`: English-like words, or token ids."""
    words = "the quick brown fox jumps over a lazy dog "
    text = (words * (nbytes // len(words) + 1))[:nbytes]
    if kind == "text":
        return "/v1/completions", orjson.dumps({"prompt": text, "max_tokens": 4})
    if kind == "chat":
        messages = [{"role": "user", "content": text}]
        return "/v1/chat/completions", orjson.dumps({"messages": messages, "max_tokens": 4})
    if kind == "ids":
        ids = [1234] * (nbytes // 5)  # "1234," is 5 bytes
        return "/v1/completions", orjson.dumps({"prompt": ids, "max_tokens": 4})
    raise ValueError(f"unknown prompt kind {kind!r}")


async def _health_latencies(
    http: aiohttp.ClientSession, url: str, every_s: float, stop: asyncio.Event
) -> list[float]:
    out: list[float] = []
    while not stop.is_set():
        t = time.perf_counter()
        async with http.get(f"{url}/health") as r:
            await r.read()
        out.append(time.perf_counter() - t)
        await asyncio.sleep(every_s)
    return out


async def measure(url: str, kind: str, mib: float, poll_s: float) -> dict[str, Any]:
    path, body = body_of(kind, int(mib * (1 << 20)))
    async with aiohttp.ClientSession() as http:
        stop = asyncio.Event()
        poller = asyncio.create_task(_health_latencies(http, url, poll_s, stop))
        await asyncio.sleep(0.2)  # a few checks before, as a baseline
        t = time.perf_counter()
        async with http.post(
            url + path, data=body, headers={"Content-Type": "application/json"}
        ) as r:
            answer = await r.read()
            status = r.status
        took = time.perf_counter() - t
        await asyncio.sleep(0.1)
        stop.set()
        lat = await poller
    code = None
    if status != 200:
        error = orjson.loads(answer).get("error") or {}
        code = error.get("code")
    return {
        "kind": kind,
        "mib": mib,
        "status": status,
        "code": code,
        "answer_s": round(took, 3),
        "health_checks": len(lat),
        "health_p50_ms": round(statistics.median(lat) * 1e3, 1),
        "health_worst_ms": round(max(lat) * 1e3, 1),
    }


def _start_worker(threads: int) -> tuple[subprocess.Popen, str]:
    from pd.bench.pd import _free_port

    port = _free_port()
    env = {**os.environ, "PD_CLUSTER_TOKEN": os.environ.get("PD_CLUSTER_TOKEN", "pd-bench")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pd.worker.main", "--role", "prefill", "--port", str(port),
         "--threads", str(threads)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    return proc, f"http://127.0.0.1:{port}"


async def _run(args: argparse.Namespace, url: str) -> list[dict[str, Any]]:
    from pd.bench.pd import _wait_healthy

    await _wait_healthy(url, [])
    sizes = [float(s) for s in args.sizes.split(",")]
    kinds = args.kinds.split(",")
    return [await measure(url, k, s, args.poll_ms / 1e3) for s in sizes for k in kinds]


def run(args: argparse.Namespace) -> int:
    proc = None
    url = args.url
    if url is None:
        proc, url = _start_worker(args.threads)
    try:
        results = asyncio.run(_run(args, url.rstrip("/")))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    if args.json:
        print(orjson.dumps(results, option=orjson.OPT_INDENT_2).decode())
    else:
        print(f"{'prompt':>12} {'answer':>28} {'health p50':>11} {'worst':>9}")
        for r in results:
            answer = f"{r['status']} {r['code'] or ''} in {r['answer_s']:.2f}s"
            print(
                f"{r['mib']:>4g} MiB {r['kind']:<4} {answer:>28} {r['health_p50_ms']:>8.1f} ms"
                f" {r['health_worst_ms']:>6.1f} ms"
            )
    worst = max(r["health_worst_ms"] for r in results)
    bad = [r for r in results if r["status"] >= 500]
    print(f"worst /health wait: {worst:.1f} ms (allowed {args.max_stall_ms:g} ms)")
    return 0 if worst <= args.max_stall_ms and not bad else 1
