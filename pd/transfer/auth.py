"""Cluster-token challenge-response. The token never crosses the wire: each side proves it holds
the token with an HMAC over the other side's fresh nonce, bound to both engine ids and a role label
(so a proof cannot be reflected back). D verifies P's proof before it answers P's challenge, so a
forged P learns no proof of D's. After the handshake, messages carry a tag under a session key
derived from the token and both nonces.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

from pd.transfer.errors import AuthError

TOKEN_ENV = "PD_CLUSTER_TOKEN"
NONCE_BYTES = 32
TAG_BYTES = 16
_LABEL = b"pd-transfer-bootstrap-v1"


def resolve_token(token: str | None) -> bytes:
    """The cluster token from the argument (`--cluster-token`) or the environment; required."""
    value = token if token is not None else os.environ.get(TOKEN_ENV)
    if not value:
        raise AuthError(f"no cluster token: pass cluster_token or set {TOKEN_ENV}")
    return value.encode()


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def _mac(token: bytes, *parts: bytes) -> bytes:
    h = hmac.new(token, _LABEL, hashlib.sha256)
    for p in parts:
        h.update(len(p).to_bytes(4, "big") + p)
    return h.digest()


def prefill_proof(
    token: bytes, d_nonce: bytes, p_nonce: bytes, p_engine: str, d_engine: str
) -> bytes:
    return _mac(token, b"P", d_nonce, p_nonce, p_engine.encode(), d_engine.encode())


def decode_proof(
    token: bytes, d_nonce: bytes, p_nonce: bytes, p_engine: str, d_engine: str
) -> bytes:
    return _mac(token, b"D", p_nonce, d_nonce, d_engine.encode(), p_engine.encode())


def session_key(token: bytes, d_nonce: bytes, p_nonce: bytes) -> bytes:
    return _mac(token, b"session", d_nonce, p_nonce)


def tag(key: bytes, payload: bytes) -> bytes:
    return hmac.new(key, payload, hashlib.sha256).digest()[:TAG_BYTES]


def verify(expected: bytes, got: bytes) -> bool:
    return hmac.compare_digest(expected, got)
