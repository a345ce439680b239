"""The data-mover interface every backend implements. Backends move bytes; they know nothing
about requests, leases or pool semantics (those live in the manager and `plan.py`)."""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass

from pd.transfer.plan import ReadBatch


class XferState(enum.Enum):
    DONE = "DONE"
    PROC = "PROC"
    ERR = "ERR"


@dataclass(frozen=True)
class MemRegion:
    addr: int
    nbytes: int
    kind: str  # "DRAM" or "VRAM"
    device_id: int


@dataclass(frozen=True)
class BackendCounts:
    """What a backend holds about its peers; used to check that nothing of a dead peer remains."""

    remote_agents: int
    xfer_handles: int
    dlists: int


class Backend(ABC):
    """One agent per manager (per process). All methods run on the manager's event loop thread."""

    name: str

    @abstractmethod
    def register(self, regions: list[MemRegion]) -> None:
        """Register memory that peers may read (and that local reads land in)."""

    @abstractmethod
    def metadata(self) -> bytes:
        """Opaque bytes a peer passes to `add_peer` to read from us."""

    @abstractmethod
    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns its agent name."""

    @abstractmethod
    def remove_peer(self, agent: str) -> None:
        """Forget a peer; releases every transfer still held towards it."""

    @abstractmethod
    def start_read(self, agent: str, batches: list[ReadBatch]) -> int:
        """Post reads from `agent` into local memory; returns a transfer id."""

    @abstractmethod
    def check(self, xfer: int) -> XferState:
        """Progress of a posted transfer. Never raises for a transport error: returns ERR."""

    @abstractmethod
    def release(self, xfer: int) -> bool:
        """Release a transfer (cancelling it if still in flight). Idempotent. False when an
        in-flight transfer could not be cancelled: it may still write into its destination."""

    def settled(self, xfer: int) -> bool:
        """For a transfer whose `release` returned False: True once the transport confirms it
        has ended (nothing can land any more). Backends that always cancel never see this."""
        return True

    @abstractmethod
    def counts(self) -> BackendCounts: ...

    @abstractmethod
    def close(self) -> None:
        """Release everything and deregister memory. Idempotent."""
