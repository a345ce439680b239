"""The processes of `pd-bench soak`: how each is started, killed and restarted, and the polls
that wait for them (`/health`, the router's view of a worker)."""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from pd.ports import free_port


def _die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn that has the child SIGKILLed when the soak dies (Linux), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, not in the child
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1

    def preexec() -> None:
        prctl(pr_set_pdeathsig, signal.SIGKILL)

    return preexec


@dataclass
class Service:
    """One process of the cluster: how to start it and where it answers."""

    name: str  # "prefill", "decode" or "router"
    argv: list[str]
    url: str
    log_path: str
    proc: subprocess.Popen[bytes] | None = None


class Cluster:
    """Starts, kills and restarts the soak's processes; `stop()` ends every one still running."""

    def __init__(self, env: dict[str, str], log_dir: str) -> None:
        self.env = env
        self.log_dir = log_dir
        self.services: dict[str, Service] = {}
        self._preexec = _die_with_parent()

    def add(self, name: str, module: str, *args: str) -> Service:
        port = free_port()
        argv = [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(port), *args]
        log_path = os.path.join(self.log_dir, f"{name}.log")
        svc = Service(name, argv, f"http://127.0.0.1:{port}", log_path)
        self.services[name] = svc
        return svc

    def start(self, name: str) -> None:
        svc = self.services[name]
        assert svc.proc is None, f"{name} is running"
        with open(svc.log_path, "ab") as log:
            log.write(f"\n===== pd-bench soak: start {name} at {time.time():.3f}\n".encode())
            log.flush()
            svc.proc = subprocess.Popen(
                svc.argv,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=self._preexec,
            )

    def kill(self, name: str) -> None:
        svc = self.services[name]
        assert svc.proc is not None, f"{name} is not running"
        svc.proc.kill()
        svc.proc.wait()
        svc.proc = None

    def exited(self) -> list[str]:
        """The processes that exited without being killed by the soak."""
        return [
            f"{svc.name} exited on its own with code {svc.proc.returncode} (log {svc.log_path})"
            for svc in self.services.values()
            if svc.proc is not None and svc.proc.poll() is not None
        ]

    def log_tail(self, name: str, n: int = 2000) -> str:
        try:
            with open(self.services[name].log_path, "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        running = [s.proc for s in self.services.values() if s.proc is not None]
        for proc in running:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 10
        for proc in running:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for svc in self.services.values():
            svc.proc = None


async def wait_ready(
    http: aiohttp.ClientSession, cluster: Cluster, name: str, timeout: float = 300.0
) -> None:
    """Until the service's `/health` answers 200; raises if it exits or takes too long."""
    svc = cluster.services[name]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if svc.proc is None or svc.proc.poll() is not None:
            raise RuntimeError(f"{name} exited while starting:\n{cluster.log_tail(name)}")
        try:
            async with http.get(f"{svc.url}/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                if r.status == 200:
                    return
        except (aiohttp.ClientError, TimeoutError):
            pass
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{name} was not ready within {timeout:g} s:\n{cluster.log_tail(name)}")


async def router_says_healthy(http: aiohttp.ClientSession, router: str, worker: str) -> bool | None:
    """The router's view of one worker (`GET /workers`); None when it cannot be read."""
    try:
        async with http.get(f"{router}/workers", timeout=aiohttp.ClientTimeout(total=2)) as r:
            body = await r.json()
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None
    for w in body.get("workers", []):
        if w.get("url") == worker:
            return bool(w.get("healthy"))
    return None


async def poll(predicate: Callable[[], Any], timeout: float, interval: float = 0.05) -> bool:
    """Until `await predicate()` (or `predicate()`) is true; False when `timeout` passed first."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(interval)
