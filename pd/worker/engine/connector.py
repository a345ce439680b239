"""How the engine meets KV that moves between workers, in the shape of vLLM's KV connector
(`KVConnectorBase_V1`): the engine asks its connector whether a request waits for KV from
elsewhere (`waits_for_kv`), tells it when a request finished (`request_finished`: the connector
may keep the pages, its KV read elsewhere, and answers the params another worker needs) and when
pages may have come free (`pages_freed`: requests it queues for pages may fit now); the connector
tells the engine when KV arrived (`Engine.kv_arrived`). The base class is the connector of a
worker that moves no KV. The engine never imports the transfer layer: the connectors that move
KV live in pd/worker/disagg and reach the engine's pages through `LentPages`.
"""

from __future__ import annotations

from typing import Any, Protocol

from pd.worker.engine.admit_request import AdmitRequest
from pd.worker.engine.request import LogprobEntry, Sequence

FirstToken = tuple[int, LogprobEntry | None]  # a choice's first token and its logprobs


class LentPages(Protocol):
    """Pages the engine lends its connector by key, outside the running batch (the `Scheduler`
    implements it): a finished request's, whose KV another worker reads, or free ones, for KV
    another worker writes. Each is referenced once under its key until given back."""

    def lend(self, seq: Sequence, key: str) -> list[int]:
        """Finish the running request `seq` but keep its pages (cached ones too) under `key`."""
        ...

    def lend_free(self, key: str, num_pages: int, choices: int = 1) -> list[int] | None:
        """Free pages under `key` for KV that arrives for a request of `choices` choices, or None
        when they (or its choices' running slots) do not fit beside the running batch."""
        ...

    def give_back(self, key: str) -> None:
        """Free the pages lent under `key` (idempotent)."""
        ...


class KVConnector:
    """A worker's connector; this base moves no KV. `name`: the worker's role, as its load
    reports it. `lent_pages_field`: the `WorkerLoad` field that also counts the pages lent to
    it (None: only `kv_pages_held` does)."""

    name = ""
    lent_pages_field: str | None = None

    def __init__(self, name: str | None = None) -> None:
        if name is not None:
            self.name = name

    def waits_for_kv(self, request: AdmitRequest) -> bool:
        """Whether `request`'s KV comes from elsewhere: the engine then queues it for nothing,
        and the connector brings its KV (`Engine.kv_arrived`)."""
        if request.kv_from_elsewhere:
            raise ValueError(f"the {self.name} connector brings no KV from elsewhere")
        return False

    def request_finished(
        self, seq: Sequence, reasons: list[str], firsts: list[FirstToken]
    ) -> dict[str, Any] | None:
        """`seq` ended (`reasons`: its own and its other choices' finish reasons; `firsts`: each
        choice's first token). The params another worker needs when the connector kept its
        pages (`LentPages.lend`; the engine then frees nothing), else None. Raising fails the
        request with a 503."""
        return None

    def pages_freed(self) -> None:
        """Pages may have come free: requests the connector queues for pages may fit now."""

    def waiting(self) -> tuple[int, int]:
        """(requests, choices) the connector queues for pages: counted in the engine's load and
        against --max-waiting-requests."""
        return 0, 0
