"""The `sim` backend: reads take the modeled link's time, share one link per local device, move
no bytes, and release cleanly; through two real managers, a pull of pools that hold no memory."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from transfer_helpers import D_SIDE, eventually, start_manager

from pd.transfer import KVPoll, PoolDesc, RankRegion, TpSplit, TransferError, TransferParams
from pd.transfer.backend import MemRegion, XferState
from pd.transfer.plan import ReadBatch, plan_reads
from pd.transfer.sim_backend import SimBackend

GB = 1e9
# Addresses no process maps: touching one would crash the test (nothing may be read or written).
P_BASE, D_BASE = 1 << 45, 1 << 46


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def backend(clock: Clock, **kw) -> SimBackend:
    return SimBackend("x", bandwidth=kw.pop("bandwidth", 10 * GB), clock=clock, **kw)


def batch(addr: int, nbytes: int, dev: int = 0, remote: int = P_BASE) -> ReadBatch:
    local = np.array([[addr, nbytes, dev]], dtype=np.uint64)
    return ReadBatch("VRAM", "VRAM", local, np.array([[remote, nbytes, 0]], dtype=np.uint64))


def paired(clock: Clock, **kw) -> tuple[SimBackend, str]:
    """A reading backend with 2 devices of 1 GB at D_BASE, and a peer with 1 GB at P_BASE."""
    d = backend(clock, **kw)
    d.register(
        [MemRegion(D_BASE, int(GB), "VRAM", 0), MemRegion(D_BASE + 2**31, int(GB), "VRAM", 1)]
    )
    p = SimBackend("p", bandwidth=1.0)
    p.register([MemRegion(P_BASE, int(GB), "VRAM", 0)])
    return d, d.add_peer(p.metadata())


def test_a_read_takes_latency_plus_bytes_over_bandwidth_scaled():
    clock = Clock()
    d, peer = paired(clock, latency_s=0.001, time_scale=3.0)
    x = d.start_read(peer, [batch(D_BASE, 50_000_000)])  # 5 ms at 10 GB/s
    assert d.ready_at(x) == pytest.approx(100.0 + 3.0 * (0.001 + 0.005))
    clock.t = 100.0 + 3.0 * 0.006 - 1e-6
    assert d.check(x) is XferState.PROC
    clock.t += 2e-6
    assert d.check(x) is XferState.DONE
    assert (d.reads, d.bytes_read) == (1, 50_000_000)
    assert d.release(x) and d.check(x) is XferState.ERR  # released: no longer held


def test_concurrent_reads_share_the_link_and_devices_have_their_own():
    clock = Clock()
    d, peer = paired(clock, latency_s=0.001)
    a = d.start_read(peer, [batch(D_BASE, 100_000_000)])  # 10 ms
    b = d.start_read(peer, [batch(D_BASE + 100_000_000, 100_000_000)])  # queued behind a
    c = d.start_read(peer, [batch(D_BASE + 2**31, 100_000_000, dev=1)])  # device 1: its own
    assert d.ready_at(a) == pytest.approx(100.011)
    assert d.ready_at(b) == pytest.approx(100.021)  # latency overlaps a's bytes: not queued
    assert d.ready_at(c) == pytest.approx(100.011)
    # One read over both devices: each carries its half, side by side (LinkSpec.transfer_s(n, 2)).
    clock.t = 200.0
    both = d.start_read(peer, [batch(D_BASE, 50_000_000, 0), batch(D_BASE + 2**31, 50_000_000, 1)])
    assert d.ready_at(both) == pytest.approx(200.0 + 0.001 + 0.005)


def test_a_read_released_in_flight_gives_its_link_back():
    clock = Clock()
    d, peer = paired(clock)
    a = d.start_read(peer, [batch(D_BASE, 100_000_000)])
    clock.t += 0.004
    assert d.release(a)  # always cancellable: nothing can land
    assert d.link_free_at(0) == pytest.approx(clock.t)
    b = d.start_read(peer, [batch(D_BASE, 100_000_000)])
    assert d.ready_at(b) == pytest.approx(clock.t + 0.01)
    # A read with another queued behind it keeps its share (the one behind is not moved).
    c = d.start_read(peer, [batch(D_BASE, 100_000_000)])
    assert d.release(b) and d.ready_at(c) == pytest.approx(clock.t + 0.02)
    d.remove_peer(peer)  # releases what is still posted towards the peer
    assert d.counts().xfer_handles == 0 and d.counts().remote_agents == 0


def test_reads_outside_registered_memory_and_unknown_peers_are_refused():
    clock = Clock()
    d, peer = paired(clock)
    with pytest.raises(TransferError, match="local descriptor"):
        d.start_read(peer, [batch(D_BASE + int(GB) - 10, 100)])
    with pytest.raises(TransferError, match="remote descriptor"):
        d.start_read(peer, [batch(D_BASE, 100, remote=P_BASE + int(GB))])
    with pytest.raises(TransferError, match="local descriptor"):
        d.start_read(peer, [batch(D_BASE, 100, dev=1)])  # device 1's region is elsewhere
    with pytest.raises(TransferError, match="unknown peer"):
        d.start_read("nobody", [batch(D_BASE, 100)])
    with pytest.raises(TransferError, match="metadata"):
        d.add_peer(b'{"fake_agent": "x"}')


def test_fault_hook_fails_reads():
    clock = Clock()
    d, peer = paired(clock)
    x = d.start_read(peer, [batch(D_BASE, 100)])
    d.fail_reads = True
    assert d.check(x) is XferState.ERR


def kv_pool(base: int, tp: int, pages: int = 64) -> PoolDesc:
    """A page-major KV pool of 8 heads over `tp` ranks at `base`, holding no memory."""
    heads = 8 // tp
    split = TpSplit(outer=4 * 2, heads=heads, inner_bytes=16 * 128 * 2, total_heads=8)
    ranks = tuple(RankRegion(base + r * 2**32, f"cuda:{r}", r * heads) for r in range(tp))
    return PoolDesc("kv", pages, split.slot_bytes, ranks, split=split)


@pytest.mark.parametrize("tp_p, tp_d", [(1, 1), (2, 1), (1, 2)])
async def test_a_pull_through_two_managers_takes_the_link_time(tp_p, tp_d):
    """Real managers (bootstrap, handshake, heartbeats, done) over the sim backend, pools at
    addresses that hold nothing: the pull succeeds in the modeled time and P is told done."""
    link = dict(backend="sim", sim_bandwidth=1 * GB, sim_latency_s=0.002, time_scale=2.0)
    P = await start_manager(**link)
    D = await start_manager(**link, **D_SIDE)
    try:
        P.register_pool(kv_pool(P_BASE, tp_p))
        D.register_pool(kv_pool(D_BASE, tp_d))
        released = []
        src, dst = list(range(10, 42)), list(range(32))
        s = P.create_sender({"kv": src}, lambda s, r: released.append(r))
        rx = D.create_receiver(TransferParams.from_dict(s.params().to_dict()))
        await eventually(lambda: rx.poll() is KVPoll.WaitingForInput, what="handshake")
        t0 = time.monotonic()
        rx.init({"kv": dst})
        assert await asyncio.wait_for(rx.wait(), 10) is KVPoll.Success, rx.failure_reason
        took = time.monotonic() - t0
        nbytes = sum(b.nbytes for b in plan_reads(D.pools["kv"], P.pools["kv"], src, dst))
        assert nbytes == 32 * 4 * 2 * 8 * 16 * 128 * 2  # every page's bytes, all heads
        modeled = 2.0 * (0.002 + nbytes / tp_d / GB)  # D's ranks read side by side
        assert modeled <= took < modeled + 0.25, (took, modeled)
        await eventually(lambda: released == ["done"], what="done releases the sender")
        assert D.state().backend.xfer_handles == 0 and D.state().in_flight == 0
    finally:
        await D.close()
        await P.close()
