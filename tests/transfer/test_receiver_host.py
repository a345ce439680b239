"""`Receiver` against a stub `ReceiverHost` and a stub link: no manager, no sockets.

The reads go to a scripted backend (the test says when a read is done or broken), or, in the last
test, to two in-process fake backends that really copy the bytes.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from transfer_helpers import eventually

from pd.transfer.backend import Backend, BackendCounts, MemRegion, XferState
from pd.transfer.base import KVReceiver, ReceiverHost
from pd.transfer.config import TransferConfig
from pd.transfer.errors import HandshakeError, PoolError, TransferError
from pd.transfer.fake_backend import FakeBackend
from pd.transfer.messages import Abort, Done, Message
from pd.protocol.wire import TransferParams
from pd.transfer.peer import LinkClient
from pd.transfer.peerproc import PoolSpec, pool_desc, pool_tensors
from pd.transfer.plan import ReadBatch
from pd.transfer.poll import KVPoll
from pd.transfer.poller import Poller
from pd.transfer.pools import PoolDesc, RankRegion
from pd.transfer.receiver import Receiver

TID = "t1"
POOL = PoolDesc("kv", num_slots=8, slot_bytes=64, ranks=(RankRegion(0x10000),))
PEER_POOL = PoolDesc("kv", num_slots=8, slot_bytes=64, ranks=(RankRegion(0x90000),))


def params(page_ids: dict[str, list[int]] | None = None) -> TransferParams:
    return TransferParams(
        remote_host="10.1.2.3",
        remote_port=4242,
        remote_engine_id="engine-p",
        transfer_id=TID,
        page_ids=page_ids or {"kv": [1, 2, 5]},
        lease_ttl_s=30.0,
    )


class StubLink:
    def __init__(self, pools: Mapping[str, PoolDesc], agent: str = "peer-agent") -> None:
        self.agent = agent
        self.pools = pools
        self.clients: dict[str, LinkClient] = {}
        self.sent: list[Message] = []
        self.detached: list[str] = []
        self.suspected = 0

    def attach(self, transfer_id: str, client: LinkClient) -> None:
        self.clients[transfer_id] = client

    def detach(self, transfer_id: str) -> None:
        self.detached.append(transfer_id)
        self.clients.pop(transfer_id, None)

    def send(self, msg: Message) -> None:
        self.sent.append(msg)

    def suspect(self) -> None:
        self.suspected += 1


class ScriptedBackend(Backend):
    """Reads finish when the test says so."""

    name = "scripted"

    def __init__(self) -> None:
        self.state = XferState.PROC
        self.release_ok = True
        self.start_error: str | None = None
        self.reads: dict[int, tuple[str, list[ReadBatch]]] = {}
        self.released: list[int] = []

    def register(self, regions: list[MemRegion]) -> None:
        pass

    def metadata(self) -> bytes:
        return b""

    def add_peer(self, metadata: bytes) -> str:
        return "peer-agent"

    def remove_peer(self, agent: str) -> None:
        pass

    def start_read(self, agent: str, batches: list[ReadBatch]) -> int:
        if self.start_error is not None:
            raise TransferError(self.start_error)
        xid = len(self.reads) + 1
        self.reads[xid] = (agent, batches)
        return xid

    def check(self, xfer: int) -> XferState:
        assert xfer in self.reads and xfer not in self.released
        return self.state

    def release(self, xfer: int) -> bool:
        self.released.append(xfer)
        return self.release_ok

    def counts(self) -> BackendCounts:
        return BackendCounts(0, len(self.reads) - len(self.released), 0)

    def close(self) -> None:
        pass


class StubReceiverHost:
    def __init__(
        self,
        link: StubLink | BaseException | asyncio.Future,
        *,
        backend: Backend | None = None,
        pools: Mapping[str, PoolDesc] | None = None,
        **config: Any,
    ) -> None:
        self.config = TransferConfig(backend="fake", **config)
        self.pools = pools if pools is not None else {"kv": POOL}
        self.backend = backend if backend is not None else ScriptedBackend()
        self.poller = Poller(0.001)  # never started: the tests call progress() themselves
        self.link = link
        self.link_calls: list[TransferParams] = []
        self.link_cancelled = 0
        self.ignore_cancel = False  # a dial that completes although its caller was cancelled
        self.forgotten: list[KVReceiver] = []

    async def link_to(self, params: TransferParams) -> StubLink:
        self.link_calls.append(params)
        if isinstance(self.link, BaseException):
            raise self.link
        if isinstance(self.link, asyncio.Future):
            while True:
                try:
                    return await (asyncio.shield(self.link) if self.ignore_cancel else self.link)
                except asyncio.CancelledError:
                    self.link_cancelled += 1
                    if not self.ignore_cancel:
                        raise
        return self.link

    def forget_receiver(self, receiver: KVReceiver) -> None:
        self.forgotten.append(receiver)


def start(host: StubReceiverHost, p: TransferParams | None = None) -> Receiver:
    host_: ReceiverHost = host  # the stub must satisfy the Protocol
    return Receiver(host_, p or params())


async def attached(host: StubReceiverHost) -> Receiver:
    """A receiver whose bootstrap is through: attached to the stub link, not yet confirmed."""
    rx = start(host)
    assert isinstance(host.link, StubLink)
    link = host.link
    await eventually(lambda: TID in link.clients, timeout_s=1.0, what="attach")
    assert link.clients[TID] is rx
    assert rx.poll() is KVPoll.Bootstrapping
    return rx


async def ended(rx: Receiver) -> KVPoll:
    return await asyncio.wait_for(rx.wait(), 2.0)


# -- bootstrap ------------------------------------------------------------------------------


async def test_a_failed_link_fails_with_its_reason():
    host = StubReceiverHost(HandshakeError("prefill at 10.1.2.3:4242 is engine other"))
    rx = start(host)
    assert await ended(rx) is KVPoll.Failed
    assert rx.failure_reason == "HandshakeError: prefill at 10.1.2.3:4242 is engine other"
    assert host.link_calls == [rx.params]
    assert host.forgotten == [rx]
    assert rx.finished_at is not None


async def test_a_pool_missing_on_the_peer_fails_before_attaching():
    link = StubLink({})
    host = StubReceiverHost(link)
    rx = start(host)
    assert await ended(rx) is KVPoll.Failed
    assert rx.failure_reason == "PoolError: pool 'kv' is not registered on both sides"
    assert link.clients == {} and link.sent == []
    assert host.forgotten == [rx]


async def test_incompatible_pools_fail_before_attaching():
    link = StubLink({"kv": PoolDesc("kv", 8, 128, (RankRegion(0x90000),))})
    host = StubReceiverHost(link)
    rx = start(host)
    assert await ended(rx) is KVPoll.Failed
    assert rx.failure_reason == "PoolError: pool 'kv': slot bytes 64 != remote 128"
    assert link.clients == {}


async def test_abort_while_bootstrapping_stops_the_handshake_and_the_host_drops_it():
    fut = asyncio.get_running_loop().create_future()
    host = StubReceiverHost(fut)
    rx = start(host)
    await eventually(lambda: host.link_calls, timeout_s=1.0, what="dial")
    rx.abort("client went away")
    assert rx.poll() is KVPoll.Failed
    assert rx.failure_reason == "client went away"
    assert host.forgotten == [rx]
    assert await ended(rx) is KVPoll.Failed
    await eventually(lambda: host.link_cancelled == 1, timeout_s=1.0, what="dial cancelled")


async def test_a_receiver_ended_during_the_dial_never_attaches():
    fut = asyncio.get_running_loop().create_future()
    host = StubReceiverHost(fut)
    host.ignore_cancel = True
    rx = start(host)
    await eventually(lambda: host.link_calls, timeout_s=1.0, what="dial")
    rx.abort("client went away")
    await eventually(lambda: host.link_cancelled == 1, timeout_s=1.0, what="dial cancelled")
    link = StubLink({"kv": PEER_POOL})
    fut.set_result(link)
    await asyncio.sleep(0.02)
    assert link.clients == {} and link.sent == []
    assert rx.poll() is KVPoll.Failed and rx.failure_reason == "client went away"
    assert host.forgotten == [rx]


async def test_the_handshake_deadline_fails_a_receiver_stuck_in_bootstrap():
    host = StubReceiverHost(asyncio.get_running_loop().create_future(), handshake_timeout_s=0.05)
    rx = start(host)
    assert await ended(rx) is KVPoll.Failed
    assert rx.failure_reason == "handshake with 10.1.2.3:4242 not done within 0.05s"
    assert host.forgotten == [rx]
    await eventually(lambda: host.link_cancelled == 1, timeout_s=1.0, what="dial cancelled")


async def test_a_confirmed_receiver_outlives_the_handshake_deadline():
    host = StubReceiverHost(StubLink({"kv": PEER_POOL}), handshake_timeout_s=0.05)
    rx = await attached(host)
    rx.on_attached()
    assert rx.poll() is KVPoll.WaitingForInput
    await asyncio.sleep(0.1)
    assert rx.poll() is KVPoll.WaitingForInput
    assert host.forgotten == []
    rx.abort()


# -- pull -----------------------------------------------------------------------------------


@pytest.mark.parametrize("init_first", [True, False])
async def test_the_pull_starts_once_confirmed_and_initialised_then_succeeds(init_first):
    link = StubLink({"kv": PEER_POOL})
    host = StubReceiverHost(link)
    backend = host.backend
    assert isinstance(backend, ScriptedBackend)
    rx = await attached(host)
    if init_first:
        rx.init({"kv": [0, 3, 4]})
        assert backend.reads == {}  # P has not confirmed yet
        rx.on_attached()
    else:
        rx.on_attached()
        assert rx.poll() is KVPoll.WaitingForInput
        assert backend.reads == {}  # no destination yet
        rx.init({"kv": [0, 3, 4]})
    assert rx.poll() is KVPoll.Transferring
    assert list(backend.reads) == [1]
    agent, batches = backend.reads[1]
    assert agent == "peer-agent"
    remote = [tuple(r) for b in batches for r in b.remote.tolist()]
    local = [tuple(r) for b in batches for r in b.local.tolist()]
    # Runs coalesce only where slots are adjacent on both sides (P 1,2 are, D 0,3 are not): one
    # descriptor per slot, in page order.
    assert remote == [(0x90000 + 64 * i, 64, 0) for i in (1, 2, 5)]
    assert local == [(0x10000 + 64 * i, 64, 0) for i in (0, 3, 4)]
    assert host.poller.in_flight == 1

    assert rx.progress(time.monotonic()) is False  # still in flight
    assert rx.poll() is KVPoll.Transferring
    backend.state = XferState.DONE
    assert rx.progress(time.monotonic()) is True
    assert await ended(rx) is KVPoll.Success
    assert rx.failure_reason is None
    assert link.sent == [Done(TID)]
    assert link.detached == [TID] and link.clients == {}
    assert backend.released == [1]
    assert host.forgotten == [rx]
    assert not rx.dst_unsafe
    assert rx.started_at is not None and rx.finished_at is not None
    assert rx.finished_at >= rx.started_at

    rx.abort("too late")  # Success is final
    rx.on_peer_lost("too late")
    assert rx.poll() is KVPoll.Success
    assert link.sent == [Done(TID)]
    assert host.forgotten == [rx]


async def test_a_transport_error_fails_suspects_the_peer_and_tells_prefill():
    link = StubLink({"kv": PEER_POOL})
    host = StubReceiverHost(link)
    backend = host.backend
    assert isinstance(backend, ScriptedBackend)
    rx = await attached(host)
    rx.on_attached()
    rx.init({"kv": [0, 3, 4]})
    backend.state = XferState.ERR
    assert rx.progress(time.monotonic()) is True
    reason = "TransferFailed: transport error while reading from prefill"
    assert rx.poll() is KVPoll.Failed and rx.failure_reason == reason
    assert link.suspected == 1
    assert link.sent == [Abort(TID, reason)]
    assert link.detached == [TID]
    assert backend.released == [1]
    assert host.poller.in_flight == 0
    assert host.forgotten == [rx]
    assert not rx.dst_unsafe


async def test_a_pull_past_its_deadline_fails_and_tells_prefill():
    link = StubLink({"kv": PEER_POOL})
    host = StubReceiverHost(link, transfer_timeout_s=1.0)
    rx = await attached(host)
    rx.on_attached()
    rx.init({"kv": [0, 3, 4]})
    assert rx.started_at is not None
    assert rx.progress(rx.started_at + 0.9) is False
    assert rx.progress(rx.started_at + 1.1) is True
    reason = "TransferFailed: pull not done within 1.0s"
    assert rx.failure_reason == reason
    assert link.sent == [Abort(TID, reason)]
    assert link.suspected == 0
    assert host.forgotten == [rx]


async def test_a_read_that_fails_to_start_fails_and_tells_prefill():
    link = StubLink({"kv": PEER_POOL})
    host = StubReceiverHost(link)
    backend = host.backend
    assert isinstance(backend, ScriptedBackend)
    backend.start_error = "no route"
    rx = await attached(host)
    rx.on_attached()
    rx.init({"kv": [0, 3, 4]})
    assert rx.poll() is KVPoll.Failed
    assert rx.failure_reason == "TransferError: no route"
    assert link.sent == [Abort(TID, "TransferError: no route")]
    assert host.poller.in_flight == 0
    assert host.forgotten == [rx]


async def test_abort_during_the_pull_releases_and_an_uncancellable_read_marks_dst_unsafe():
    link = StubLink({"kv": PEER_POOL})
    host = StubReceiverHost(link)
    backend = host.backend
    assert isinstance(backend, ScriptedBackend)
    backend.release_ok = False  # the read could not be cancelled
    rx = await attached(host)
    rx.on_attached()
    rx.init({"kv": [0, 3, 4]})
    rx.abort()
    assert rx.poll() is KVPoll.Failed and rx.failure_reason == "aborted by decode"
    assert rx.dst_unsafe
    assert backend.released == [1]
    assert link.sent == [Abort(TID, "aborted by decode")]
    assert link.detached == [TID]
    assert host.poller.in_flight == 0
    assert host.forgotten == [rx]
    assert await ended(rx) is KVPoll.Failed


@pytest.mark.parametrize(
    "event, reason",
    [
        ("unknown", f"prefill does not hold transfer {TID} (lease expired or aborted)"),
        ("remote_abort", "aborted by prefill: draining"),
        ("peer_lost", "PeerLostError: missed heartbeats"),
    ],
)
async def test_what_prefill_says_fails_the_receiver_without_an_echo(event, reason):
    link = StubLink({"kv": PEER_POOL})
    host = StubReceiverHost(link)
    rx = await attached(host)
    if event == "unknown":
        rx.on_unknown()
    elif event == "remote_abort":
        rx.on_remote_abort("draining")
    else:
        rx.on_peer_lost("missed heartbeats")
    assert rx.poll() is KVPoll.Failed
    assert rx.failure_reason == reason
    assert link.sent == []  # prefill knows already
    assert link.detached == [TID]
    assert host.forgotten == [rx]


async def test_init_checks_pools_and_lengths():
    host = StubReceiverHost(StubLink({"kv": PEER_POOL}))
    rx = await attached(host)
    with pytest.raises(PoolError, match="pools"):
        rx.init({"state": [0, 1, 2]})
    with pytest.raises(PoolError, match="needs 3 slots, got 2"):
        rx.init({"kv": [0, 1]})
    rx.init({"kv": [0, 1, 2]})
    with pytest.raises(TransferError, match="init\\(\\) called twice"):
        rx.init({"kv": [0, 1, 2]})
    assert rx.poll() is KVPoll.Bootstrapping
    rx.abort()


# -- real bytes through the fake backend ----------------------------------------------------


def register(backend: Backend, pool: PoolDesc) -> None:
    backend.register(
        [MemRegion(r.base_addr, pool.region_bytes, r.mem_kind, r.device_id) for r in pool.ranks]
    )


async def test_a_pull_through_the_fake_backend_copies_the_slots():
    tag = uuid.uuid4().hex
    p_backend, d_backend = FakeBackend(f"p-{tag}"), FakeBackend(f"d-{tag}")
    try:
        kv_p, kv_d = PoolSpec("kv", 8, tp=1, seed=4), PoolSpec("kv", 8, tp=2, seed=4)
        p_mem, d_mem = pool_tensors(kv_p, fill=True), pool_tensors(kv_d, fill=False)
        p_pool, d_pool = pool_desc(kv_p, p_mem), pool_desc(kv_d, d_mem)
        register(p_backend, p_pool)
        register(d_backend, d_pool)
        link = StubLink({"kv": p_pool}, agent=d_backend.add_peer(p_backend.metadata()))
        host = StubReceiverHost(link, backend=d_backend, pools={"kv": d_pool})
        rx = await attached(host)
        rx.on_attached()
        rx.init({"kv": [6, 0, 3]})
        assert rx.progress(time.monotonic()) is True
        assert await ended(rx) is KVPoll.Success, rx.failure_reason
        got = torch.cat(d_mem, dim=3)  # D's two head halves side by side
        assert torch.equal(got[[6, 0, 3]], p_mem[0][[1, 2, 5]])
        untouched = [i for i in range(8) if i not in (6, 0, 3)]
        assert not got[untouched].any()
        assert d_backend.counts().xfer_handles == 0
        assert link.sent == [Done(TID)]
    finally:
        d_backend.close()
        p_backend.close()
