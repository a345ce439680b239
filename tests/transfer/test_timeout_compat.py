"""`pd._compat.timeout_py310` (the Python 3.10 stand-in for `asyncio.timeout`) behaves like it."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest

from pd._compat import asyncio_timeout, timeout_py310

IMPLS = [pytest.param(timeout_py310, id="py310")]
if sys.version_info >= (3, 11):
    IMPLS.append(pytest.param(asyncio.timeout, id="asyncio"))

each = pytest.mark.parametrize("timeout", IMPLS)


@each
async def test_a_block_past_its_deadline_raises_timeout_error(timeout):
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        async with timeout(0.02):
            await asyncio.sleep(5)
    assert time.monotonic() - t0 < 2
    await asyncio.sleep(0.01)  # the task itself is not left cancelled


@each
async def test_a_block_done_in_time_is_left_alone(timeout):
    async with timeout(0.05):
        await asyncio.sleep(0)
    await asyncio.sleep(0.1)  # past the deadline: nothing fires later


@each
async def test_none_never_expires(timeout):
    async with timeout(None):
        await asyncio.sleep(0.02)


@each
async def test_a_cancellation_from_outside_stays_a_cancellation(timeout):
    entered = asyncio.Event()

    async def body() -> None:
        async with timeout(5):
            entered.set()
            await asyncio.sleep(5)

    task = asyncio.create_task(body())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@each
async def test_errors_of_the_block_pass_through(timeout):
    with pytest.raises(KeyError):
        async with timeout(5):
            raise KeyError("x")


@pytest.mark.skipif(sys.version_info < (3, 11), reason="3.11+ uses asyncio.timeout")
def test_newer_pythons_use_asyncio_timeout():
    assert asyncio_timeout is asyncio.timeout


@each
async def test_rescheduling_to_now_expires_the_block_at_once(timeout):
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        async with timeout(30) as cm:
            loop = asyncio.get_running_loop()
            loop.call_later(0.02, lambda: cm.reschedule(loop.time()))
            await asyncio.sleep(5)
    assert time.monotonic() - t0 < 2
