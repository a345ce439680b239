"""Readiness apart from liveness: whether a worker should get new requests.

`/health` is liveness: 200 while the event loop answers, draining included (its body says
`draining`); a router ejects a worker only on a failed one. `/ready` answers 503 while the
worker drains, and once it has been unable for `HOLD_S` to admit any request (running slots or
the KV pool full, the waiting queue full, the grammar children down); 200 again once it has
been able to for `HOLD_S`, so that it does not flap under load. The router stops sending new
requests to a worker that is not ready, without ejecting it or migrating its streams.

`Readiness` is the state machine over a clock (pure, tested alone); the worker ticks it from
its app (`tick` every `TICK_S`) with the engine's `admit_blocker()`.
"""

from __future__ import annotations

HOLD_S = 2.0  # how long a change of the admission condition must hold before readiness flips
TICK_S = 0.2


class Readiness:
    def __init__(self, hold_s: float = HOLD_S, starting_until: float = 0.0) -> None:
        self.hold_s = hold_s
        # Not ready ("starting") until the clock of `update` reaches this: a simulated worker's
        # start-up (its weights read). A router never sends to a starting worker, not even as
        # its busy fallback.
        self.starting_until = starting_until
        self._starting = starting_until > 0
        self.parked = False  # a spare simulated node's worker, until activated (then starting)
        self._ready = True
        self._blocked_why: str | None = None  # the blocker while it holds
        self._since: float | None = None  # when the admission condition last changed

    def activate(self, now: float, startup_s: float) -> None:
        """A parked worker's node is wanted: its start-up begins now."""
        self.parked = False
        self.starting_until = now + startup_s
        self._starting = startup_s > 0

    def park(self) -> None:
        """A spare node's worker, drained, goes back to the pool: parked until activated."""
        self.parked = True
        self.starting_until = 0.0
        self._starting = False

    def update(self, now: float, blocker: str | None) -> None:
        """The admission condition now: None (a request could be admitted) or what blocks."""
        self._starting = now < self.starting_until
        blocked = blocker is not None
        was = self._blocked_why is not None
        if blocked != was or self._since is None:
            self._since = now
        self._blocked_why = blocker
        if blocked == self._ready and now - self._since >= self.hold_s:
            self._ready = not blocked

    def state(self, draining: bool) -> tuple[bool, str | None]:
        """(ready, why not)."""
        if draining:
            return False, "draining"
        if self.parked:
            return False, "parked"
        if self._starting:
            return False, "starting"
        if not self._ready:
            return False, f"unable to admit a request for {self.hold_s:g}s: {self._blocked_why}"
        return True, None
