"""The four base classes of the transfer layer (SGLang's split, on asyncio).

- KVManager: one per process; registers pools with the backend, owns the agent, runs the bootstrap
  server (prefill) or dials it (decode), caches peers, runs the poller.
- KVSender: one per request on the prefill side; holds the request's slots under a lease until
  the decode side says done, aborts, or the lease runs out, then tells the slots' owner.
- KVReceiver: one per request on the decode side; handshakes, renews the lease, pulls into its own
  pre-allocated slots.
- KVBootstrapServer: the prefill side's rendezvous endpoint.

The scheduler reads `poll()` once per tick (or awaits `wait()`); handshakes, retries, deadlines and
heartbeats hide behind it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from pd.transfer.params import TransferParams
from pd.transfer.poll import KVPoll
from pd.transfer.pools import PoolDesc

SlotIds = dict[str, list[int]]  # pool name -> slot (page) ids, in transfer order


class KVSender(ABC):
    transfer_id: str

    @abstractmethod
    def poll(self) -> KVPoll: ...

    @property
    @abstractmethod
    def failure_reason(self) -> str | None: ...

    @abstractmethod
    def params(self) -> TransferParams:
        """What the decode side needs to pull (goes into the HTTP answer's kv_transfer_params)."""

    @abstractmethod
    def abort(self, reason: str = "aborted by prefill") -> None:
        """Give up: release the slots now and tell the decode side if it is attached."""


class KVReceiver(ABC):
    transfer_id: str

    @abstractmethod
    def poll(self) -> KVPoll: ...

    @property
    @abstractmethod
    def failure_reason(self) -> str | None: ...

    @abstractmethod
    def init(self, dst_slots: SlotIds) -> None:
        """Hand over the pre-allocated local slots; the pull starts once the handshake is done."""

    @abstractmethod
    async def wait(self) -> KVPoll:
        """Wait until Success or Failed."""

    @abstractmethod
    def abort(self, reason: str = "aborted by decode") -> None:
        """Give up: stop the pull, release transfer resources, tell the prefill side."""


class KVBootstrapServer(ABC):
    @property
    @abstractmethod
    def port(self) -> int:
        """The bound port (the configured one, or the ephemeral one picked for port 0)."""

    @abstractmethod
    async def start(self) -> int: ...

    @abstractmethod
    async def close(self) -> None: ...


ReleaseCallback = Callable[
    [KVSender, str], None
]  # (sender, reason: "done"|"abort"|"lease_expired")


class KVManager(ABC):
    engine_id: str

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def close(self) -> None: ...

    @abstractmethod
    def register_pool(self, pool: PoolDesc) -> None: ...

    @abstractmethod
    def create_sender(
        self,
        slots: SlotIds,
        on_release: ReleaseCallback,
        *,
        lease_ttl_s: float | None = None,
        transfer_id: str | None = None,
    ) -> KVSender: ...

    @abstractmethod
    def create_receiver(self, params: TransferParams) -> KVReceiver: ...
