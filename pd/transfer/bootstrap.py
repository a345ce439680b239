"""The prefill side's rendezvous endpoint: a ZMQ ROUTER socket on asyncio.

It runs the P half of the handshake (challenge-response, then agent metadata and pool
descriptors), keeps one session per authenticated decode peer, and hands session messages
(heartbeat/lease renewal, done, abort) to the manager. Nothing is kept about a peer that failed
the handshake; half-open handshakes and silent sessions are dropped after their deadlines.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

import pd.transfer.auth as auth
from pd.transfer.base import KVBootstrapServer
from pd.transfer.errors import ProtocolError
from pd.transfer.messages import Auth, Challenge, Hello, Message, Refused, Welcome, decode, encode
from pd.transfer.session import Session

log = logging.getLogger(__name__)
WireTap = Callable[[bytes], None]  # sees every frame sent, for tests
MAX_PENDING = 1024


@dataclass
class _Pending:
    d_engine: str
    d_nonce: bytes
    p_nonce: bytes
    started: float


SessionHandler = Callable[[Session, Message], Message | None]


class BootstrapServer(KVBootstrapServer):
    def __init__(
        self,
        *,
        ctx: zmq.asyncio.Context,
        host: str,
        port: int,
        engine_id: str,
        token: bytes,
        welcome: Callable[[], Welcome],
        on_message: SessionHandler,
        handshake_timeout_s: float,
        session_timeout_s: float,
        wire_tap: WireTap | None = None,
    ) -> None:
        self._ctx, self._host, self._want_port = ctx, host, port
        self._engine_id, self._token = engine_id, token
        self._welcome, self._on_message = welcome, on_message
        self._handshake_timeout_s, self._session_timeout_s = handshake_timeout_s, session_timeout_s
        self._wire_tap = wire_tap
        self.pending: dict[bytes, _Pending] = {}
        self.sessions: dict[bytes, Session] = {}
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task | None = None
        self._sweep_timer: asyncio.TimerHandle | None = None
        self._port = 0

    @property
    def port(self) -> int:
        return self._port

    async def start(self) -> int:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting peer keeps its identity
        sock.setsockopt(zmq.MAXMSGSIZE, 16 << 20)
        if self._want_port:
            sock.bind(f"tcp://{self._host}:{self._want_port}")
        else:
            sock.bind_to_random_port(f"tcp://{self._host}")
        endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._port = int(endpoint.rsplit(":", 1)[1])
        self._sock = sock
        self._task = asyncio.create_task(self._serve(), name=f"bootstrap:{self._port}")
        return self._port

    async def close(self) -> None:
        if self._sweep_timer:
            self._sweep_timer.cancel()
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._sock is not None:
            self._sock.close(linger=0)
        self.pending.clear()
        self.sessions.clear()

    # -- sending ---------------------------------------------------------------------------

    async def _send(self, identity: bytes, msg: Message, key: bytes | None) -> None:
        payload = encode(msg)
        frames = [identity, payload] if key is None else [identity, payload, auth.tag(key, payload)]
        if self._wire_tap:
            for f in frames[1:]:
                self._wire_tap(f)
        assert self._sock is not None
        await self._sock.send_multipart(frames)

    async def send_session(self, session: Session, msg: Message) -> None:
        """Send a session message (e.g. an abort) to a decode peer."""
        if self.sessions.get(session.identity) is session:
            await self._send(session.identity, msg, session.key)

    # -- receiving -------------------------------------------------------------------------

    async def _serve(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart()
            try:
                await self._dispatch(frames)
            except ProtocolError as e:
                log.info("bootstrap: dropping malformed message: %s", e)
            except Exception:
                log.exception("bootstrap: error handling a message")

    async def _dispatch(self, frames: list[bytes]) -> None:
        if len(frames) not in (2, 3):
            raise ProtocolError(f"{len(frames)} frames")
        identity, payload = frames[0], frames[1]
        now = time.monotonic()
        if len(frames) == 2:  # handshake messages carry no tag
            msg = decode(payload)
            if isinstance(msg, Hello):
                await self._on_hello(identity, msg, now)
            elif isinstance(msg, Auth):
                await self._on_auth(identity, msg)
            elif isinstance(msg, Refused):
                self.pending.pop(identity, None)
                session = self.sessions.pop(identity, None)
                if session is not None:  # D refused the Welcome (e.g. the contracts differ)
                    log.warning(
                        "bootstrap: decode peer %s refused the session: %s",
                        session.d_engine,
                        str(msg.reason)[:2000],
                    )
            else:
                await self._send(identity, Refused("no session"), None)
            return
        session = self.sessions.get(identity)
        if session is None:
            await self._send(identity, Refused("no session"), None)
            return
        if not auth.verify(auth.tag(session.key, payload), frames[2]):
            log.warning("bootstrap: bad tag from %s, message dropped", session.d_engine)
            return
        session.last_seen = now
        reply = self._on_message(session, decode(payload))
        if reply is not None:
            await self._send(identity, reply, session.key)

    async def _on_hello(self, identity: bytes, msg: Hello, now: float) -> None:
        self.sessions.pop(identity, None)
        try:
            d_nonce = bytes.fromhex(msg.nonce)
        except ValueError:
            raise ProtocolError("bad nonce") from None
        if len(d_nonce) != auth.NONCE_BYTES:
            raise ProtocolError("bad nonce length")
        if len(self.pending) >= MAX_PENDING and identity not in self.pending:
            await self._send(identity, Refused("busy"), None)
            return
        p_nonce = auth.new_nonce()
        self.pending[identity] = _Pending(msg.engine_id, d_nonce, p_nonce, now)
        self._arm_sweep(self._handshake_timeout_s)
        proof = auth.prefill_proof(self._token, d_nonce, p_nonce, self._engine_id, msg.engine_id)
        await self._send(identity, Challenge(self._engine_id, p_nonce.hex(), proof.hex()), None)

    async def _on_auth(self, identity: bytes, msg: Auth) -> None:
        p = self.pending.pop(identity, None)
        if p is None:
            await self._send(identity, Refused("no handshake in progress"), None)
            return
        want = auth.decode_proof(self._token, p.d_nonce, p.p_nonce, self._engine_id, p.d_engine)
        try:
            got = bytes.fromhex(msg.proof)
        except ValueError:
            got = b""
        if not auth.verify(want, got):
            log.warning("bootstrap: peer %r failed authentication", p.d_engine)
            await self._send(identity, Refused("authentication failed"), None)
            return
        key = auth.session_key(self._token, p.d_nonce, p.p_nonce)
        session = Session(identity, p.d_engine, key, time.monotonic())
        self.sessions[identity] = session
        self._arm_sweep(self._session_timeout_s)
        await self._send(identity, self._welcome(), key)

    # -- deadlines -------------------------------------------------------------------------

    def _arm_sweep(self, delay: float) -> None:
        if self._sweep_timer is None:
            self._sweep_timer = asyncio.get_running_loop().call_later(delay, self._sweep)

    def _sweep(self) -> None:
        self._sweep_timer = None
        now = time.monotonic()
        for ident in [
            i for i, p in self.pending.items() if now - p.started > self._handshake_timeout_s
        ]:
            del self.pending[ident]
        for ident in [
            i for i, s in self.sessions.items() if now - s.last_seen > self._session_timeout_s
        ]:
            log.info("bootstrap: session of %s timed out", self.sessions[ident].d_engine)
            del self.sessions[ident]
        if self.pending or self.sessions:
            self._arm_sweep(min(self._handshake_timeout_s, self._session_timeout_s) / 2)
