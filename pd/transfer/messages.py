"""Bootstrap messages: typed, versioned dataclasses with one encode/decode, shared by both ends.

Wire format: one JSON object (orjson) `{"v": PROTOCOL_VERSION, "t": <type>, ...fields}` per ZMQ
frame; bytes travel base64-encoded. After the handshake every message is followed by a second
frame, an HMAC tag under the session key (see auth.py).

Handshake (D dials P):   D Hello -> P Challenge -> D Auth -> P Welcome   (or Refused at any step;
                         D refuses a Welcome whose pairing contract differs from its own)
Session (D -> P):        Heartbeat (renews leases), Done, Abort
Session (P -> D):        HeartbeatAck, Abort
"""

from __future__ import annotations

import base64
import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import orjson

from pd.transfer.errors import ProtocolError

PROTOCOL_VERSION = 1


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text.encode(), validate=True)


@dataclass(frozen=True)
class Hello:
    """D -> P: opens a handshake with D's challenge nonce."""

    TYPE: ClassVar[str] = "hello"
    engine_id: str
    nonce: str  # hex


@dataclass(frozen=True)
class Challenge:
    """P -> D: P's proof over D's nonce, and P's own nonce for D to answer."""

    TYPE: ClassVar[str] = "challenge"
    engine_id: str
    nonce: str  # hex
    proof: str  # hex HMAC, see auth.prefill_proof


@dataclass(frozen=True)
class Auth:
    """D -> P: D's proof over P's nonce (sent only after D verified P's proof)."""

    TYPE: ClassVar[str] = "auth"
    proof: str


@dataclass(frozen=True)
class Welcome:
    """P -> D: what D needs to read from P."""

    TYPE: ClassVar[str] = "welcome"
    engine_id: str
    backend: str
    agent_metadata: str  # base64
    pools: list[dict[str, Any]]  # PoolDesc.to_dict()
    session_timeout_s: float  # P drops a session silent for longer; D closes idle links before
    # P's pairing contract (D refuses a P whose contract differs from its own; None: P has none)
    # and runtime format (only reported): TransferConfig.contract and .runtime.
    contract: dict[str, str] | None = None
    runtime: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Refused:
    """Either way: the handshake or session is refused; the receiver drops the peer."""

    TYPE: ClassVar[str] = "refused"
    reason: str


@dataclass(frozen=True)
class Heartbeat:
    """D -> P: liveness, and renewal of the leases of `renew` (transfer ids)."""

    TYPE: ClassVar[str] = "heartbeat"
    seq: int
    renew: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class HeartbeatAck:
    """P -> D: which of the renewed transfer ids P holds, and P's engine id (restart detection)."""

    TYPE: ClassVar[str] = "heartbeat_ack"
    seq: int
    engine_id: str
    known: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Done:
    """D -> P: the pages of `transfer_id` have been read; P may free them."""

    TYPE: ClassVar[str] = "done"
    transfer_id: str


@dataclass(frozen=True)
class Abort:
    """Either way: the transfer is abandoned."""

    TYPE: ClassVar[str] = "abort"
    transfer_id: str
    reason: str


Message = Hello | Challenge | Auth | Welcome | Refused | Heartbeat | HeartbeatAck | Done | Abort
_TYPES: dict[str, type[Message]] = {
    c.TYPE: c
    for c in (Hello, Challenge, Auth, Welcome, Refused, Heartbeat, HeartbeatAck, Done, Abort)
}
MAX_MESSAGE_BYTES = 16 << 20


def encode(msg: Message) -> bytes:
    return orjson.dumps({"v": PROTOCOL_VERSION, "t": msg.TYPE, **dataclasses.asdict(msg)})


def decode(data: bytes) -> Message:
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes is too large")
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise ProtocolError(f"malformed message: {e}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("message is not an object")
    if obj.pop("v", None) != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version (want {PROTOCOL_VERSION})")
    cls = _TYPES.get(obj.pop("t", None))
    if cls is None:
        raise ProtocolError("unknown message type")
    try:
        return cls(**obj)
    except TypeError as e:
        raise ProtocolError(f"bad fields for {cls.TYPE}: {e}") from None
