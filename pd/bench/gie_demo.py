"""`scripts/gie_demo.sh`: pd behind a real Envoy as the Gateway API Inference Extension sees it,
on loopback, in one command. It starts a prefill and two decode workers (simulated GPUs by
default: no weights to load; `--real` runs the embedded model), pd-router with
`--endpoint-picker`, and Envoy consulting it (pd/bench/envoy.py); sends `--requests` requests
through Envoy (every other one streamed), and prints one JSON line: `requests`, `ok`,
`decisions` (the picker's count, from the router's /metrics), `matched` (answers Envoy served
from the endpoint the picker chose: its `x-pd-upstream` equals `x-pd-picked`), `pulled` (requests
whose KV the decode worker pulled from the prefill worker the picker named: disaggregated, not
prefilled on D) and `seconds`."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import aiohttp

from pd.bench.envoy import start_envoy
from pd.bench.pd import _spawn, _wait_healthy
from pd.ports import free_port


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gie_demo", description=__doc__)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--simulate", default="llama-3.1-8b:h100:tp1",
                   help="the workers' simulated profile")  # fmt: skip
    p.add_argument("--real", action="store_true", help="the embedded model instead (slower)")
    args = p.parse_args(argv)
    os.environ.setdefault("PD_CLUSTER_TOKEN", "pd-gie-demo")
    return asyncio.run(_run(args))


async def _run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    procs = []
    envoy = None
    try:
        model = [] if args.real else ["--simulate", args.simulate]
        urls: dict[str, list[str]] = {}
        for role in ("prefill", "decode", "decode"):
            port = free_port()
            # each decode worker trusts the prefill worker: the picker names it, signed
            peers = ["--prefill-peer", urls["prefill"][0]] if role == "decode" else []
            procs.append(_spawn("pd.worker.main", "--role", role, "--port", str(port),
                                "--threads", "1", *model, *peers))  # fmt: skip
            urls.setdefault(role, []).append(f"http://127.0.0.1:{port}")
        for u in urls["prefill"] + urls["decode"]:
            await _wait_healthy(u, procs, timeout=600)
        port, picker = free_port(), free_port()
        procs.append(_spawn(
            "pd.router.main", "--port", str(port), "--endpoint-picker", "--picker-port",
            str(picker), "--prefill", urls["prefill"][0],
            *[a for u in urls["decode"] for a in ("--decode", u)],
        ))  # fmt: skip
        router = f"http://127.0.0.1:{port}"
        await _wait_healthy(router, procs)
        envoy = await asyncio.to_thread(start_envoy, picker)
        ok = matched = 0
        async with aiohttp.ClientSession() as http:
            for i in range(args.requests):
                body = {
                    "model": "default", "max_tokens": 16, "stream": i % 2 == 0,
                    "messages": [{"role": "user", "content": f"Say something about {i}."}],
                }  # fmt: skip
                async with http.post(f"{envoy.url}/v1/chat/completions", json=body) as r:
                    await r.read()
                    ok += r.status == 200
                    up, picked = r.headers.get("x-pd-upstream"), r.headers.get("x-pd-picked")
                    matched += r.status == 200 and up is not None and up == picked
            async with http.get(f"{router}/metrics") as r:
                text = await r.text()
            pulled = 0.0  # requests whose KV a decode worker pulled from P: disaggregated
            for u in urls["decode"]:
                async with http.get(f"{u}/metrics") as r:
                    pulled += sum(
                        float(line.split()[-1]) for line in (await r.text()).splitlines()
                        if line.startswith("pd_kv_transfer_seconds_count")
                    )  # fmt: skip
        decisions = next(
            (float(line.split()[-1]) for line in text.splitlines()
             if line.startswith("pd_router_picker_decisions_total")), 0.0,
        )  # fmt: skip
        out = {"requests": args.requests, "ok": ok, "decisions": int(decisions),
               "matched": matched, "pulled": int(pulled),
               "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip
        print(json.dumps(out), flush=True)
        return 0 if ok == matched == int(decisions) == int(pulled) == args.requests else 1
    finally:
        if envoy is not None:
            envoy.stop()
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except Exception:
                proc.kill()


if __name__ == "__main__":
    sys.exit(main())
