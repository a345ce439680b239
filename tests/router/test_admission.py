"""Admission by priority class (pd/router/admission.py): slots, reserved slots, bounded queues
(429), deadlines (408), the order freed slots go in, preemption before the first byte (503), and
`--no-priority`'s first come, first served."""

from __future__ import annotations

import asyncio

import pytest

from pd.protocol import APIError
from pd.router.admission import Admission, ClassLimits, class_of_priority


def limits(**kw: ClassLimits) -> dict[str, ClassLimits]:
    base = {
        c: ClassLimits(queue=8, deadline_s=5.0)
        for c in ("system", "interactive", "default", "batch")
    }
    return {**base, **kw}


def test_priorities_map_to_classes_as_docs_api_says() -> None:
    assert [class_of_priority(p) for p in (-100, -2, -1, 0, 1, 7)] == [
        "system", "system", "interactive", "default", "batch", "batch",
    ]  # fmt: skip
    a = Admission(0)
    assert a.class_of(None, None) == "default"
    assert a.class_of("Interactive", None) == "interactive"
    assert a.class_of("batch", 3) == "batch"
    for header, priority in (("gold", None), ("batch", -1)):
        with pytest.raises(APIError) as e:
            a.class_of(header, priority)
        assert e.value.status == 400 and e.value.code == "invalid_priority_class"


def test_reserved_slots_need_a_budget_that_holds_them() -> None:
    with pytest.raises(ValueError, match="exceed the budget"):
        Admission(2, limits(system=ClassLimits(reserved=2), interactive=ClassLimits(reserved=1)))
    with pytest.raises(ValueError, match="unknown priority classes"):
        Admission(2, {"gold": ClassLimits()})


async def test_no_budget_admits_everything() -> None:
    a = Admission(0)
    tickets = [await a.enter("batch") for _ in range(100)]
    assert a.inflight["batch"] == 100 and a.counts[("batch", "admitted")] == 100
    for t in tickets:
        a.leave(t)
    assert a.inflight["batch"] == 0


async def test_a_reserved_slot_is_its_class_only_and_the_queue_is_bounded() -> None:
    a = Admission(2, limits(system=ClassLimits(reserved=1), default=ClassLimits(queue=1)))
    first = await a.enter("default")  # the one shared slot
    assert first.slot == "shared"
    waiting = asyncio.create_task(a.enter("default"))  # the reserved slot is not its to take
    await asyncio.sleep(0)
    assert not waiting.done() and a.queued["default"] == 1
    with pytest.raises(APIError) as e:
        await a.enter("default")  # its queue (1) is full
    assert e.value.status == 429 and e.value.headers["Retry-After"] == "1"
    system = await a.enter("system")  # at once: its own slot
    assert system.slot == "reserved"
    a.leave(first)
    second = await asyncio.wait_for(waiting, 1)
    assert second.slot == "shared"
    assert a.counts[("default", "queued")] == 1 and a.counts[("default", "refused")] == 1
    assert a.counts[("default", "admitted")] == 2 and a.counts[("system", "admitted")] == 1


async def test_a_wait_past_the_deadline_is_a_408_and_leaves_the_queue() -> None:
    a = Admission(1, limits(system=ClassLimits(reserved=0), batch=ClassLimits(deadline_s=0.05)))
    held = await a.enter("default")
    with pytest.raises(APIError) as e:
        await a.enter("batch")
    assert e.value.status == 408 and e.value.code == "queue_timeout"
    assert not a.queues["batch"] and a.queued["batch"] == 0
    assert a.counts[("batch", "timed_out")] == 1
    a.leave(held)
    assert a.shared_used == 0  # nobody took the freed slot: the timed-out waiter is gone


