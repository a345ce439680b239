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

`SenderHost` and `ReceiverHost` name what a sender and a receiver use of the manager that owns
them (the manager is both), so each can be driven against a stub host in a unit test.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

from pd.protocol.wire import TransferParams
from pd.transfer.poll import KVPoll
from pd.transfer.pools import PoolDesc

if TYPE_CHECKING:
    from pd.transfer.backend import Backend
    from pd.transfer.config import TransferConfig
    from pd.transfer.messages import Message
    from pd.transfer.peer import LinkClient
    from pd.transfer.poller import Poller
    from pd.transfer.session import Session

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
    # True when a read could not be cancelled and may still land in the destination slots:
    # their owner must not reuse them until `reclaim()` says the read has ended.
    dst_unsafe: bool = False
    started_at: float | None = None  # monotonic: when the reads were posted
    finished_at: float | None = None  # monotonic: when it succeeded or failed

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

    @abstractmethod
    def reclaim(self) -> bool:
        """True once nothing can land in the destination slots any more (always, unless
        `dst_unsafe`: then once the transport confirms the uncancelled read has ended)."""


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
]  # (sender, reason: "done"|"abort"|"lease_expired"|"decode_lost")


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


# -- what a sender and a receiver use of the manager that owns them ---------------------------
# `TransferManager` is the host of both; a unit test can drive either against a stub host.


class SenderHost(Protocol):
    """What a `Sender` uses of its manager (prefill side)."""

    @property
    def engine_id(self) -> str: ...

    @property
    def advertise_host(self) -> str:
        """The host the decode side dials (goes into the params)."""

    @property
    def bootstrap_port(self) -> int:
        """The bound bootstrap port (goes into the params)."""

    @property
    def renewal_ttl_s(self) -> float:
        """How long a renewal by the decode side's heartbeat lasts (a few heartbeats)."""

    async def server_send(self, session: Session, msg: Message) -> None:
        """Send a session message to the decode side behind `session`."""

    def forget_sender(self, sender: KVSender) -> None:
        """Stop tracking a sender that released its slots (its transfer id is free again)."""


class ReceiverLink(Protocol):
    """What a `Receiver` uses of its link to the prefill peer (`peer.PeerLink`)."""

    @property
    def agent(self) -> str:
        """The backend agent name of the peer (to read from)."""

    @property
    def pools(self) -> Mapping[str, PoolDesc]:
        """The peer's pools, from its handshake."""

    def attach(self, transfer_id: str, client: LinkClient) -> None: ...

    def detach(self, transfer_id: str) -> None: ...

    def send(self, msg: Message) -> None:
        """Send a session message (done, abort) without waiting."""

    def suspect(self) -> None:
        """A transport error was seen: check the peer is alive."""


class ReceiverHost(Protocol):
    """What a `Receiver` uses of its manager (decode side)."""

    @property
    def config(self) -> TransferConfig: ...

    @property
    def pools(self) -> Mapping[str, PoolDesc]:
        """The local pools (the read destinations)."""

    @property
    def backend(self) -> Backend: ...

    @property
    def poller(self) -> Poller: ...

    async def link_to(self, params: TransferParams) -> ReceiverLink:
        """The live link to the prefill peer of `params`, dialled and handshaken if needed;
        raises TransferError (HandshakeError, AuthError, ...) when there is none."""

    def forget_receiver(self, receiver: KVReceiver) -> None:
        """Stop tracking a receiver that finished (success or failure)."""
