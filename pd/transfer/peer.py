"""The decode side's link to one prefill peer: a ZMQ DEALER socket, the D half of the handshake,
heartbeats that renew the leases of the attached transfers, and dead-peer detection.

A link heartbeats only while transfers are attached to it; an idle link sleeps, and is closed after
`idle_timeout_s` (before P would drop the session), so an idle decode manager costs no CPU.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from typing import Protocol

import zmq
import zmq.asyncio

import pd.transfer.auth as auth
from pd._compat import asyncio_timeout
from pd.transfer.errors import AuthError, HandshakeError, ProtocolError
from pd.transfer.messages import (
    Abort,
    Auth,
    Challenge,
    Heartbeat,
    HeartbeatAck,
    Hello,
    Message,
    Refused,
    Welcome,
    decode,
    encode,
    unb64,
)
from pd.transfer.pools import PoolDesc

log = logging.getLogger(__name__)


class LinkClient(Protocol):
    """What a link tells a transfer attached to it."""

    def on_attached(self) -> None: ...
    def on_unknown(self) -> None: ...
    def on_remote_abort(self, reason: str) -> None: ...
    def on_peer_lost(self, reason: str) -> None:
        """The link is lost (called by the manager as it drops the link)."""


class PeerLink:
    def __init__(
        self,
        *,
        ctx: zmq.asyncio.Context,
        host: str,
        port: int,
        my_engine_id: str,
        token: bytes,
        heartbeat_interval_s: float,
        heartbeat_misses: int,
        idle_timeout_s: float,
        on_lost: Callable[[PeerLink, str], None],
        wire_tap: Callable[[bytes], None] | None = None,
    ) -> None:
        self.host, self.port = host, port
        self._ctx, self._my_engine, self._token = ctx, my_engine_id, token
        self._interval, self._misses = heartbeat_interval_s, heartbeat_misses
        self._idle_timeout_s = idle_timeout_s
        self._on_lost, self._wire_tap = on_lost, wire_tap
        self.engine_id = ""  # P's, known after the handshake
        self.agent = ""  # backend agent name of P, set by the manager after add_peer
        self.backend = ""
        self.agent_metadata = b""
        self.pools: dict[str, PoolDesc] = {}
        self.contract: dict[str, str] | None = None  # P's pairing contract, from its Welcome
        self.runtime: dict[str, str] = {}  # P's runtime format (reported, never compared)
        self.clients: dict[str, LinkClient] = {}  # transfer id -> attached transfer
        self.alive = False
        self._key = b""
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._sends: set[asyncio.Future] = set()
        self._wake = asyncio.Event()
        self._seq = 0
        self._probing = False  # heartbeating without clients, after a transport error
        self._last_ack = 0.0

    # -- handshake -------------------------------------------------------------------------

    async def handshake(self, timeout_s: float) -> None:
        """Authenticate both ways and fetch P's metadata; raises AuthError or HandshakeError."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, secrets.token_bytes(16))
        sock.setsockopt(zmq.MAXMSGSIZE, 16 << 20)
        sock.connect(f"tcp://{self.host}:{self.port}")
        self._sock = sock
        try:
            async with asyncio_timeout(timeout_s):
                await self._handshake(sock)
        except TimeoutError:
            self._close_socket()
            raise HandshakeError(
                f"handshake with {self.host}:{self.port} timed out after {timeout_s}s"
            ) from None
        except (AuthError, HandshakeError, ProtocolError):
            self._close_socket()
            raise
        self.alive = True

    async def _handshake(self, sock: zmq.asyncio.Socket) -> None:
        d_nonce = auth.new_nonce()
        await self._send_raw([encode(Hello(self._my_engine, d_nonce.hex()))])
        msg = await self._recv_handshake(sock)
        if not isinstance(msg, Challenge):
            raise HandshakeError(f"expected challenge, got {msg.TYPE}")
        p_nonce = bytes.fromhex(msg.nonce)
        want = auth.prefill_proof(self._token, d_nonce, p_nonce, msg.engine_id, self._my_engine)
        if not auth.verify(want, bytes.fromhex(msg.proof)):
            await self._send_raw([encode(Refused("authentication failed"))])
            raise AuthError(
                f"peer {self.host}:{self.port} failed authentication (wrong cluster token?)"
            )
        proof = auth.decode_proof(self._token, d_nonce, p_nonce, msg.engine_id, self._my_engine)
        await self._send_raw([encode(Auth(proof.hex()))])
        key = auth.session_key(self._token, d_nonce, p_nonce)
        frames = await sock.recv_multipart()
        welcome = decode(frames[0])
        if isinstance(welcome, Refused):
            raise AuthError(f"refused by {self.host}:{self.port}: {welcome.reason}")
        if not isinstance(welcome, Welcome) or len(frames) != 2:
            raise HandshakeError("expected welcome")
        if (
            not auth.verify(auth.tag(key, frames[0]), frames[1])
            or welcome.engine_id != msg.engine_id
        ):
            raise AuthError("welcome not from the authenticated peer")
        self._key, self.engine_id, self.backend = key, welcome.engine_id, welcome.backend
        self.agent_metadata = unb64(welcome.agent_metadata)
        self.pools = {p["name"]: PoolDesc.from_dict(p) for p in welcome.pools}
        self.contract = welcome.contract if isinstance(welcome.contract, dict) else None
        self.runtime = welcome.runtime if isinstance(welcome.runtime, dict) else {}
        self._idle_timeout_s = min(self._idle_timeout_s, welcome.session_timeout_s / 2)

    async def _recv_handshake(self, sock: zmq.asyncio.Socket) -> Message:
        msg = decode((await sock.recv_multipart())[0])
        if isinstance(msg, Refused):
            raise AuthError(f"refused by {self.host}:{self.port}: {msg.reason}")
        return msg

    async def refuse(self, reason: str) -> None:
        """After a complete handshake, refuse the session (P drops it at once and logs why), and
        close. The Refused frame is given a moment to leave before the socket goes."""
        if self._sock is not None:
            try:
                await self._send_raw([encode(Refused(reason))])
            except zmq.ZMQError:
                pass
        self.alive = False
        self._close_socket(linger_ms=1000)

    # -- session ---------------------------------------------------------------------------

    def start(self) -> None:
        self._last_ack = time.monotonic()
        self._tasks = [
            asyncio.create_task(self._recv_loop(), name=f"peer-recv:{self.port}"),
            asyncio.create_task(self._heartbeat_loop(), name=f"peer-hb:{self.port}"),
        ]

    def attach(self, transfer_id: str, client: LinkClient) -> None:
        self.clients[transfer_id] = client
        self._wake.set()  # renew at once: this also confirms P still holds the transfer

    def suspect(self) -> None:
        """A transport error was seen: heartbeat until P answers, or declare it lost."""
        if self.alive and not self._probing:
            self._probing = True
            self._wake.set()

    def detach(self, transfer_id: str) -> None:
        self.clients.pop(transfer_id, None)

    def send(self, msg: Message) -> None:
        """Send a session message (done, abort) without waiting; no-op on a dead link."""
        if self.alive and self._sock is not None:
            payload = encode(msg)
            task = asyncio.ensure_future(self._send_raw([payload, auth.tag(self._key, payload)]))
            self._sends.add(task)
            task.add_done_callback(self._sends.discard)

    async def _send_raw(self, frames: list[bytes]) -> None:
        if self._wire_tap:
            for f in frames:
                self._wire_tap(f)
        assert self._sock is not None
        await self._sock.send_multipart(frames)

    async def _recv_loop(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart()
            try:
                msg = decode(frames[0])
            except ProtocolError as e:
                log.info("peer %s:%s: malformed message: %s", self.host, self.port, e)
                continue
            if isinstance(msg, Refused):
                return self._lose(
                    f"prefill {self.host}:{self.port} dropped the session: {msg.reason}"
                )
            if len(frames) != 2 or not auth.verify(auth.tag(self._key, frames[0]), frames[1]):
                log.warning("peer %s:%s: message with a bad tag dropped", self.host, self.port)
                continue
            if isinstance(msg, HeartbeatAck):
                if msg.engine_id != self.engine_id:
                    return self._lose(
                        f"prefill {self.host}:{self.port} restarted (engine id changed)"
                    )
                self._last_ack = time.monotonic()
                self._probing = False
                for tid in msg.known:
                    if (c := self.clients.get(tid)) is not None:
                        c.on_attached()
                for tid in msg.unknown:
                    if (c := self.clients.get(tid)) is not None:
                        c.on_unknown()
            elif isinstance(msg, Abort):
                if (c := self.clients.get(msg.transfer_id)) is not None:
                    c.on_remote_abort(msg.reason)

    async def _heartbeat_loop(self) -> None:
        while True:
            if (
                not self.clients and not self._probing
            ):  # idle: sleep until a transfer attaches or the link expires
                self._wake.clear()
                try:
                    async with asyncio_timeout(self._idle_timeout_s):
                        await self._wake.wait()
                except TimeoutError:
                    return self._lose("idle", idle=True)
                self._last_ack = time.monotonic()
                continue
            self._seq += 1
            payload = encode(Heartbeat(self._seq, list(self.clients)))
            await self._send_raw([payload, auth.tag(self._key, payload)])
            self._wake.clear()
            try:
                async with asyncio_timeout(self._interval):
                    await self._wake.wait()
            except TimeoutError:
                pass
            silent = time.monotonic() - self._last_ack
            if silent > self._interval * self._misses:
                return self._lose(
                    f"prefill {self.host}:{self.port} missed heartbeats for {silent:.1f}s"
                )

    def _lose(self, reason: str, idle: bool = False) -> None:
        if not self.alive:
            return
        self.alive = False
        if not idle:
            log.warning("peer lost: %s", reason)
        self._on_lost(self, reason)

    def _close_socket(self, linger_ms: int = 0) -> None:
        if self._sock is not None:
            self._sock.close(linger=linger_ms)
            self._sock = None

    async def close(self) -> None:
        """Stop the tasks and close the socket; the manager has already failed the transfers."""
        self.alive = False
        current = asyncio.current_task()
        for t in self._tasks:
            if t is not current:
                t.cancel()
        await asyncio.gather(*(t for t in self._tasks if t is not current), return_exceptions=True)
        self._tasks.clear()
        self.clients.clear()
        self._close_socket()
