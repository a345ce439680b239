"""Helpers for transfer tests: in-process managers and a prefill process that always dies."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from pd.transfer import TransferConfig, TransferManager, create_manager, nixl_available
from pd.transfer.peerproc import PeerProcess

TOKEN = "test-cluster-token-0123456789"
FAST = dict(
    heartbeat_interval_s=0.1, heartbeat_misses=3, handshake_timeout_s=2.0, transfer_timeout_s=10.0
)
# The reading side (D) progresses UCX from the poller's checks; its NIXL progress thread would
# only spin a core. The read target (P) needs one (UCX wire-up, TCP reads).
D_SIDE = dict(serve=False, nixl_progress_thread=False)

needs_nixl = pytest.mark.skipif(
    not nixl_available(), reason="no NIXL package (nixl, nixl_cu12, nixl_cu13) importable"
)


def backends() -> list[Any]:
    return ["fake", pytest.param("nixl", marks=[needs_nixl, pytest.mark.nixl])]


async def start_manager(
    backend: str, token: str = TOKEN, wire_tap=None, **overrides
) -> TransferManager:
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


class PrefillProc(PeerProcess):
    """The prefill peer process of the tests (see pd.transfer.peerproc)."""
