"""Signatures of pd's internal request fields, shared by router and workers.

Two fields of a request body are pd's own, never a client's: `kv_transfer_params` as D receives
them (P's pages, prompt and first tokens) and `pd_continuation` (the output a migrated stream had
produced; docs/migration.md §3). Whoever could set them freely could have D pull pages it was not
given or have a worker prefill text that is never billed as prompt. So each carries `pd_sig`, an
HMAC-SHA256 under the cluster token (`--cluster-token` or `PD_CLUSTER_TOKEN`):

- P signs the `kv_transfer_params` it answers (every field but the signature); D checks that
  signature whoever carried the params, the router or a client of P.
- The router signs each `pd_continuation` it sends, bound to the request's prompt (`prompt` or
  `messages`), so a signed continuation cannot be moved onto another prompt.

A worker accepts either field when its signature checks out under its own token. An unsigned one
is accepted only from a loopback peer, so that a one-host stack whose router has no token works
unchanged; from another host it is a 403 that names `--cluster-token`. A wrong signature is a 403
from anywhere. Router and worker say at start-up which of these holds (`Guard.describe`).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from typing import Any

import orjson

from pd.protocol import APIError
from pd.protocol.names import CONTINUATION, KV_PARAMS, PREFILLER, SIG

FLAG = "--cluster-token"
TOKEN_ENV = "PD_CLUSTER_TOKEN"
# Each field its own label: a signature of one kind is never valid as another.
_LABELS = {
    KV_PARAMS: b"pd-kv-params-v1",
    CONTINUATION: b"pd-continuation-v1",
    PREFILLER: b"pd-prefiller-v1",
}


def optional_token(value: str | None) -> bytes | None:
    """The cluster token from the flag's value or else the environment; None when neither."""
    token = value if value is not None else os.environ.get(TOKEN_ENV)
    return token.encode() if token else None


def canonical(value: Any) -> bytes:
    """One byte string per JSON value: keys sorted, no spaces (orjson; what both ends compute
    from the same parsed body). Raises TypeError for what JSON cannot hold."""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def sign(token: bytes, field: str, payload: Any) -> str:
    return hmac.new(token, _LABELS[field] + canonical(payload), hashlib.sha256).hexdigest()


def unsigned(value: dict[str, Any]) -> dict[str, Any]:
    """`value` without its signature: what the signature covers."""
    return {k: v for k, v in value.items() if k != SIG}


def sign_params(token: bytes, params: dict[str, Any]) -> dict[str, Any]:
    """P's `kv_transfer_params`, signed."""
    return {**params, SIG: sign(token, KV_PARAMS, unsigned(params))}


def continuation_payload(body: dict[str, Any]) -> dict[str, Any]:
    """What a continuation's signature covers: its output ids and the prompt they continue."""
    cont = body.get(CONTINUATION)
    ids = cont.get("output_token_ids") if isinstance(cont, dict) else None
    return {"output_token_ids": ids, "prompt": body.get("prompt"), "messages": body.get("messages")}


def sign_continuation(token: bytes | None, body: dict[str, Any]) -> dict[str, Any]:
    """`body` with its `pd_continuation` signed (unchanged without a token)."""
    if token is None:
        return body
    sig = sign(token, CONTINUATION, continuation_payload(body))
    return {**body, CONTINUATION: {**body[CONTINUATION], SIG: sig}}


def prefiller_payload(host_port: str, body: bytes) -> dict[str, str]:
    """What the endpoint picker signs when it names a prefill worker for D: that worker and the
    request's body (its SHA-256), so the header cannot be moved onto another request."""
    return {"prefiller": host_port, "body": hashlib.sha256(body).hexdigest()}


def check_prefiller(token: bytes | None, host_port: str, body: bytes, sig: str | None) -> bool:
    """Whether `sig` is the picker's signature of `host_port` for this `body` (never without a
    token: an unsigned header is refused from anywhere)."""
    if token is None or not sig or not sig.isascii():
        return False
    want = sign(token, PREFILLER, prefiller_payload(host_port, body))
    return hmac.compare_digest(sig.encode(), want.encode())


def is_loopback(remote: str | None) -> bool:
    """Whether a peer address (aiohttp's `request.remote`) is this host's loopback."""
    if not remote:
        return False
    try:
        ip = ipaddress.ip_address(remote.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


class Guard:
    """A worker's check of the internal fields it is sent (`token`: its cluster token)."""

    def __init__(self, token: bytes | None) -> None:
        self.token = token
        self.refused: dict[str, int] = {}  # "field:reason" -> count (metrics, tests)

    def check(self, field: str, remote: str | None, payload: Any, sig: Any) -> None:
        """Accept `payload` of `field` signed `sig`, sent by `remote`; a 403 otherwise."""
        if sig is None or self.token is None:
            if is_loopback(remote):
                return
            if sig is None:
                self._refuse(
                    field,
                    "unsigned",
                    f"'{field}' from another host must be signed with the cluster token: start "
                    f"the router and workers with the same {FLAG} (or {TOKEN_ENV})",
                )
            self._refuse(
                field,
                "no_token",
                f"'{field}' is signed but this worker has no {FLAG} (or {TOKEN_ENV}) to check it",
            )
        assert self.token is not None
        try:
            good = (
                isinstance(sig, str)
                and sig.isascii()
                and hmac.compare_digest(sig.encode(), sign(self.token, field, payload).encode())
            )
        except TypeError:  # (orjson's encode error is one) a payload JSON cannot hold
            good = False
        if not good:
            self._refuse(
                field,
                "bad_signature",
                f"'{field}' is not signed with this worker's cluster token ({FLAG})",
            )

    def _refuse(self, field: str, reason: str, message: str) -> None:
        key = f"{field}:{reason}"
        self.refused[key] = self.refused.get(key, 0) + 1
        raise APIError(403, message, "permission_error", "unsigned_internal_field", field)

    def describe(self) -> str:
        """The start-up line: what this worker accepts."""
        if self.token is None:
            return (
                f"no {FLAG}: kv_transfer_params and pd_continuation are accepted from loopback "
                "only (signed ones cannot be checked)"
            )
        return (
            "kv_transfer_params and pd_continuation: accepted when signed with the cluster "
            "token, unsigned from loopback only"
        )