async def test_a_freed_slot_goes_to_the_highest_class_waiting_first_come_within() -> None:
    a = Admission(1, limits(system=ClassLimits(reserved=0)))
    held = await a.enter("default")
    held.sent = True  # not preemptible: the order of the queues alone decides
    order: list[str] = []

    async def wait(cls: str, name: str) -> None:
        t = await a.enter(cls)
        order.append(name)
        await asyncio.sleep(0.01)
        a.leave(t)

    tasks = []
    for cls, name in (
        ("batch", "b1"),
        ("interactive", "i1"),
        ("batch", "b2"),
        ("interactive", "i2"),
    ):
        tasks.append(asyncio.create_task(wait(cls, name)))
        await asyncio.sleep(0)
    a.leave(held)
    await asyncio.wait_for(asyncio.gather(*tasks), 2)
    assert order == ["i1", "i2", "b1", "b2"]


async def test_no_priority_is_first_come_first_served_and_preempts_nothing() -> None:
    a = Admission(1, limits(system=ClassLimits(reserved=1)), enabled=False)
    assert a.reserved["system"] == 0 and a.shared == 1  # no reserved slots without classes
    held = await a.enter("batch")
    work = asyncio.create_task(held.run(asyncio.sleep(10)))
    await asyncio.sleep(0)
    order: list[str] = []

    async def wait(cls: str) -> None:
        t = await a.enter(cls)
        order.append(cls)
        a.leave(t)

    tasks = []
    for cls in ("batch", "system", "interactive"):
        tasks.append(asyncio.create_task(wait(cls)))
        await asyncio.sleep(0)
    assert not work.done() and not held.preempted
    work.cancel()
    with pytest.raises(asyncio.CancelledError):
        await work
    a.leave(held)
    await asyncio.wait_for(asyncio.gather(*tasks), 2)
    assert order == ["batch", "system", "interactive"]
    assert a.counts[("system", "queued")] == 1  # counted under the class it named


async def test_a_higher_class_preempts_a_lower_one_that_has_sent_nothing() -> None:
    a = Admission(2, limits(system=ClassLimits(reserved=0)))
    batch = await a.enter("batch")
    default = await a.enter("default")
    runs = {}
    for t in (batch, default):
        runs[t.cls] = asyncio.create_task(t.run(asyncio.sleep(10)))
    await asyncio.sleep(0)
    interactive = asyncio.create_task(a.enter("interactive"))
    with pytest.raises(APIError) as e:  # the lowest class, newest first, is the one to go
        await asyncio.wait_for(runs["batch"], 1)
    assert e.value.status == 503 and e.value.code == "preempted"
    assert e.value.headers["Retry-After"] == "1"
    assert not runs["default"].done()
    a.leave(batch)  # its handler's finally
    got = await asyncio.wait_for(interactive, 1)
    assert got.slot == "shared" and a.counts[("batch", "preempted")] == 1
    # One preemption per request waiting: a second interactive, with only `default` left
    # unsent, preempts it; once `default` has sent a byte, a third waits.
    runs["interactive"] = asyncio.create_task(got.run(asyncio.sleep(10)))
    got.sent = True
    default.sent = True
    third = asyncio.create_task(a.enter("interactive"))
    await asyncio.sleep(0.02)
    assert not runs["default"].done() and not third.done()
    assert a.counts[("default", "preempted")] == 0
    runs["default"].cancel()
    a.leave(default)
    t3 = await asyncio.wait_for(third, 1)
    for task in runs.values():
        task.cancel()
    await asyncio.gather(*runs.values(), return_exceptions=True)
    for t in (got, t3):
        a.leave(t)
    assert a.shared_used == 0 and a.preempting == 0 and not a.preemptible


async def test_a_client_that_leaves_while_waiting_takes_no_slot() -> None:
    a = Admission(1, limits(system=ClassLimits(reserved=0)))
    held = await a.enter("default")
    held.sent = True
    waiting = asyncio.create_task(a.enter("default"))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert not a.queues["default"] and a.queued["default"] == 0
    a.leave(held)
    assert a.shared_used == 0 and a.inflight["default"] == 0
