"""The small interfaces through which the PD roles (pd/worker/disagg) reach the engine.

The engine never imports the transfer layer: a role plugs in through these Protocols, built in
at start-up (pd/worker/build.py), and through `RequestHandle.on_abort` for a request's side
channel. The roles' entry points (`admit`) are in pd/worker/disagg/roles.py.
"""

from __future__ import annotations

from typing import Any, Protocol

from pd.worker.engine.request import LogprobEntry, Sequence


class HeldPages(Protocol):
    """Pages held outside the running batch, by key (the `Scheduler` implements it)."""

    def pin(self, seq: Sequence, key: str) -> list[int]:
        """Prefill: finish a prefilled request but keep its pages under `key`."""
        ...

    def reserve(self, key: str, num_pages: int, choices: int = 1) -> list[int] | None:
        """Decode: pages for a pull of `choices` choices, or None when they (or its choices'
        running slots) do not fit beside the running batch."""
        ...

    def release(self, key: str) -> None:
        """Free the pages held under `key` (idempotent)."""
        ...


class RoleHooks(Protocol):
    """What a role does at a request's end (the prefill side implements it)."""

    def hand_off(
        self,
        seq: Sequence,
        first_logprobs: LogprobEntry | None,
        choices: list[tuple[int, LogprobEntry | None]],
    ) -> dict[str, Any]:
        """A remote-decode request has its first token: keep its KV for a decode worker and
        return the `kv_transfer_params` to answer. `choices`: with n > 1, the first token (and
        logprobs) of each other choice. Raising fails the request with a 503."""
        ...


class PageWaiters(Protocol):
    """Requests waiting outside the engine for pages (the decode side's pulls,
    pd/worker/disagg/page_wait.py): told whenever pages may have come free."""

    def grant(self) -> None:
        """Pages may have come free: give them to the waiters that fit now."""
        ...

    def __len__(self) -> int:
        """How many wait (`Engine.load` reports them)."""
        ...

    @property
    def choices(self) -> int:
        """The choices of those that wait (counted against --max-waiting-requests)."""
        ...
