"""Start real `pd-worker` processes for tests, and wait for what they report."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import aiohttp

CLUSTER_TOKEN = "test-cluster-token"


def start_worker(
    *args: str,
    timeout: float = 180.0,
    device: str | None = "cpu",
    env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen, str]:
    """Start `pd-worker --port 0 ...` on `device` (None: as `args` say), with `env` over this
    process's environment; return the process and its URL once ready."""
    on = ("--device", device) if device else ()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pd.worker.main", "--port", "0", *on, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "PD_CLUSTER_TOKEN": CLUSTER_TOKEN,
            **(env or {}),
        },
    )
    deadline = time.monotonic() + timeout
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("pd-worker ready:"):
            # Keep reading its output, so a chatty worker never blocks on a full pipe.
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, line.split("url=")[1].split()[0]
    proc.kill()
    raise AssertionError("pd-worker did not become ready:\n" + "".join(lines[-30:]))


def start_workers(
    *arg_lists: Sequence[str], timeout: float = 180.0, env: dict[str, str] | None = None
) -> list[tuple[subprocess.Popen, str]]:
    """Start a `pd-worker` per argument list, all at once (each start is mostly one core's
    import and load); [(process, url)] in that order. Every one started is stopped if another
    fails."""
    with ThreadPoolExecutor(len(arg_lists)) as pool:
        started = [pool.submit(start_worker, *args, timeout=timeout, env=env) for args in arg_lists]
    procs = [f.result() for f in started if f.exception() is None]
    if len(procs) < len(arg_lists):
        for proc, _ in procs:
            stop(proc)
        raise AssertionError([f.exception() for f in started if f.exception() is not None])
    return procs


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


async def wait_pages_free(http: aiohttp.ClientSession, url: str, timeout: float = 10.0) -> dict:
    """Poll a worker's /health until every KV page is free and nothing is in flight, with its
    page accounting intact (`/health`'s cheap `integrity` meanwhile, then `/integrity`: the
    allocator's and scheduler's `check_integrity`, every page walked)."""
    deadline = time.monotonic() + timeout
    while True:
        health = await (await http.get(f"{url}/health")).json()
        assert health["integrity"] == "ok", f"{url}: {health['integrity']}"
        load = health["load"]
        settled = load["running"] == load["waiting"] == load["inflight_transfers"] == 0
        if settled and load["kv_pages_free"] == load["kv_pages_total"]:
            walk = await (await http.get(f"{url}/integrity")).json()
            assert walk["integrity"] == "ok", f"{url}: {walk}"
            return load
        assert time.monotonic() < deadline, f"{url} still holds pages: {load}"
        await asyncio.sleep(0.05)
