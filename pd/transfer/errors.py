"""Typed errors of the transfer layer. Every failure of a request carries one of these as reason."""

from __future__ import annotations


class TransferError(Exception):
    """Base class of every error raised by pd.transfer."""


class BackendUnavailable(TransferError):
    """The requested backend cannot be used here (e.g. no NIXL package importable)."""


class PoolError(TransferError):
    """A pool descriptor is invalid, unknown, or incompatible with its peer's."""


class ProtocolError(TransferError):
    """A bootstrap message is malformed, of an unknown type or of an unsupported version."""


class AuthError(TransferError):
    """A peer failed the cluster-token challenge, or refused ours."""


class HandshakeError(TransferError):
    """The handshake with a peer failed or ran past its deadline."""


class ContractMismatch(HandshakeError):
    """The peer's pairing contract (what both sides must share: see TransferConfig.contract)
    differs from ours; the message names both sides' values."""


class PeerLostError(TransferError):
    """A peer missed its heartbeats, lost its session, or restarted (its engine id changed)."""


class TransferFailed(TransferError):
    """The data movement itself failed (transport error or deadline)."""
