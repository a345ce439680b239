"""Instructions a streamed PD request costs the relay process, counted by callgrind: a figure
the machine's load does not move (latency and CPU time on a shared machine do).

The stub P and D (`pd-bench router`'s, 32 SSE chunks) and the load run natively; the relay (the
`pd-router` of this tree with `pd-bench router`'s settings, or with --bare its bare relay) runs
under `valgrind --tool=callgrind`, counted only inside uvloop's run loop (no start-up, no
imports). It serves 20 requests of warm-up, then N sequential ones; the script prints the
instructions collected. Run it for two N and take the difference over the requests between, so
that the warm-up and the start of the loop cancel out:

    python scripts/router_ir.py 30; python scripts/router_ir.py 130   # (Ir_130 - Ir_30) / 100

Run from the tree to measure (the relay imports `pd` from the working directory). Slow: the
relay runs about 50 times slower under callgrind, so D's events reach it a few at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time

import aiohttp
import orjson

ROUTER_FLAGS = [
    "--policy", "load-aware", "--api-key", "bench-key", "--admin-token", "bench-admin",
    "--health-interval", "1", "--log-level", "warning", "--local-prefill-max-tokens", "0",
]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _load(url: str, n: int) -> None:
    body = orjson.dumps(
        {
            "model": "stub-model",
            "prompt": "The quick brown fox jumps over the lazy dog. " * 8,
            "max_tokens": 32,
            "stream": True,
        }
    )
    headers = {"Content-Type": "application/json", "Authorization": "Bearer bench-key"}
    async with aiohttp.ClientSession() as s:
        end = time.monotonic() + 600
        while True:
            try:
                async with s.get(url + "/health") as r:
                    if r.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            if time.monotonic() > end:
                raise RuntimeError(f"{url} did not become ready")
            await asyncio.sleep(0.5)
        for _ in range(20 + n):
            async with s.post(url + "/v1/completions", data=body, headers=headers) as r:
                data = await r.read()
            if not data.endswith(b"data: [DONE]\n\n") or b": pd-" in data:
                raise RuntimeError(f"a bad stream: {data[-200:]!r}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("n", type=int, help="requests counted after the warm-up")
    p.add_argument("--bare", action="store_true", help="the bare relay instead of pd-router")
    args = p.parse_args()
    pp, dp, rp = _free_port(), _free_port(), _free_port()
    p_url, d_url = f"http://127.0.0.1:{pp}", f"http://127.0.0.1:{dp}"
    stubs = subprocess.Popen(
        [sys.executable, "-m", "pd.bench.router", "_stubs", str(pp), str(dp), "32"],
        start_new_session=True,
    )
    if args.bare:
        relay = ["-m", "pd.bench.router", "_bare", str(rp), p_url, d_url]
    else:
        relay = ["-m", "pd.router.main", "--port", str(rp), "--prefill", p_url, "--decode", d_url]
        relay += ROUTER_FLAGS
    callgrind = [
        "valgrind",
        "--tool=callgrind",
        "--callgrind-out-file=/dev/null",
        "--toggle-collect=*run_forever*",
    ]
    proc = subprocess.Popen(
        [*callgrind, sys.executable, *relay], start_new_session=True, stderr=subprocess.PIPE
    )
    try:
        asyncio.run(_load(f"http://127.0.0.1:{rp}", args.n))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=600)
        os.killpg(stubs.pid, signal.SIGTERM)
        stubs.wait(timeout=10)
    found = re.search(rb"Collected : ([\d,]+)", err)
    if found is None:
        print(err.decode(errors="replace")[-2000:], file=sys.stderr)
        return 1
    print(int(found.group(1).replace(b",", b"")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
