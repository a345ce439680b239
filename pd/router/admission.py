"""Admission by priority class: who gets one of the router's `--max-concurrency` slots, who
waits, who is refused (issue 45; docs/api.md has the table).

Four classes, highest first: system, interactive, default, batch. A request's class comes from
an `X-Priority-Class` header, else from vLLM's integer `priority` (lower first):

    priority <= -2: system    -1: interactive    0 (the default): default    >= 1: batch

A class may have slots of its own (`reserved`: only it takes them); the rest of the budget is
shared. A request that finds no slot waits in its class's queue, bounded (`queue`: beyond it, 429
with `Retry-After`) and for at most its class's `deadline_s` (then 408). A freed slot goes to the
highest class waiting, first come first served within it. A request that must wait may preempt
one of a lower class that has not sent its client a byte yet (its client gets a 503 and may
retry): at most as many preemptions on their way as there are requests waiting for them.

`enabled=False` (`--no-priority`): one first-come-first-served queue, no reserved slots, no
preemption; requests are still counted under their class. A budget of 0 admits everything.

Pure asyncio: no aiohttp, no sockets (the router's app.py puts it at its edge)."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from pd.protocol import APIError

CLASSES = ("system", "interactive", "default", "batch")  # highest first
RANK = {c: i for i, c in enumerate(CLASSES)}
OUTCOMES = ("admitted", "queued", "refused", "timed_out", "preempted")
PRIORITY_OF_CLASS = {"system": -2, "interactive": -1, "default": 0, "batch": 1}
CLASS_HEADER = "X-Priority-Class"
RETRY_AFTER_S = 1  # what a refused or preempted client is told to wait

T = TypeVar("T")


def class_of_priority(priority: int) -> str:
    """vLLM's `priority` (lower first) as a class: the table above."""
    if priority <= -2:
        return "system"
    if priority == -1:
        return "interactive"
    return "default" if priority == 0 else "batch"


@dataclass(frozen=True)
class ClassLimits:
    reserved: int = 0  # slots only this class takes
    queue: int = 64  # requests that may wait at once (429 beyond)
    deadline_s: float = 30.0  # the longest wait (408 beyond)


DEFAULT_LIMITS = {
    "system": ClassLimits(reserved=1, queue=64, deadline_s=30.0),
    "interactive": ClassLimits(queue=64, deadline_s=10.0),
    "default": ClassLimits(queue=128, deadline_s=30.0),
    "batch": ClassLimits(queue=512, deadline_s=300.0),
}


class Ticket:
    """One admitted request: its class, its slot, and whether it may still be preempted."""

    __slots__ = ("cls", "queue", "slot", "sent", "preempted", "preemptible", "task", "admitted_at")

    def __init__(self, cls: str, queue: str) -> None:
        self.cls = cls  # the class it named (metrics)
        self.queue = queue  # the class it is admitted as ("default" for all with --no-priority)
        self.slot = ""  # "reserved", "shared" or "free" (no budget); "" until admitted
        self.sent = False  # its first byte went to the client: never preempted after
        self.preempted = False
        self.preemptible = False  # a shared slot below system, classes on: its work is a task
        self.task: asyncio.Future[Any] | None = None  # the work, cancelled by a preemption
        self.admitted_at = 0.0

    async def run(self, work: Awaitable[T]) -> T:
        """Await `work` as this ticket's: a preemption cancels it and answers 503."""
        if not self.preemptible:
            return await work
        self.task = asyncio.ensure_future(work)
        try:
            return await self.task
        except asyncio.CancelledError:
            if self.preempted and self.task.cancelled():
                raise APIError(
                    503,
                    f"preempted by a request of a higher priority class before its first byte "
                    f"(class {self.cls}); retry",
                    "server_error",
                    "preempted",
                    headers={"Retry-After": str(RETRY_AFTER_S)},
                ) from None
            raise


class _Waiter:
    __slots__ = ("ticket", "future")

    def __init__(self, ticket: Ticket, future: asyncio.Future[None]) -> None:
        self.ticket = ticket
        self.future = future


