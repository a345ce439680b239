"""`KVPoll`, the state of one request's transfer, and the forward-only state holder."""

from __future__ import annotations

import enum


class KVPoll(enum.IntEnum):
    """Poll state of a sender or receiver; the numeric order is the order of progress.

    Failed is 0 so that the minimum over several states (several ranks, several pools) is Failed as
    soon as one of them failed.
    """

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


TERMINAL = frozenset({KVPoll.Failed, KVPoll.Success})


class PollState:
    """A KVPoll that only moves forward.

    NOTE: rules: a non-terminal state may move to any later non-terminal state or to Success; Failed
    wins from any non-terminal state; Success and Failed are final (a late error after Success is
    ignored, since the consumer may already have used the result).
    """

    __slots__ = ("_state", "reason")

    def __init__(self, initial: KVPoll = KVPoll.Bootstrapping) -> None:
        assert initial not in TERMINAL, "a poll state starts non-terminal"
        self._state = initial
        self.reason: str | None = None

    @property
    def state(self) -> KVPoll:
        return self._state

    @property
    def done(self) -> bool:
        return self._state in TERMINAL

    def advance(self, new: KVPoll) -> bool:
        """Move forward to `new` (not Failed); False when that would move backwards or is final."""
        assert new is not KVPoll.Failed, "use fail() to fail"
        if self.done or new <= self._state:
            return False
        self._state = new
        return True

    def fail(self, reason: str) -> bool:
        """Fail with a reason; False when already final."""
        if self.done:
            return False
        self._state = KVPoll.Failed
        self.reason = reason
        return True

    def __repr__(self) -> str:
        suffix = f", reason={self.reason!r}" if self.reason else ""
        return f"PollState({self._state.name}{suffix})"
