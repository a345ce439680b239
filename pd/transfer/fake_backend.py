"""`fake` backend: an in-process copy that obeys the backend contract.

Both managers must live in the same process (peers are found in a process-wide registry by agent
name). Reads are validated against registered memory like NIXL does, and the copy happens when a
transfer is first seen complete. Fault hooks let tests drive the failure paths.
"""

from __future__ import annotations

import ctypes
import itertools
import time
import weakref
from dataclasses import dataclass

import numpy as np
import orjson

from pd.transfer.backend import Backend, BackendCounts, MemRegion, XferState
from pd.transfer.errors import TransferError
from pd.transfer.plan import ReadBatch

_AGENTS: weakref.WeakValueDictionary[str, FakeBackend] = weakref.WeakValueDictionary()


@dataclass
class _Xfer:
    agent: str
    batches: list[ReadBatch]
    ready_at: float
    state: XferState = XferState.PROC


class FakeBackend(Backend):
    name = "fake"

    def __init__(self, agent_name: str, *, read_delay_s: float = 0.0) -> None:
        if agent_name in _AGENTS:
            raise TransferError(f"fake agent {agent_name!r} exists already")
        self.agent_name = agent_name
        self.read_delay_s = read_delay_s  # fault hook: how long a read stays in flight
        self.fail_reads = False  # fault hook: every read ends in ERR
        self.check_error: Exception | None = None  # fault hook: `check` raises this
        # Fault hook: a read released while in flight cannot be cancelled; it "lands" for this
        # many seconds more (then `settled` says so). None: every release cancels.
        self.uncancellable_s: float | None = None
        self._landing: dict[int, float] = {}  # uncancelled read -> when it has surely ended
        self._regions: list[MemRegion] = []
        self._peers: set[str] = set()
        self._xfers: dict[int, _Xfer] = {}
        self._ids = itertools.count(1)
        self._closed = False
        _AGENTS[agent_name] = self

    def register(self, regions: list[MemRegion]) -> None:
        if any(r.kind != "DRAM" for r in regions):
            raise TransferError("the fake backend copies host memory only")
        self._regions.extend(regions)

    def metadata(self) -> bytes:
        return orjson.dumps({"fake_agent": self.agent_name})

    def add_peer(self, metadata: bytes) -> str:
        name = orjson.loads(metadata)["fake_agent"]
        if name not in _AGENTS:
            raise TransferError(f"fake agent {name!r} is not in this process")
        self._peers.add(name)
        return name

    def remove_peer(self, agent: str) -> None:
        for xid in [x for x, v in self._xfers.items() if v.agent == agent]:
            self.release(xid)
        self._peers.discard(agent)

    def _covered(self, regions: list[MemRegion], kind: str, descs: np.ndarray) -> bool:
        for addr, n, dev in descs.tolist():
            if not any(
                r.kind == kind
                and r.device_id == dev
                and r.addr <= addr
                and addr + n <= r.addr + r.nbytes
                for r in regions
            ):
                return False
        return True

    def start_read(self, agent: str, batches: list[ReadBatch]) -> int:
        peer = _AGENTS.get(agent)
        if agent not in self._peers or peer is None:
            raise TransferError(f"unknown peer agent {agent!r}")
        for b in batches:
            if not self._covered(self._regions, b.local_kind, b.local):
                raise TransferError("local descriptor outside registered memory")
            if not self._covered(peer._regions, b.remote_kind, b.remote):
                raise TransferError("remote descriptor outside the peer's registered memory")
        xid = next(self._ids)
        self._xfers[xid] = _Xfer(agent, batches, time.monotonic() + self.read_delay_s)
        return xid

    def check(self, xfer: int) -> XferState:
        if self.check_error is not None:
            raise self.check_error
        x = self._xfers.get(xfer)
        if x is None:
            return XferState.ERR
        if x.state is XferState.PROC:
            peer = _AGENTS.get(x.agent)
            if self.fail_reads or peer is None or peer._closed:
                x.state = XferState.ERR
            elif time.monotonic() >= x.ready_at:
                for b in x.batches:
                    for (la, n, _), (ra, _, _) in zip(b.local.tolist(), b.remote.tolist()):
                        ctypes.memmove(la, ra, n)
                x.state = XferState.DONE
        return x.state

    def release(self, xfer: int) -> bool:
        x = self._xfers.pop(xfer, None)
        if x is not None and x.state is XferState.PROC and self.uncancellable_s is not None:
            self._landing[xfer] = time.monotonic() + self.uncancellable_s
        # Else the copy is done or never started: nothing can land later.
        return xfer not in self._landing

    def settled(self, xfer: int) -> bool:
        if time.monotonic() < self._landing.get(xfer, 0.0):
            return False
        self._landing.pop(xfer, None)
        return True

    def counts(self) -> BackendCounts:
        return BackendCounts(len(self._peers), len(self._xfers), 0)

    def close(self) -> None:
        self._xfers.clear()
        self._peers.clear()
        self._regions.clear()
        self._closed = True
        if _AGENTS.get(self.agent_name) is self:
            del _AGENTS[self.agent_name]
