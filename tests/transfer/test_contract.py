"""The sender/receiver contract, in one process, against every backend (fake and real NIXL)."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from transfer_helpers import D_SIDE, backends, eventually, start_manager

from pd.transfer import KVPoll, TransferParams
from pd.transfer.peerproc import PoolSpec, global_tensor, pool_desc, pool_tensors

pytestmark = pytest.mark.parametrize("backend", backends())


@pytest.fixture
async def pair(backend):
    """(P, D) managers with a KV pool (P TP=1, D TP=2, 4 heads) and a 'state' pool."""
    P = await start_manager(backend)
    D = await start_manager(backend, **D_SIDE)
    kv_p, kv_d = PoolSpec("kv", 32, tp=1, seed=1), PoolSpec("kv", 32, tp=2, seed=1)
    st = PoolSpec("state", 8, kind="whole", slot_elems=96, seed=2)
    mem = {
        "P": pool_tensors(kv_p, fill=True) + pool_tensors(st, fill=True),
        "D": pool_tensors(kv_d, fill=False) + pool_tensors(st, fill=False),
    }
    P.register_pool(pool_desc(kv_p, mem["P"][:1]))
    P.register_pool(pool_desc(st, mem["P"][1:]))
    D.register_pool(pool_desc(kv_d, mem["D"][:2]))
    D.register_pool(pool_desc(st, mem["D"][2:]))
    yield P, D, mem, kv_p, st
    await D.close()
    await P.close()


def assert_clean(P, D):
    ps, ds = P.state(), D.state()
    assert (ps.senders, ds.receivers, ds.in_flight, ds.backend.xfer_handles) == (0, 0, 0, 0), (
        ps,
        ds,
    )


async def test_pull_kv_and_second_pool_in_one_request(pair):
    P, D, mem, kv, st = pair
    released = []
    src = random.Random(0).sample(range(32), 9)
    dst = random.Random(1).sample(range(32), 9)
    s = P.create_sender({"kv": src, "state": [5]}, lambda s, r: released.append(r))
    assert s.poll() is KVPoll.WaitingForInput
    rx = D.create_receiver(TransferParams.from_dict(s.params().to_dict()))
    assert rx.poll() is KVPoll.Bootstrapping
    rx.init({"kv": dst, "state": [2]})
    assert await asyncio.wait_for(rx.wait(), 10) is KVPoll.Success, rx.failure_reason
    g = global_tensor(kv)
    got = torch.cat(mem["D"][:2], dim=3)  # D's two head halves side by side
    assert torch.equal(got[dst], g[src])
    assert torch.equal(mem["D"][2][2], mem["P"][1][5])
    await eventually(lambda: released == ["done"], what="done releases the sender")
    assert s.poll() is KVPoll.Success
    assert_clean(P, D)


async def test_done_and_aborts_release_at_once(pair):
    P, D, _, _, _ = pair
    released = {}
    mk = lambda tid: P.create_sender(  # noqa: E731
        {"kv": [1, 2]},
        lambda s, r: released.setdefault(s.transfer_id, r),
        transfer_id=tid,
        lease_ttl_s=30,
    )
    a, b, c = mk("a"), mk("b"), mk("c")
    ra = D.create_receiver(TransferParams.from_dict(a.params().to_dict()))
    rb = D.create_receiver(TransferParams.from_dict(b.params().to_dict()))
    rc = D.create_receiver(TransferParams.from_dict(c.params().to_dict()))
    ra.init({"kv": [3, 4]})
    await eventually(
        lambda: rb.poll() is KVPoll.WaitingForInput and rc.poll() is KVPoll.WaitingForInput
    )
    rb.abort("client went away")
    c.abort("prefill shutting down")
    took = await eventually(lambda: len(released) == 3, timeout_s=2, what="three releases")
    assert took < 1.0 and released == {"a": "done", "b": "abort", "c": "abort"}
    assert ra.poll() is KVPoll.Success and rb.poll() is KVPoll.Failed
    await eventually(lambda: rc.poll() is KVPoll.Failed, what="P's abort reaches D")
    assert "aborted by prefill" in rc.failure_reason
    assert "client went away" in b.failure_reason
    assert_clean(P, D)


async def test_lease_expires_without_decode_and_renewal_keeps_it(pair):
    P, D, _, _, _ = pair
    released = {}
    cb = lambda s, r: released.setdefault(s.transfer_id, r)  # noqa: E731
    warm = P.create_sender({"kv": [2]}, cb, transfer_id="warm")  # first pull sets the link up
    rx = D.create_receiver(TransferParams.from_dict(warm.params().to_dict()))
    rx.init({"kv": [2]})
    assert await asyncio.wait_for(rx.wait(), 10) is KVPoll.Success
    lone = P.create_sender({"kv": [0]}, cb, transfer_id="lone", lease_ttl_s=0.3)
    kept = P.create_sender({"kv": [1]}, cb, transfer_id="kept", lease_ttl_s=0.3)
    rx = D.create_receiver(
        TransferParams.from_dict(kept.params().to_dict())
    )  # D has it, no pages yet
    await eventually(lambda: "lone" in released, timeout_s=2)
    assert released["lone"] == "lease_expired" and lone.poll() is KVPoll.Failed
    await asyncio.sleep(
        0.8
    )  # well past the TTL: renewals keep "kept" alive while D waits for pages
    assert "kept" not in released and rx.poll() is KVPoll.WaitingForInput
    rx.init({"kv": [9]})
    assert await asyncio.wait_for(rx.wait(), 10) is KVPoll.Success
    await eventually(lambda: released.get("kept") == "done")
    # a receiver for an expired transfer fails fast with a reason
    late = D.create_receiver(TransferParams.from_dict(lone.params().to_dict()))
    assert await asyncio.wait_for(late.wait(), 5) is KVPoll.Failed
    assert "lease expired or aborted" in late.failure_reason
    assert_clean(P, D)


async def test_idle_poller_does_not_poll(pair):
    P, D, _, _, _ = pair
    s = P.create_sender({"kv": [1]}, lambda s, r: None)
    rx = D.create_receiver(TransferParams.from_dict(s.params().to_dict()))
    rx.init({"kv": [2]})
    assert await asyncio.wait_for(rx.wait(), 10) is KVPoll.Success
    await asyncio.sleep(0.05)
    before = (P.state().polls, D.state().polls)
    assert before[1] >= 1  # the pull itself was polled
    await asyncio.sleep(1.0)
    after = (P.state().polls, D.state().polls)
    assert after == before, f"idle managers polled: {before} -> {after}"


async def test_incompatible_pools_and_bad_slots_fail_loudly(pair):
    P, D, _, _, _ = pair
    s = P.create_sender({"kv": [1, 2]}, lambda s, r: None)
    rx = D.create_receiver(TransferParams.from_dict(s.params().to_dict()))
    with pytest.raises(Exception, match="needs 2 slots"):
        rx.init({"kv": [1]})
    rx.abort()
    bogus = TransferParams.from_dict({**s.params().to_dict(), "page_ids": {"nope": [1]}})
    rx2 = D.create_receiver(bogus)
    assert await asyncio.wait_for(rx2.wait(), 5) is KVPoll.Failed
    assert "not registered on both sides" in rx2.failure_reason


async def test_handshake_deadline_and_engine_change(pair):
    P, D, _, _, _ = pair
    s = P.create_sender({"kv": [1]}, lambda s, r: None)
    d = s.params().to_dict()
    # a port where nothing answers: Failed within the handshake deadline, nothing cached
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]
    rx = D.create_receiver(TransferParams.from_dict({**d, "remote_port": dead_port}))
    assert await asyncio.wait_for(rx.wait(), 5) is KVPoll.Failed
    assert "handshake" in rx.failure_reason.lower()
    # params from an engine that is not the one listening (P restarted since): refused
    rx = D.create_receiver(TransferParams.from_dict({**d, "remote_engine_id": "old-engine"}))
    assert await asyncio.wait_for(rx.wait(), 5) is KVPoll.Failed
    assert "restarted" in rx.failure_reason
    await eventually(lambda: D.state().connecting == 0)
    assert D.state().receivers == 0