class Admission:
    def __init__(
        self,
        budget: int,
        limits: Mapping[str, ClassLimits] | None = None,
        enabled: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        limits = {**DEFAULT_LIMITS, **(limits or {})}
        unknown = sorted(set(limits) - set(CLASSES))
        if unknown:
            raise ValueError(f"unknown priority classes {unknown}; they are {', '.join(CLASSES)}")
        self.budget = budget
        self.enabled = enabled
        self.clock = clock
        self.limits = limits
        reserved = {c: (limits[c].reserved if enabled and budget else 0) for c in CLASSES}
        if budget and sum(reserved.values()) > budget:
            raise ValueError(
                f"the reserved slots ({sum(reserved.values())}) exceed the budget ({budget})"
            )
        self.reserved = reserved
        self.shared = budget - sum(reserved.values())
        self.reserved_used = dict.fromkeys(CLASSES, 0)
        self.shared_used = 0
        self.inflight = dict.fromkeys(CLASSES, 0)  # by the class each named
        self.queues: dict[str, deque[_Waiter]] = {c: deque() for c in CLASSES}
        self.queued = dict.fromkeys(CLASSES, 0)  # by the class each named
        self.preemptible: list[Ticket] = []  # admitted, shared slot, lower than system
        self.preempting = 0  # preempted tickets that have not left yet
        self.counts = {(c, o): 0 for c in CLASSES for o in OUTCOMES}

    # ------------------------------------------------------------------ the request's side

    def class_of(self, header: str | None, priority: int | None) -> str:
        """The class a request names: its header's, else its `priority`'s (400 for a header
        that names none, or one that disagrees with the priority)."""
        if header is None:
            return "default" if priority is None else class_of_priority(priority)
        cls = header.strip().lower()
        if cls not in RANK:
            raise APIError(
                400,
                f"{CLASS_HEADER} must be one of {', '.join(CLASSES)}, not {header[:40]!r}",
                "invalid_request_error",
                "invalid_priority_class",
            )
        if priority is not None and class_of_priority(priority) != cls:
            raise APIError(
                400,
                f"{CLASS_HEADER} {cls} disagrees with priority {priority} (class "
                f"{class_of_priority(priority)}): send one, or both alike",
                "invalid_request_error",
                "invalid_priority_class",
            )
        return cls

    async def enter(self, cls: str) -> Ticket:
        """A slot for a request of class `cls`, at once or after a wait; APIError 429 (its
        queue is full) or 408 (it waited past its class's deadline)."""
        ticket = Ticket(cls, cls if self.enabled else "default")
        if self._take(ticket):
            self.counts[(cls, "admitted")] += 1
            return ticket
        q = ticket.queue
        limits = self.limits[q]
        if len(self.queues[q]) >= limits.queue:
            self.counts[(cls, "refused")] += 1
            raise APIError(
                429,
                f"the router is at its concurrency budget and the {q} queue is full "
                f"({limits.queue} waiting); retry later",
                "rate_limit_error",
                "queue_full",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        waiter = _Waiter(ticket, asyncio.get_running_loop().create_future())
        self.queues[q].append(waiter)
        self.queued[cls] += 1
        self.counts[(cls, "queued")] += 1
        if self.enabled:
            self._preempt_for(q)
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), limits.deadline_s)
        except (TimeoutError, asyncio.TimeoutError, asyncio.CancelledError) as e:
            if waiter.future.done() and not waiter.future.cancelled():
                self.leave(ticket)  # granted just as it gave up: the slot goes on
            else:
                waiter.future.cancel()
                self.queues[q].remove(waiter)
            if isinstance(e, asyncio.CancelledError):
                raise
            self.counts[(cls, "timed_out")] += 1
            raise APIError(
                408,
                f"waited {limits.deadline_s:g} s for a slot (the {q} class's deadline)",
                "timeout_error",
                "queue_timeout",
            ) from None
        finally:
            self.queued[cls] -= 1
        self.counts[(cls, "admitted")] += 1
        return ticket

    def leave(self, ticket: Ticket) -> None:
        """The request is done (answered, failed, preempted or gone): its slot goes on."""
        if not ticket.slot:
            return
        if ticket.slot == "reserved":
            self.reserved_used[ticket.queue] -= 1
        elif ticket.slot == "shared":
            self.shared_used -= 1
            if ticket in self.preemptible:
                self.preemptible.remove(ticket)
        if ticket.preempted:
            self.preempting -= 1
        self.inflight[ticket.cls] -= 1
        ticket.slot = ""
        self._dispatch()

    @staticmethod
    def sent(ticket: Ticket) -> None:
        """Its first byte is going to the client: it is never preempted now."""
        ticket.sent = True

    # ------------------------------------------------------------------ slots

    def _take(self, ticket: Ticket) -> bool:
        q = ticket.queue
        if not self.budget:
            ticket.slot = "free"
        elif self.reserved_used[q] < self.reserved[q]:
            self.reserved_used[q] += 1
            ticket.slot = "reserved"
        elif self.shared_used < self.shared:
            self.shared_used += 1
            ticket.slot = "shared"
            if self.enabled and RANK[q] > 0:
                ticket.preemptible = True
                self.preemptible.append(ticket)
        else:
            return False
        ticket.admitted_at = self.clock()
        self.inflight[ticket.cls] += 1
        return True

    def _dispatch(self) -> None:
        """Freed slots to the waiters: highest class first, in arrival order within one."""
        for q in CLASSES:
            queue = self.queues[q]
            while queue:
                waiter = queue[0]
                if waiter.future.done():  # gave up already
                    queue.popleft()
                    continue
                if not self._take(waiter.ticket):
                    break
                queue.popleft()
                waiter.future.set_result(None)

    def _preempt_for(self, q: str) -> None:
        """Preempt the newest admitted request of the lowest class below `q` that has sent
        nothing yet, unless enough preemptions are on their way for the requests waiting."""
        waiting = sum(len(self.queues[c]) for c in CLASSES[: RANK[q] + 1])
        if self.preempting >= waiting:
            return
        victims = [t for t in self.preemptible if RANK[t.queue] > RANK[q] and not t.sent]
        victims = [t for t in victims if not t.preempted and t.task is not None]
        if not victims:
            return
        victim = max(victims, key=lambda t: (RANK[t.queue], t.admitted_at))
        victim.preempted = True
        self.preempting += 1
        self.counts[(victim.cls, "preempted")] += 1
        assert victim.task is not None
        victim.task.cancel()
