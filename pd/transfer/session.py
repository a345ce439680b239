"""A decode worker's session with a prefill worker's bootstrap server, once its handshake has
authenticated it: the ZMQ identity it speaks from, its engine id, the session key that signs
its messages, and when it was last heard from (bootstrap.py keeps them; the sender answers on
them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Session:
    identity: bytes
    d_engine: str
    key: bytes
    last_seen: float
