"""Real NIXL between two processes: exact bytes, heterogeneous TP, a second pool, peer death."""

from __future__ import annotations

import asyncio
import random
import signal
import time

import pytest
import torch
from transfer_helpers import D_SIDE, TOKEN, eventually, needs_nixl, start_manager

from pd.transfer import KVPoll, TransferParams
from pd.transfer.peerproc import PoolSpec, global_tensor, pool_desc, pool_tensors

pytestmark = [needs_nixl, pytest.mark.nixl, pytest.mark.slow]

CFG = {"cluster_token": TOKEN, "backend": "nixl", "heartbeat_interval_s": 0.1}
# P serves: "same" (TP1), "kv12" (TP1, D has TP2), "kv21" (TP2, D has TP1), "state" (other slot size)
P_POOLS = [
    PoolSpec("same", 64, tp=1, seed=11),
    PoolSpec("kv12", 32, tp=1, seed=12),
    PoolSpec("kv21", 32, tp=2, seed=13),
    PoolSpec("state", 16, kind="whole", slot_elems=200, seed=14),
]
D_TP = {"same": 1, "kv12": 2, "kv21": 1, "state": 1}


def local_spec(p: PoolSpec) -> PoolSpec:
    return PoolSpec(**{**p.to_dict(), "tp": D_TP[p.name]})


async def test_two_processes_exact_bytes_hetero_tp_and_second_pool(prefill_procs):
    proc = prefill_procs({"config": CFG, "pools": [p.to_dict() for p in P_POOLS]})
    D = await start_manager("nixl", **D_SIDE)
    mem = {}
    try:
        for p in P_POOLS:
            mem[p.name] = pool_tensors(local_spec(p), fill=False)
            D.register_pool(pool_desc(local_spec(p), mem[p.name]))
        rng = random.Random(7)
        cases = {  # pool -> (P's slots, D's slots): random, non-contiguous, different on each side
            "same": (rng.sample(range(64), 20), rng.sample(range(64), 20)),
            "kv12": (rng.sample(range(32), 7), rng.sample(range(32), 7)),
            "kv21": (rng.sample(range(32), 7), rng.sample(range(32), 7)),
        }
        for name, (src, dst) in cases.items():
            slots = {name: src, "state": [3, 9]} if name == "same" else {name: src}
            params = TransferParams.from_dict(await proc.send(slots))
            rx = D.create_receiver(params)
            rx.init({name: dst, "state": [0, 15]} if name == "same" else {name: dst})
            assert await asyncio.wait_for(rx.wait(), 20) is KVPoll.Success, rx.failure_reason
            assert (await proc.aevent()) == {
                "event": "released",
                "transfer_id": params.transfer_id,
                "reason": "done",
            }
            spec = next(p for p in P_POOLS if p.name == name)
            want = global_tensor(spec)[src]
            got = torch.cat(mem[name], dim=3)[dst]  # D's ranks' head slices side by side
            assert torch.equal(got, want), f"{name}: bytes differ"
            for d_rank, t in enumerate(mem[name]):  # every head slice of every rank, exactly
                hr = t.shape[3]
                assert torch.equal(t[dst], want[:, :, :, d_rank * hr : (d_rank + 1) * hr])
        state_spec = P_POOLS[3]
        assert torch.equal(mem["state"][0][[0, 15]], global_tensor(state_spec)[[3, 9]])
        st = D.state()
        assert (st.receivers, st.in_flight, st.backend.xfer_handles) == (0, 0, 0)
    finally:
        await D.close()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
async def test_prefill_dies_mid_pull(prefill_procs, monkeypatch, sig):
    # Over TCP a pull is asynchronous (shared memory/CMA would finish inside the post call).
    monkeypatch.setenv("UCX_TLS", "tcp")
    big = PoolSpec("kv", 256, layers=16, heads=4, page_size=16, head_dim=64, random=False)  # 64 MiB
    proc = prefill_procs({"config": CFG, "pools": [big.to_dict()]}, env={"UCX_TLS": "tcp"})
    D = await start_manager("nixl", **D_SIDE, heartbeat_interval_s=0.2, heartbeat_misses=3)
    try:
        keep = pool_tensors(big, fill=False)
        D.register_pool(pool_desc(big, keep))
        params = TransferParams.from_dict(await proc.send({"kv": list(range(256))}))
        rx = D.create_receiver(params)
        await eventually(lambda: rx.poll() is KVPoll.WaitingForInput, what="handshake")
        rx.init({"kv": list(range(256))})
        assert rx.poll() is KVPoll.Transferring
        proc.kill(sig)
        t0 = time.monotonic()
        assert await asyncio.wait_for(rx.wait(), 5) is KVPoll.Failed
        assert time.monotonic() - t0 < 5
        assert rx.failure_reason
        if sig == signal.SIGSTOP:  # no transport error from a frozen peer: heartbeats found it
            assert "missed heartbeats" in rx.failure_reason, rx.failure_reason
        # the survivor keeps nothing of the dead peer: agent, transfer handles, descriptor lists
        await eventually(lambda: D.state().links == 0, timeout_s=5, what="link dropped")
        st = D.state()
        assert (
            st.backend.remote_agents == 0
            and st.backend.xfer_handles == 0
            and st.backend.dlists == 0
        )
        assert (st.receivers, st.in_flight, st.connecting) == (0, 0, 0)
    finally:
        proc.kill(signal.SIGKILL)
        await D.close()
