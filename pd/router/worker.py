"""One upstream worker as the router sees it: its URL, health, and the load on it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pd.protocol import WorkerLoad


class Worker:
    """A worker of one pool. Policies read `inflight`, `inflight_tokens`, `load` and `healthy`.

    NOTE: `inflight`/`inflight_tokens` count the router's own requests on the worker; they are
    raised when a policy picks the worker and lowered in a `finally` (finish, error or cancel).
    """

    __slots__ = (
        "url",
        "role",
        "healthy",
        "checked",
        "inflight",
        "inflight_tokens",
        "load",
        "model",
        "runtime_format",
        "instance",
        "fails",
        "oks",
        "ready",
        "not_ready",
        "last_error",
        "ejections",
        "cancels",
    )

    def __init__(self, url: str, role: str) -> None:
        self.url = url
        self.role = role  # "prefill" | "decode" | "both"
        self.healthy = False  # admitted on its first good health check
        # Whether it takes new requests (its /health `ready`: not while it drains, or while it
        # could admit nothing for a while); not ready is not ejected: its streams go on.
        self.ready = True
        self.not_ready: str | None = None  # why not, as it said
        self.checked = False  # False until the first health check answered
        self.inflight = 0  # router requests on this worker now
        self.inflight_tokens = 0  # their estimated uncached prompt tokens (prefill-side cost)
        self.load: WorkerLoad | None = None  # as last reported in /health
        self.model: str | None = None
        # How it computes, from /health (pairing.py): a P and a D pair only when equal
        self.runtime_format: dict[str, str] | None = None
        self.instance: str | None = None  # changes when the worker restarts
        self.fails = 0  # consecutive failed checks
        self.oks = 0  # consecutive good checks
        self.last_error: str | None = None
        self.ejections = 0
        # What ends this worker's in-flight requests when it is ejected (one per request).
        self.cancels: set[Callable[[], None]] = set()

    def acquire(self, tokens: int) -> None:
        self.inflight += 1
        self.inflight_tokens += tokens

    def release(self, tokens: int) -> None:
        self.inflight -= 1
        self.inflight_tokens -= tokens
        assert self.inflight >= 0, f"in-flight count of {self.url} went negative"

    def fail_inflight(self) -> None:
        """Ejected: end every request in flight on it now, not when its timeout runs out."""
        cancels, self.cancels = self.cancels, set()
        for cancel in cancels:
            cancel()

    def to_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "role": self.role,
            "healthy": self.healthy,
            "inflight": self.inflight,
            "model": self.model,
            "runtime_format": self.runtime_format,
            "load": self.load.to_dict() if self.load else None,
            "last_error": self.last_error,
            "ejections": self.ejections,
        }

    def __repr__(self) -> str:
        return (
            f"Worker({self.url!r}, {self.role}, healthy={self.healthy}, inflight={self.inflight})"
        )
