"""`pd-bench engine`: decode throughput of one `--role both` worker at several concurrencies.

Starts a worker process on the default model (or `--url` of a running one), then for each
concurrency N sends N streaming completions of `--max-tokens` tokens each (`ignore_eos`) at once
and measures decode tokens/s: tokens after each stream's first, over the time from the first
stream's first token to the last stream's last token.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

import aiohttp
import orjson


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="a running worker (default: start one)")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated stream counts")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per stream")
    p.add_argument("--dtype", default="auto", help="compute dtype of the started worker")
    p.add_argument("--worker-args", default="", help="extra flags for the started worker")
    p.add_argument("--json", action="store_true", help="print one JSON object")


async def one_stream(http: aiohttp.ClientSession, url: str, max_tokens: int, i: int):
    body = {
        "prompt": f"Request {i}: write a long story about the number {i}.",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    times = []
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(b"data: {"):
                times.append(time.perf_counter())
    return times


async def measure(url: str, n: int, max_tokens: int) -> dict:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as http:
        t0 = time.perf_counter()
        streams = await asyncio.gather(*(one_stream(http, url, max_tokens, i) for i in range(n)))
    first = min(s[0] for s in streams)
    last = max(s[-1] for s in streams)
    decode_tokens = sum(len(s) - 1 for s in streams)
    return {
        "concurrency": n,
        "decode_tok_s": decode_tokens / (last - first),
        "mean_ttft_s": sum(s[0] - t0 for s in streams) / n,
        "mean_itl_ms": 1000 * sum((s[-1] - s[0]) / (len(s) - 1) for s in streams) / n,
        "wall_s": last - t0,
    }


def start_worker(args) -> tuple[subprocess.Popen, str]:
    cmd = [
        sys.executable,
        "-m",
        "pd.worker.main",
        "--role",
        "both",
        "--port",
        "0",
        "--dtype",
        args.dtype,
        *args.worker_args.split(),
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None  # stdout=PIPE
    for line in proc.stdout:
        if not args.json:
            print("  worker:", line.rstrip(), file=sys.stderr)
        if line.startswith("pd-worker ready:"):
            return proc, line.split("url=")[1].strip()
    raise RuntimeError("the worker exited before it was ready")


def run(args: argparse.Namespace) -> int:
    proc = None
    url = args.url
    if url is None:
        proc, url = start_worker(args)
    try:
        levels = [int(n) for n in args.concurrency.split(",")]
        asyncio.run(measure(url, 2, 8))  # warm-up
        results = [asyncio.run(measure(url, n, args.max_tokens)) for n in levels]
    finally:
        if proc:
            proc.terminate()
            proc.wait(timeout=60)
    base = results[0]["decode_tok_s"]
    summary = {
        "results": results,
        "ratio_vs_first": {str(r["concurrency"]): r["decode_tok_s"] / base for r in results},
    }
    if args.json:
        print(orjson.dumps(summary, option=orjson.OPT_INDENT_2).decode())
    else:
        for r in results:
            print(
                f"{r['concurrency']:>4} streams: {r['decode_tok_s']:8.1f} decode tok/s  "
                f"ITL {r['mean_itl_ms']:6.1f} ms  TTFT {r['mean_ttft_s'] * 1000:7.1f} ms  "
                f"x{r['decode_tok_s'] / base:.2f}"
            )
    return 0
