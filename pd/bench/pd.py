"""`pd-bench pd`: the same mixed load on one co-located worker and on a prefill/decode pair.

The load: `--streams` decode streams of `--max-tokens` tokens each (short prompts, `ignore_eos`)
run together while long prompts (`--long-tokens` tokens) arrive every `--long-every-s` seconds.
On one worker the long prefills share steps with the decode streams (chunked prefill under one
token budget); in the pair they run on P while D only decodes. Measured per setup, one after the
other in one run: inter-token latency of the decode streams (p50, p99), their decode tokens/s,
and the long prompts' time to first token.

Both setups get the same cores: the co-located worker all of `--threads` (default: every core),
P and D half each.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time

import aiohttp
import orjson


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--streams", type=int, default=8, help="concurrent decode streams")
    p.add_argument("--max-tokens", type=int, default=96, help="tokens per decode stream")
    p.add_argument("--long-tokens", type=int, default=1024, help="tokens of each long prompt")
    p.add_argument("--long-every-s", type=float, default=1.0, help="seconds between long prompts")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="cores to share out")
    p.add_argument("--dtype", default="auto", help="compute dtype of the workers")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(module: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PD_CLUSTER_TOKEN": os.environ.get("PD_CLUSTER_TOKEN", "pd-bench")}
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def _wait_healthy(url: str, procs: list[subprocess.Popen], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in procs):
                raise RuntimeError("a process of the setup exited")
            try:
                async with http.get(f"{url}/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} did not become healthy")


def start_setup(kind: str, args) -> tuple[str, list[subprocess.Popen]]:
    """Start the co-located worker ("both") or P + D + router ("pd"); returns the client URL."""
    common = ["--dtype", args.dtype, "--max-model-len", "4096"]
    if kind == "both":
        port = _free_port()
        procs = [
            _spawn(
                "pd.worker.main",
                "--role",
                "both",
                "--port",
                str(port),
                "--threads",
                str(args.threads),
                *common,
            )
        ]
        return f"http://127.0.0.1:{port}", procs
    half = str(max(1, args.threads // 2))
    p_port, d_port, r_port = _free_port(), _free_port(), _free_port()
    procs = [
        _spawn(
            "pd.worker.main", "--role", "prefill", "--port", str(p_port), "--threads", half, *common
        ),
        _spawn(
            "pd.worker.main", "--role", "decode", "--port", str(d_port), "--threads", half, *common
        ),
    ]
    asyncio.run(_wait_healthy(f"http://127.0.0.1:{p_port}", procs))
    asyncio.run(_wait_healthy(f"http://127.0.0.1:{d_port}", procs))
    procs.append(
        _spawn(
            "pd.router.main",
            "--port",
            str(r_port),
            "--prefill",
            f"http://127.0.0.1:{p_port}",
            "--decode",
            f"http://127.0.0.1:{d_port}",
            "--health-interval",
            "0.5",
        )
    )
    return f"http://127.0.0.1:{r_port}", procs


async def _stream(http, url: str, body: dict) -> list[float]:
    """Arrival times of a streaming completion's chunks (the first one is the first token)."""
    times = []
    async with http.post(f"{url}/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(b"data: {"):
                times.append(time.perf_counter())
    return times


async def run_load(url: str, args) -> dict:
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        warm = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
        await _stream(http, url, warm)
        decode_body = {"max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 0}
        streams = [
            asyncio.create_task(_stream(http, url, {**decode_body, "prompt": f"Story {i}:"}))
            for i in range(args.streams)
        ]
        long_ttft = []

        async def long_prompts() -> None:
            i = 0
            while not all(s.done() for s in streams):
                body = {
                    "prompt": f"{i} " + "word " * args.long_tokens,
                    "max_tokens": 2,
                    "temperature": 0,
                }
                t0 = time.perf_counter()
                times = await _stream(http, url, body)
                long_ttft.append(times[0] - t0)
                i += 1
                await asyncio.sleep(args.long_every_s)

        longs = asyncio.create_task(long_prompts())
        results = await asyncio.gather(*streams)
        await longs
    gaps = sorted(b - a for t in results for a, b in zip(t, t[1:]))
    span = max(t[-1] for t in results) - min(t[0] for t in results)
    return {
        "itl_p50_ms": 1000 * gaps[len(gaps) // 2],
        "itl_p99_ms": 1000 * gaps[int(len(gaps) * 0.99)],
        "decode_tok_s": sum(len(t) - 1 for t in results) / span,
        "long_prompts": len(long_ttft),
        "long_ttft_p50_ms": 1000 * statistics.median(long_ttft) if long_ttft else None,
    }


def run(args: argparse.Namespace) -> int:
    out = {}
    for kind in ("both", "pd"):
        url, procs = start_setup(kind, args)
        try:
            asyncio.run(_wait_healthy(url, procs))
            out[kind] = asyncio.run(run_load(url, args))
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(timeout=60)
    out["itl_p99_ratio_pd_vs_both"] = out["pd"]["itl_p99_ms"] / out["both"]["itl_p99_ms"]
    out["decode_tok_s_ratio_pd_vs_both"] = out["pd"]["decode_tok_s"] / out["both"]["decode_tok_s"]
    if out["both"]["long_ttft_p50_ms"] and out["pd"]["long_ttft_p50_ms"]:
        out["long_ttft_ratio_pd_vs_both"] = (
            out["pd"]["long_ttft_p50_ms"] / out["both"]["long_ttft_p50_ms"]
        )
    if args.json:
        print(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode())
    else:
        for kind in ("both", "pd"):
            r = out[kind]
            print(
                f"{kind:>4}: ITL p50 {r['itl_p50_ms']:7.1f} ms  p99 {r['itl_p99_ms']:7.1f} ms  "
                f"decode {r['decode_tok_s']:6.1f} tok/s  long-prompt TTFT p50 "
                f"{r['long_ttft_p50_ms'] or 0:7.1f} ms ({r['long_prompts']} prompts)"
            )
        print(
            f"pd/both: ITL p99 x{out['itl_p99_ratio_pd_vs_both']:.2f}, decode tok/s "
            f"x{out['decode_tok_s_ratio_pd_vs_both']:.2f}"
        )
    return 0
