"""`TransferManager`: the one KVManager implementation, generic over the data-mover backend.

Prefill side: registers pools, serves the bootstrap channel, keeps the senders (leases) and
answers heartbeats/done/abort. Decode side: dials and caches peers (one PeerLink per prefill
bootstrap address), creates receivers, and runs the poller that drives in-flight pulls. A process
may do both.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import zmq.asyncio

from pd.protocol.wire import TransferParams
from pd.transfer.auth import resolve_token
from pd.transfer.backend import Backend, BackendCounts, MemRegion
from pd.transfer.base import KVManager, KVReceiver, KVSender, ReleaseCallback, SlotIds
from pd.transfer.bootstrap import BootstrapServer
from pd.transfer.config import TransferConfig
from pd.transfer.errors import HandshakeError, PoolError, TransferError
from pd.transfer.messages import Abort, Done, Heartbeat, HeartbeatAck, Message, Welcome, b64
from pd.transfer.pairing import check_contract, describe
from pd.transfer.peer import PeerLink
from pd.transfer.poller import Poller
from pd.transfer.pools import PoolDesc
from pd.transfer.receiver import Receiver
from pd.transfer.sender import Sender
from pd.transfer.session import Session

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ManagerState:
    """What a manager holds right now (for tests, /metrics and leak checks)."""

    senders: int
    receivers: int
    links: int
    connecting: int
    sessions: int
    pending_handshakes: int
    in_flight: int
    polls: int
    backend: BackendCounts
    peers_lost: int = 0  # links to prefill peers lost (dead, silent, restarted): re-dialed anew


class TransferManager(KVManager):
    def __init__(
        self,
        config: TransferConfig,
        backend: Backend,
        *,
        wire_tap: Callable[[bytes], None] | None = None,
    ) -> None:
        self.config = config
        self.engine_id = config.engine_id
        self.backend = backend
        self.pools: dict[str, PoolDesc] = {}
        self.poller = Poller(config.poll_interval_s)
        self._token = resolve_token(config.cluster_token)
        self._wire_tap = wire_tap
        self._ctx: zmq.asyncio.Context | None = None
        self._server: BootstrapServer | None = None
        self._senders: dict[str, Sender] = {}
        self._receivers: dict[int, Receiver] = {}
        self._links: dict[tuple[str, int], PeerLink] = {}
        self._connecting: dict[tuple[str, int], asyncio.Future[PeerLink]] = {}
        self._closing: set[asyncio.Task] = set()
        self._reported: set[str] = set()  # prefill engine ids whose runtime format was logged
        # Links lost to a peer that died, went silent or restarted: that peer's transfers fail
        # and the next request to it dials again; this worker stays as ready as its pages say.
        self.peers_lost = 0

    # -- lifecycle -------------------------------------------------------------------------

    def set_contract(self, contract: Mapping[str, str] | None, runtime: Mapping[str, str]) -> None:
        """Set the pairing contract and runtime format (TransferConfig.contract, .runtime) of a
        manager built before they were known; only before `start()`."""
        if self._ctx is not None:
            raise TransferError("set_contract must be called before start()")
        self.config = dataclasses.replace(self.config, contract=contract, runtime=runtime)

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        if self.config.serve:
            self._server = BootstrapServer(
                ctx=self._ctx,
                host=self.config.bootstrap_host,
                port=self.config.bootstrap_port,
                engine_id=self.engine_id,
                token=self._token,
                welcome=self._welcome,
                on_message=self._on_session_message,
                handshake_timeout_s=self.config.handshake_timeout_s,
                session_timeout_s=self.config.session_timeout_s,
                wire_tap=self._wire_tap,
            )
            await self._server.start()
        self.poller.start()

    async def close(self) -> None:
        for r in list(self._receivers.values()):
            r.abort("transfer manager closing")
        for s in list(self._senders.values()):
            s.abort("transfer manager closing")
        for fut in self._connecting.values():
            fut.cancel()
        for link in list(self._links.values()):
            self._on_link_lost(link, "closing", quiet=True)
        await asyncio.gather(*self._closing, return_exceptions=True)
        await self.poller.close()
        if self._server is not None:
            await self._server.close()
        self.backend.close()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)

    @property
    def bootstrap_port(self) -> int:
        return self._server.port if self._server is not None else 0

    @property
    def renewal_ttl_s(self) -> float:
        # D heartbeats every interval and gives P up after `misses` silent ones: one more
        # interval of slack, and P gives D up too.
        return self.config.heartbeat_interval_s * (self.config.heartbeat_misses + 1)

    @property
    def advertise_host(self) -> str:
        return self.config.advertise_host or self.config.bootstrap_host

    def register_pool(self, pool: PoolDesc) -> None:
        if pool.name in self.pools:
            raise PoolError(f"pool {pool.name!r} registered twice")
        self.backend.register(
            [MemRegion(r.base_addr, pool.region_bytes, r.mem_kind, r.device_id) for r in pool.ranks]
        )
        self.pools[pool.name] = pool

    def state(self) -> ManagerState:
        srv = self._server
        return ManagerState(
            senders=len(self._senders),
            receivers=len(self._receivers),
            links=len(self._links),
            connecting=len(self._connecting),
            sessions=len(srv.sessions) if srv else 0,
            pending_handshakes=len(srv.pending) if srv else 0,
            in_flight=self.poller.in_flight,
            polls=self.poller.polls,
            backend=self.backend.counts(),
            peers_lost=self.peers_lost,
        )

    # -- prefill side ----------------------------------------------------------------------

    def create_sender(
        self,
        slots: SlotIds,
        on_release: ReleaseCallback,
        *,
        lease_ttl_s: float | None = None,
        transfer_id: str | None = None,
    ) -> Sender:
        if self._server is None:
            raise TransferError("create_sender needs a manager with serve=True, started")
        for name, ids in slots.items():
            pool = self.pools.get(name)
            if pool is None:
                raise PoolError(f"pool {name!r} is not registered")
            if any(not 0 <= i < pool.num_slots for i in ids):
                raise PoolError(f"pool {name!r}: slot id out of range")
        tid = transfer_id or uuid.uuid4().hex
        if tid in self._senders:
            raise TransferError(f"transfer id {tid!r} is in use")
        ttl = lease_ttl_s if lease_ttl_s is not None else self.config.default_lease_ttl_s
        sender = Sender(self, tid, slots, ttl, on_release)
        self._senders[tid] = sender
        return sender

    def abort_sender(self, transfer_id: str, reason: str) -> bool:
        """Abort a transfer this side still holds (its slots are released); False if none."""
        sender = self._senders.get(transfer_id)
        if sender is None:
            return False
        sender.abort(reason)
        return True

    def forget_sender(self, sender: KVSender) -> None:
        if self._senders.get(sender.transfer_id) is sender:
            del self._senders[sender.transfer_id]

    def _welcome(self) -> Welcome:
        return Welcome(
            engine_id=self.engine_id,
            backend=self.backend.name,
            agent_metadata=b64(self.backend.metadata()),
            pools=[p.to_dict() for p in self.pools.values()],
            session_timeout_s=self.config.session_timeout_s,
            contract=dict(self.config.contract) if self.config.contract is not None else None,
            runtime=dict(self.config.runtime),
        )

    def _on_session_message(self, session: Session, msg: Message) -> Message | None:
        if isinstance(msg, Heartbeat):
            known, unknown = [], []
            for tid in msg.renew:
                sender = self._senders.get(tid)
                if sender is None:
                    unknown.append(tid)
                else:
                    sender.renew(session)
                    known.append(tid)
            return HeartbeatAck(msg.seq, self.engine_id, known, unknown)
        if isinstance(msg, Done):
            if (sender := self._senders.get(msg.transfer_id)) is not None:
                sender.on_done()
        elif isinstance(msg, Abort):
            if (sender := self._senders.get(msg.transfer_id)) is not None:
                sender.on_remote_abort(msg.reason)
        else:
            log.info("bootstrap: unexpected %s in a session", msg.TYPE)
        return None

    async def server_send(self, session: Session, msg: Message) -> None:
        if self._server is not None:
            await self._server.send_session(session, msg)

    # -- decode side -----------------------------------------------------------------------

    def create_receiver(self, params: TransferParams) -> Receiver:
        if self._ctx is None:
            raise TransferError("the transfer manager is not started")
        receiver = Receiver(self, params)
        self._receivers[id(receiver)] = receiver
        return receiver

    def forget_receiver(self, receiver: KVReceiver) -> None:
        self._receivers.pop(id(receiver), None)

    async def link_to(self, params: TransferParams) -> PeerLink:
        key = (params.remote_host, params.remote_port)
        link = self._links.get(key)
        if link is not None and link.alive and link.engine_id != params.remote_engine_id:
            self._on_link_lost(link, "prefill restarted (engine id changed)")  # re-handshake
            link = None
        if link is None or not link.alive:
            fut = self._connecting.get(key)
            if fut is None:
                fut = asyncio.ensure_future(self._connect(key))
                self._connecting[key] = fut
                fut.add_done_callback(lambda f: self._connect_done(key, f))
            link = await asyncio.shield(fut)
        if link.engine_id != params.remote_engine_id:
            raise HandshakeError(
                f"prefill at {key[0]}:{key[1]} is engine {link.engine_id}, the request was "
                f"prefilled by {params.remote_engine_id} (restarted?)"
            )
        return link

    def _connect_done(self, key: tuple[str, int], fut: asyncio.Future) -> None:
        self._connecting.pop(key, None)
        if not fut.cancelled():
            fut.exception()  # retrieved: every waiter sees it (or already failed by its deadline)

    async def _connect(self, key: tuple[str, int]) -> PeerLink:
        assert self._ctx is not None
        cfg = self.config
        link = PeerLink(
            ctx=self._ctx,
            host=key[0],
            port=key[1],
            my_engine_id=self.engine_id,
            token=self._token,
            heartbeat_interval_s=cfg.heartbeat_interval_s,
            heartbeat_misses=cfg.heartbeat_misses,
            idle_timeout_s=cfg.peer_idle_timeout_s,
            on_lost=self._on_link_lost,
            wire_tap=self._wire_tap,
        )
        await link.handshake(cfg.handshake_timeout_s)
        peer = f"{key[0]}:{key[1]} (engine {link.engine_id})"
        try:
            check_contract(
                cfg.contract, link.contract, peer=peer, me=f"engine {self.engine_id}",
                peer_runtime=link.runtime, my_runtime=cfg.runtime,
            )  # fmt: skip
        except TransferError as e:
            log.warning("refused at the handshake: %s", e)
            await link.refuse(str(e))
            raise
        if link.engine_id not in self._reported:
            self._reported.add(link.engine_id)
            log.info(
                "paired with prefill %s: it runs %s; this side runs %s",
                peer, describe(link.runtime), describe(cfg.runtime),
            )  # fmt: skip
        try:
            if link.backend != self.backend.name:
                raise HandshakeError(
                    f"prefill uses backend {link.backend!r}, we use {self.backend.name!r}"
                )
            link.agent = self.backend.add_peer(link.agent_metadata)
        except Exception as e:
            await link.close()
            raise e if isinstance(e, TransferError) else HandshakeError(str(e)) from e
        link.agent_metadata = b""
        self._links[key] = link
        link.start()
        return link

    def _on_link_lost(self, link: PeerLink, reason: str, quiet: bool = False) -> None:
        """Fail the link's transfers, forget everything about the peer, close the link."""
        if not quiet:
            self.peers_lost += 1
            log.warning(
                "lost prefill peer %s:%d (engine %s): %s; %d transfers fail, the next request "
                "dials it again",
                link.host, link.port, link.engine_id, reason, len(link.clients),
            )  # fmt: skip
        for client in list(link.clients.values()):
            client.on_peer_lost(reason)
        key = (link.host, link.port)
        if self._links.get(key) is link:
            del self._links[key]
        if link.agent:
            self.backend.remove_peer(link.agent)
        task = asyncio.ensure_future(link.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
