"""Helpers for transfer tests: in-process managers and a prefill process that always dies."""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from pd.transfer.peerproc import parse_event
from pd.transfer import TransferConfig, TransferManager, create_manager, nixl_available

REPO = Path(__file__).resolve().parents[2]
TOKEN = "test-cluster-token-0123456789"
FAST = dict(heartbeat_interval_s=0.1, heartbeat_misses=3, handshake_timeout_s=2.0,
            transfer_timeout_s=10.0)

needs_nixl = pytest.mark.skipif(not nixl_available(), reason="no NIXL package (nixl, nixl_cu12, nixl_cu13) importable")


def backends() -> list[Any]:
    return ["fake", pytest.param("nixl", marks=[needs_nixl, pytest.mark.nixl])]


async def start_manager(backend: str, token: str = TOKEN, wire_tap=None, **overrides) -> TransferManager:
    cfg = TransferConfig(backend=backend, cluster_token=token, **{**FAST, **overrides})
    mgr = create_manager(cfg, wire_tap=wire_tap)
    await mgr.start()
    return mgr


async def eventually(pred, timeout_s: float = 5.0, what: str = "condition") -> float:
    """Wait until pred() is true; returns the seconds it took."""
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"{what} not reached within {timeout_s}s")
        await asyncio.sleep(0.01)
    return time.monotonic() - t0


class PrefillProc:
    """`python -m pd.transfer.peerproc` as a child; killed (SIGKILL) on close, whatever happened."""

    def __init__(self, spec: dict[str, Any], env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pd.transfer.peerproc", orjson.dumps(spec).decode()],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        )
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        ready = self.next_event(timeout_s=30)
        assert ready["event"] == "ready", ready
        self.port, self.engine_id, self.pid = ready["port"], ready["engine_id"], ready["pid"]

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if (event := parse_event(line)) is not None:
                self.events.put(event)

    def next_event(self, timeout_s: float = 10.0) -> dict[str, Any]:
        try:
            return self.events.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"no event from the prefill process within {timeout_s}s") from None

    async def aevent(self, timeout_s: float = 10.0) -> dict[str, Any]:
        return await asyncio.to_thread(self.next_event, timeout_s)

    async def send(self, slots: dict[str, list[int]], lease_ttl_s: float = 10.0) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(orjson.dumps({"op": "send", "slots": slots, "lease_ttl_s": lease_ttl_s}) + b"\n")
        self.proc.stdin.flush()
        ev = await self.aevent()
        assert ev["event"] == "sender", ev
        return ev["params"]

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
