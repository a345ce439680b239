"""`sim` backend: reads that take the time a modeled link gives and move no bytes.

For simulated workers (`pd-worker --simulate`), whose KV pools are described (real slot sizes)
but hold no memory. P and D are separate processes, so unlike the fake backend nothing is looked
up in-process: a peer's metadata carries its registered regions, and reads are checked against
those and our own as NIXL checks them. Everything else (handshake, leases, heartbeats, done,
abort) is the manager's real code over the real bootstrap channel.

The link: each local device (a TP rank's region, `cuda:r`) has a link of `bandwidth` bytes/s.
A read's bytes per local device are the sizes of its descriptors landing there; on each device
it starts when that link is free (`busy_until`, shared by every read into this worker: concurrent
pulls queue on it) and occupies it for `bytes / bandwidth`; the read is done `latency_s` after its
last device's bytes (latency does not occupy the link: reads pipeline). Every modeled duration
is stretched by `time_scale`. With the bytes even over `tp` ranks that is the profile's
`LinkSpec.transfer_s(bytes, tp)`, what the planner charges a pull.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import orjson

from pd.transfer.backend import Backend, BackendCounts, MemRegion, XferState
from pd.transfer.errors import TransferError
from pd.transfer.plan import ReadBatch


@dataclass
class _Xfer:
    agent: str
    ready_at: float
    # Per local device: (when its bytes started, when they are in): for the link's bookkeeping.
    lanes: dict[int, tuple[float, float]] = field(default_factory=dict)
    nbytes: int = 0


class SimBackend(Backend):
    name = "sim"

    def __init__(
        self,
        agent_name: str,
        *,
        bandwidth: float,
        latency_s: float = 0.0,
        time_scale: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if bandwidth <= 0 or latency_s < 0 or time_scale <= 0:
            raise ValueError("sim backend: bandwidth and time_scale > 0, latency_s >= 0")
        self.agent_name = agent_name
        self.bandwidth = bandwidth
        self.latency_s = latency_s
        self.time_scale = time_scale
        self.clock = clock
        self.fail_reads = False  # fault hook: every read ends in ERR
        self._regions: list[MemRegion] = []
        self._peers: dict[str, list[MemRegion]] = {}
        self._xfers: dict[int, _Xfer] = {}
        self._busy_until: dict[int, float] = {}  # local device -> when its link is free
        self._ids = itertools.count(1)
        self.reads = 0  # reads posted, and their bytes (for tests and reports)
        self.bytes_read = 0

    def register(self, regions: list[MemRegion]) -> None:
        self._regions.extend(regions)

    def metadata(self) -> bytes:
        return orjson.dumps(
            {
                "sim_agent": self.agent_name,
                "regions": [[r.addr, r.nbytes, r.kind, r.device_id] for r in self._regions],
            }
        )

    def add_peer(self, metadata: bytes) -> str:
        try:
            meta = orjson.loads(metadata)
            name = str(meta["sim_agent"])
            regions = [MemRegion(int(a), int(n), str(k), int(d)) for a, n, k, d in meta["regions"]]
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise TransferError(f"not a sim backend's metadata: {e}") from e
        self._peers[name] = regions
        return name

    def remove_peer(self, agent: str) -> None:
        for xid in [x for x, v in self._xfers.items() if v.agent == agent]:
            self.release(xid)
        self._peers.pop(agent, None)

    def start_read(self, agent: str, batches: list[ReadBatch]) -> int:
        peer = self._peers.get(agent)
        if peer is None:
            raise TransferError(f"unknown peer agent {agent!r}")
        per_device: dict[int, int] = {}
        for b in batches:
            if not _covered(self._regions, b.local_kind, b.local):
                raise TransferError("local descriptor outside registered memory")
            if not _covered(peer, b.remote_kind, b.remote):
                raise TransferError("remote descriptor outside the peer's registered memory")
            # Bytes per local device (bincount: np.unique's first call pays for lazy imports,
            # docs/EXPERIMENTS.md §23).
            sums = np.bincount(b.local[:, 2].astype(np.int64), weights=b.local[:, 1])
            for dev in np.flatnonzero(sums).tolist():
                per_device[dev] = per_device.get(dev, 0) + int(sums[dev])
        now = self.clock()
        x = _Xfer(agent, now + self.time_scale * self.latency_s)
        for dev, nbytes in per_device.items():
            start = max(now, self._busy_until.get(dev, now))
            end = start + self.time_scale * nbytes / self.bandwidth
            self._busy_until[dev] = end
            x.lanes[dev] = (start, end)
            x.ready_at = max(x.ready_at, end + self.time_scale * self.latency_s)
            x.nbytes += nbytes
        xid = next(self._ids)
        self._xfers[xid] = x
        self.reads += 1
        self.bytes_read += x.nbytes
        return xid

    def ready_at(self, xfer: int) -> float | None:
        """When a posted read completes (on `clock`); None when it is not held."""
        x = self._xfers.get(xfer)
        return x.ready_at if x is not None else None

    def check(self, xfer: int) -> XferState:
        x = self._xfers.get(xfer)
        if x is None or self.fail_reads:
            return XferState.ERR
        return XferState.DONE if self.clock() >= x.ready_at else XferState.PROC

    def release(self, xfer: int) -> bool:
        """Always cancels (nothing can land: there are no bytes). A read cancelled in flight
        gives back the rest of its share of a link if nothing queued behind it."""
        x = self._xfers.pop(xfer, None)
        if x is not None:
            now = self.clock()
            for dev, (start, end) in x.lanes.items():
                if self._busy_until.get(dev) == end and end > now:
                    self._busy_until[dev] = max(now, start)
        return True

    def link_free_at(self, device: int = 0) -> float:
        """When the link of local `device` has carried every read posted so far."""
        return self._busy_until.get(device, 0.0)

    def counts(self) -> BackendCounts:
        return BackendCounts(len(self._peers), len(self._xfers), 0)

    def close(self) -> None:
        self._xfers.clear()
        self._peers.clear()
        self._regions.clear()
        self._busy_until.clear()


def _covered(regions: list[MemRegion], kind: str, descs: np.ndarray) -> bool:
    """Every (addr, len, dev) row lies inside one region of `kind` on its device."""
    if not len(descs):
        return True
    addr, n, dev = (descs[:, i].astype(np.int64) for i in range(3))
    ok = np.zeros(len(descs), dtype=bool)
    for r in regions:
        if r.kind == kind:
            ok |= (dev == r.device_id) & (addr >= r.addr) & (addr + n <= r.addr + r.nbytes)
    return bool(ok.all())
