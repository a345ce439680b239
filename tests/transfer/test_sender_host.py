"""`Sender` against a stub `SenderHost`: no manager, no bootstrap server, no backend."""

from __future__ import annotations

import asyncio
import logging
from typing import cast

import pytest
from transfer_helpers import eventually

from pd.transfer.base import KVSender, SenderHost
from pd.transfer.session import Session
from pd.transfer.messages import Abort, Message
from pd.transfer.poll import KVPoll
from pd.transfer.sender import Sender

# Stands for a bootstrap session: the sender only hands it back to its host.
SESSION = cast(Session, object())


class StubSenderHost:
    engine_id = "engine-p"
    advertise_host = "10.1.2.3"
    bootstrap_port = 4242

    def __init__(self, renewal_ttl_s: float = 60.0) -> None:
        self.renewal_ttl_s = renewal_ttl_s
        self.sent: list[tuple[Session, Message]] = []
        self.forgotten: list[KVSender] = []

    async def server_send(self, session: Session, msg: Message) -> None:
        self.sent.append((session, msg))

    def forget_sender(self, sender: KVSender) -> None:
        self.forgotten.append(sender)


class Releases:
    """The on_release callback: records (reason, what the host had forgotten at that moment)."""

    def __init__(self, host: StubSenderHost) -> None:
        self.host = host
        self.calls: list[tuple[KVSender, str]] = []
        self.forgotten_at_call: list[list[KVSender]] = []

    def __call__(self, sender: KVSender, reason: str) -> None:
        self.calls.append((sender, reason))
        self.forgotten_at_call.append(list(self.host.forgotten))

    @property
    def reasons(self) -> list[str]:
        return [r for _, r in self.calls]


def make(
    host: StubSenderHost, *, ttl: float = 30.0, slots: dict[str, list[int]] | None = None
) -> tuple[Sender, Releases]:
    rel = Releases(host)
    host_: SenderHost = host  # the stub must satisfy the Protocol
    s = Sender(host_, "t1", slots or {"kv": [3, 1, 2]}, ttl, rel)
    return s, rel


def assert_released_once(s: Sender, host: StubSenderHost, rel: Releases, reason: str) -> None:
    assert rel.reasons == [reason]
    assert rel.calls[0][0] is s
    assert host.forgotten == [s]
    assert s.release_reason == reason


def poke_after_release(s: Sender) -> None:
    """Every later event must be ignored: no second release, no state change."""
    s.abort("late abort")
    s.on_done()
    s.on_remote_abort("late remote abort")
    s.renew(SESSION)


async def test_params_come_from_the_host_and_are_copies():
    host = StubSenderHost()
    slots = {"kv": [3, 1, 2], "state": [0]}
    s, _ = make(host, ttl=12.5, slots=slots)
    slots["kv"].append(99)  # the caller's dict is not the sender's
    p = s.params()
    assert (p.remote_host, p.remote_port, p.remote_engine_id) == ("10.1.2.3", 4242, "engine-p")
    assert (p.transfer_id, p.lease_ttl_s) == ("t1", 12.5)
    assert p.page_ids == {"kv": [3, 1, 2], "state": [0]}
    p.page_ids["kv"].clear()
    assert s.params().page_ids["kv"] == [3, 1, 2]
    assert s.poll() is KVPoll.WaitingForInput
    s.abort()


async def test_lease_expiry_releases_once_and_the_host_forgets_first():
    host = StubSenderHost()
    s, rel = make(host, ttl=0.05)
    await eventually(lambda: rel.calls, timeout_s=2.0, what="lease expiry")
    assert_released_once(s, host, rel, "lease_expired")
    assert rel.forgotten_at_call == [[s]]  # the host forgot it before the callback ran
    assert s.poll() is KVPoll.Failed
    assert s.failure_reason == "lease of 0.05s expired without renewal"
    assert s.lease_remaining_s == 0.0
    poke_after_release(s)
    await asyncio.sleep(0.01)
    assert_released_once(s, host, rel, "lease_expired")
    assert s.poll() is KVPoll.Failed
    assert s.failure_reason == "lease of 0.05s expired without renewal"
    assert host.sent == []  # no session: nobody to tell


async def test_renewals_hold_the_lease_then_it_expires():
    host = StubSenderHost()
    s, rel = make(host, ttl=0.1)
    for _ in range(8):  # 0.24 s in all, well past one TTL
        s.renew(SESSION)
        await asyncio.sleep(0.03)
    assert rel.calls == []
    assert s.poll() is KVPoll.Transferring
    assert s.session is SESSION
    assert host.forgotten == []
    await eventually(lambda: rel.calls, timeout_s=2.0, what="lease expiry after renewals stop")
    assert_released_once(s, host, rel, "decode_lost")


