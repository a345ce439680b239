"""Pure tests: poll-state rules and read planning (applied to simulated memory)."""

from __future__ import annotations

import numpy as np
import pytest

from pd.transfer import KVPoll, PoolDesc, PoolError, RankRegion, TpSplit
from pd.transfer.plan import plan_reads
from pd.transfer.poll import PollState


def test_poll_states_only_move_forward_and_failed_wins():
    s = PollState()
    assert s.advance(KVPoll.WaitingForInput)
    assert not s.advance(KVPoll.Bootstrapping)
    assert s.state is KVPoll.WaitingForInput
    assert s.advance(KVPoll.Transferring)
    assert s.fail("boom") and s.state is KVPoll.Failed and s.reason == "boom"
    assert not s.advance(KVPoll.Success) and not s.fail("again")
    assert s.reason == "boom"
    done = PollState(KVPoll.Transferring)
    assert done.advance(KVPoll.Success) and not done.fail("late") and done.state is KVPoll.Success
    assert min(KVPoll) is KVPoll.Failed


# Simulated memory: one flat byte array per (side, rank); addresses are offsets + a per-rank base.
OUTER, INNER, HEADS, SLOTS = 3, 4, 4, 8


def kv_pool(tp: int, base0: int, heads_total: int = HEADS) -> PoolDesc:
    hr = max(1, heads_total // tp)
    group = hr * tp // heads_total
    split = TpSplit(OUTER, hr, INNER, heads_total)
    ranks = tuple(RankRegion(base0 + r * 10**6, "cpu", (r // group) * hr) for r in range(tp))
    return PoolDesc("kv", SLOTS, split.slot_bytes, ranks, split=split)


def fill(pool: PoolDesc, global_mem: np.ndarray) -> dict[int, np.ndarray]:
    """Rank memories holding the head slices of global_mem [slots, outer, heads, inner]."""
    assert pool.split is not None
    out = {}
    for r in pool.ranks:
        out[r.base_addr] = (
            global_mem[:, :, r.head_start : r.head_start + pool.split.heads].copy().ravel()
        )
    return out


def apply(batches, local_mem: dict[int, np.ndarray], remote_mem: dict[int, np.ndarray]) -> None:
    def locate(mem, addr):
        base = max(b for b in mem if b <= addr)
        return mem[base], addr - base

    for b in batches:
        for (la, n, _), (ra, _, _) in zip(b.local.tolist(), b.remote.tolist()):
            lbuf, lo = locate(local_mem, la)
            rbuf, ro = locate(remote_mem, ra)
            lbuf[lo : lo + n] = rbuf[ro : ro + n]


@pytest.mark.parametrize(
    "p_tp,d_tp,heads", [(1, 1, 4), (1, 2, 4), (2, 1, 4), (2, 4, 4), (4, 2, 4), (1, 4, 2), (4, 1, 2)]
)
def test_head_slices_land_exactly(p_tp, d_tp, heads):
    rng = np.random.default_rng(p_tp * 10 + d_tp)
    g = rng.integers(0, 255, (SLOTS, OUTER, heads, INNER), dtype=np.uint8)
    remote, local = kv_pool(p_tp, 10**9, heads), kv_pool(d_tp, 2 * 10**9, heads)
    remote_mem = fill(remote, g)
    local_mem = {r.base_addr: np.zeros(SLOTS * local.slot_bytes, np.uint8) for r in local.ranks}
    src, dst = [5, 1, 2, 7], [0, 3, 4, 6]
    batches = plan_reads(local, remote, src, dst)
    apply(batches, local_mem, remote_mem)
    want = np.zeros_like(g)
    want[dst] = g[src]
    got = fill(local, want)
    for base in local_mem:
        assert np.array_equal(local_mem[base], got[base]), f"rank at {base}"
    ndesc = sum(len(b.local) for b in batches)
    if p_tp == d_tp:  # whole slots; (1,2),(2,3) coalesce on both sides -> 3 runs per rank
        assert ndesc == 3 * d_tp
    else:  # one descriptor per (slot, outer row, source rank) per local rank
        per_rank = max(1, (heads // d_tp) // max(1, heads // p_tp))  # source ranks per local rank
        assert ndesc == len(src) * OUTER * per_rank * d_tp


def test_coalescing_caps_and_validation():
    pool = PoolDesc("s", 64, 100, (RankRegion(4096),))
    (b,) = plan_reads(pool, pool, list(range(10, 20)), list(range(30, 40)))
    assert b.local.tolist() == [[4096 + 3000, 1000, 0]] and b.remote.tolist() == [
        [4096 + 1000, 1000, 0]
    ]
    (b,) = plan_reads(pool, pool, list(range(10, 20)), list(range(30, 40)), max_desc_bytes=400)
    assert b.local[:, 1].tolist() == [400, 400, 200] and b.nbytes == 1000
    with pytest.raises(PoolError):
        plan_reads(pool, pool, [63, 64], [0, 1])
    with pytest.raises(PoolError):
        plan_reads(pool, PoolDesc("s", 64, 100, (RankRegion(0), RankRegion(10**6))), [1], [1])
    with pytest.raises(PoolError):
        plan_reads(pool, PoolDesc("s", 64, 200, (RankRegion(0),)), [1], [1])
    rep1 = PoolDesc("r", 4, 8, (RankRegion(0),), replicated=True)
    rep2 = PoolDesc("r", 4, 8, (RankRegion(10**6), RankRegion(2 * 10**6)), replicated=True)
    (b,) = plan_reads(rep2, rep1, [1], [2])
    assert b.remote[:, 0].tolist() == [8, 8]  # both local ranks read the one remote copy