async def test_a_claimed_transfer_whose_decode_side_goes_silent_is_released_within_renewal_ttl():
    """A dead D is seen by its missing heartbeats, not when the (long) lease runs out."""
    host = StubSenderHost(renewal_ttl_s=0.1)
    s, rel = make(host, ttl=30.0)
    t0 = asyncio.get_running_loop().time()
    for _ in range(5):  # renewed past one renewal TTL: the heartbeats hold it
        s.renew(SESSION)
        await asyncio.sleep(0.04)
    assert rel.calls == []
    await eventually(lambda: rel.calls, timeout_s=2.0, what="release after D goes silent")
    assert asyncio.get_running_loop().time() - t0 < 1.0  # not the 30 s lease
    assert_released_once(s, host, rel, "decode_lost")
    assert "stopped renewing" in (s.failure_reason or "")


async def test_done_releases_once_and_stops_the_lease():
    host = StubSenderHost()
    s, rel = make(host, ttl=0.05)
    s.renew(SESSION)
    s.on_done()
    assert s.poll() is KVPoll.Success
    assert s.failure_reason is None
    assert_released_once(s, host, rel, "done")
    assert rel.forgotten_at_call == [[s]]
    await asyncio.sleep(0.15)  # past the lease: its timer must not fire a second release
    poke_after_release(s)
    assert_released_once(s, host, rel, "done")
    assert s.poll() is KVPoll.Success
    assert host.sent == []


async def test_abort_without_a_session_sends_nothing():
    host = StubSenderHost()
    s, rel = make(host)
    s.abort()
    assert s.poll() is KVPoll.Failed
    assert s.failure_reason == "aborted by prefill"
    assert_released_once(s, host, rel, "abort")
    await asyncio.sleep(0.01)
    assert host.sent == []
    poke_after_release(s)
    assert_released_once(s, host, rel, "abort")


async def test_abort_with_a_session_tells_the_decode_side():
    host = StubSenderHost()
    s, rel = make(host)
    s.renew(SESSION)
    s.abort("worker draining")
    assert_released_once(s, host, rel, "abort")
    await eventually(lambda: host.sent, timeout_s=1.0, what="abort sent")
    assert host.sent == [(SESSION, Abort("t1", "worker draining"))]
    s.abort("again")
    await asyncio.sleep(0.01)
    assert len(host.sent) == 1


async def test_remote_abort_releases_without_echoing():
    host = StubSenderHost()
    s, rel = make(host)
    s.renew(SESSION)
    s.on_remote_abort("client went away")
    assert s.poll() is KVPoll.Failed
    assert s.failure_reason == "aborted by decode: client went away"
    assert_released_once(s, host, rel, "abort")
    await asyncio.sleep(0.01)
    assert host.sent == []  # the decode side knows already


async def test_renew_after_release_is_ignored():
    host = StubSenderHost()
    s, rel = make(host, ttl=0.05)
    s.abort("gone")
    s.renew(SESSION)
    assert s.session is None
    assert s.poll() is KVPoll.Failed
    await asyncio.sleep(0.1)
    assert_released_once(s, host, rel, "abort")


async def test_a_failing_callback_is_logged_and_the_release_still_counts(caplog):
    host = StubSenderHost()
    calls = []

    def boom(sender: KVSender, reason: str) -> None:
        calls.append(reason)
        raise RuntimeError("owner bug")

    s = Sender(host, "t9", {"kv": [0]}, 0.05, boom)
    with caplog.at_level(logging.ERROR, logger="pd.transfer.sender"):
        s.on_done()  # does not raise
    assert calls == ["done"]
    assert host.forgotten == [s]
    assert s.poll() is KVPoll.Success
    assert "release callback of transfer t9 failed" in caplog.text
    await asyncio.sleep(0.1)  # the lease timer is gone: no second call
    s.abort()
    assert calls == ["done"]


@pytest.mark.parametrize("event", ["done", "abort", "remote_abort", "lease"])
async def test_every_end_calls_on_release_exactly_once(event):
    host = StubSenderHost()
    s, rel = make(host, ttl=0.05)
    s.renew(SESSION)
    if event == "done":
        s.on_done()
    elif event == "abort":
        s.abort()
    elif event == "remote_abort":
        s.on_remote_abort("x")
    else:
        await eventually(lambda: rel.calls, timeout_s=2.0, what="lease expiry")
    for _ in range(3):
        poke_after_release(s)
    await asyncio.sleep(0.12)  # past the lease
    want = {"done": "done", "lease": "decode_lost"}.get(event, "abort")
    assert_released_once(s, host, rel, want)
