"""Policies as plain Python over integers: no sockets."""

from __future__ import annotations

import random
from collections import Counter

from pd.protocol import WorkerLoad
from pd.router.policies import (
    ROOM_BYTES,
    CacheAware,
    LoadAware,
    RoundRobin,
    StickyToRoom,
    cost,
    room_id,
)
from pd.router.prefix_index import BLOCK_BYTES, PrefixIndex, PromptKey, chain
from pd.router.worker import Worker


def workers(n: int, role: str = "decode") -> list[Worker]:
    ws = [Worker(f"http://w{i}:8000", role) for i in range(n)]
    for w in ws:
        w.healthy = True
    return ws


def load(role="decode", running=0, waiting=0, queued=0, free=100) -> WorkerLoad:
    return WorkerLoad(role, running, waiting, queued, 100, free)


def test_round_robin_order_and_exclusion():
    ws = workers(3)
    rr = RoundRobin()
    assert [rr.choose(ws, None).url for _ in range(6)] == [w.url for w in ws * 2]
    assert rr.choose(ws, None, exclude=[ws[0]]) is ws[1]
    assert rr.choose(ws, None, exclude=ws) is None
    assert rr.choose([], None) is None


def test_load_aware_picks_the_less_loaded_of_two():
    ws = workers(2)
    ws[0].load = load(running=10)
    la = LoadAware(random.Random(0))
    assert all(la.choose(ws, None) is ws[1] for _ in range(50))
    ws[1].inflight = 20  # the router's own count, fresher than the report
    assert all(la.choose(ws, None) is ws[0] for _ in range(50))
    assert la.choose(ws, None, exclude=[ws[0]]) is ws[1]
    assert la.choose(ws, None, exclude=ws) is None


def test_load_aware_spreads_over_many_workers():
    ws = workers(8)
    la = LoadAware(random.Random(1))
    for _ in range(800):  # requests that stay: power of two keeps the spread tight
        la.choose(ws, None).acquire(1)
    counts = [w.inflight for w in ws]
    assert max(counts) - min(counts) <= 4, counts


def test_cost_units_per_role():
    p = Worker("http://p", "prefill")
    p.inflight_tokens = 100
    p.load = load("prefill", queued=900)
    assert cost(p) == 1000  # tokens: in flight here plus queued there
    d = Worker("http://d", "decode")
    d.load = load(running=3, waiting=1, free=50)
    assert cost(d) == (3 + 1 + 1) / 0.5  # KV half full doubles the cost
    d.inflight = 9  # more than it reported: the router's count wins
    assert cost(d) == (9 + 1 + 1) / 0.5
    d.load = load(free=0)  # a full KV cache is as good as unusable
    assert cost(d) > 50


def rooms(n: int) -> list[str]:
    return [f"room-{i}" for i in range(n)]


def test_sticky_rooms_are_stable_and_spread():
    ws = workers(4)
    st = StickyToRoom()
    st.rebuild(ws)
    first = {k: st.choose(ws, k) for k in rooms(400)}
    assert all(st.choose(ws, k) is w for k, w in first.items())
    spread = Counter(w.url for w in first.values())
    assert len(spread) == 4 and min(spread.values()) > 40, spread


def test_sticky_hot_room_is_bounded():
    ws = workers(4)
    st = StickyToRoom(load_factor=1.25, slack=2)
    st.rebuild(ws)
    for i in range(40):  # one room, 40 concurrent requests
        w = st.choose(ws, "hot")
        w.acquire(1)
        mean = sum(x.inflight for x in ws) / len(ws)
        assert w.inflight <= 1.25 * mean + 2, (i, [x.inflight for x in ws])
    assert max(x.inflight for x in ws) <= 1.25 * 10 + 2
    home = st._walk(ws, room_id("hot"), lambda w: True)  # the room's home on the ring
    assert home.inflight == max(x.inflight for x in ws)


def test_the_slack_keeps_a_few_requests_in_flight_from_scattering_a_room():
    ws = workers(2)
    st = StickyToRoom(load_factor=1.25, slack=4)
    st.rebuild(ws)
    home = st.choose(ws, "r")
    # With h in flight at home and none elsewhere, home takes one more while
    # h + 1 <= 1.25 * (h + 1) / 2 + 4, that is up to h = 9 (with a slack of 1: h = 1).
    for _ in range(9):
        home.acquire(1)
        assert st.choose(ws, "r") is home
    home.acquire(1)
    assert st.choose(ws, "r") is not home and st.home_of("r") is home


def test_a_new_room_over_the_bound_makes_its_home_where_it_lands():
    ws = workers(2)
    st = StickyToRoom(load_factor=1.0, slack=1)
    st.rebuild(ws)
    ring_home = st.choose(ws, "settled")  # an idle pool: the ring's home, now settled
    other = ws[1] if ring_home is ws[0] else ws[0]
    for _ in range(3):
        ring_home.acquire(1)  # busy: over the bound for anyone
    new = next(k for k in rooms(200) if st._walk(ws, room_id(k), lambda w: True) is ring_home)
    assert st.choose(ws, new) is other
    assert st.home_of(new) is other  # its first request landed there: so did its KV
    assert st.choose(ws, "settled") is other
    assert st.home_of("settled") is ring_home  # a settled room keeps its home through a spill
    for _ in range(3):
        ring_home.release(1)
    assert st.choose(ws, new) is other and st.choose(ws, "settled") is ring_home


def test_sticky_removal_moves_only_its_rooms():
    ws = workers(5)
    st = StickyToRoom()
    st.rebuild(ws)
    keys = rooms(1000)
    before = {k: st.choose(ws, k) for k in keys}
    gone = ws[2]
    rest = [w for w in ws if w is not gone]
    st.rebuild(rest)
    after = {k: st.choose(rest, k) for k in keys}
    moved = [k for k in keys if after[k] is not before[k]]
    assert moved and all(before[k] is gone for k in moved)
    assert len(moved) == sum(1 for k in keys if before[k] is gone)


def test_sticky_room_moves_once_when_its_worker_dies_and_stays():
    """A room whose worker is ejected moves to the next one and stays there, also once the old
    one is back (its caches now hold the room's KV)."""
    ws = workers(3)
    st = StickyToRoom()
    st.rebuild(ws)
    home = st.choose(ws, "r")
    home.healthy = False
    healthy = [w for w in ws if w.healthy]
    other = st.choose(healthy, "r")
    assert other is not home and other.healthy
    home.healthy = True
    assert all(st.choose(ws, "r") is other for _ in range(5))
    assert st.home_of("r") is other


def test_sticky_over_the_bound_goes_elsewhere_but_keeps_its_home():
    ws = workers(3)
    st = StickyToRoom(load_factor=1.0, slack=1)
    st.rebuild(ws)
    home = st.choose(ws, "r")
    home.inflight = 5  # bound: (5 + 1) / 3 + 1 = 3
    elsewhere = st.choose(ws, "r")
    assert elsewhere is not home and st.home_of("r") is home
    home.inflight = 0
    assert st.choose(ws, "r") is home


def test_sticky_table_expires_is_bounded_and_forgets_removed_workers():
    now = [0.0]
    ws = workers(3)
    st = StickyToRoom(room_ttl_s=10.0, max_bytes=50 * ROOM_BYTES, clock=lambda: now[0])
    st.rebuild(ws)
    home = st.choose(ws, "r")
    home.healthy = False
    moved = st.choose([w for w in ws if w.healthy], "r")
    home.healthy = True
    now[0] = 5.0
    assert st.choose(ws, "r") is moved  # used at 5 s: kept until 15 s
    now[0] = 16.0
    assert st.home_of("r") is None and st.choose(ws, "r") is home  # expired: the ring's home
    for k in rooms(200):
        st.choose(ws, k)
    assert st.num_rooms == 50 and st.home_of("room-199") is not None
    assert st.home_of("room-0") is None  # the least recently used rooms went first
    keep = [w for w in ws if w is not home]
    st.rebuild(keep)
    assert all(st.home_of(k) is not home for k in rooms(200))


def test_sticky_without_key_falls_back_to_load_aware():
    ws = workers(2)
    ws[0].inflight = 5
    st = StickyToRoom(fallback=LoadAware(random.Random(0)))
    st.rebuild(ws)
    assert all(st.choose(ws, None) is ws[1] for _ in range(20))
    assert st.choose(ws, "k", exclude=ws) is None


# ------------------------------------------------------------------------------ cache-aware


def cached(index: PrefixIndex, w: Worker, data: bytes) -> None:
    index.insert(w.url, chain(data))


def test_cache_aware_routes_to_the_longest_expected_match():
    index = PrefixIndex()
    ca = CacheAware(index, fallback=RoundRobin())
    ws = workers(3)
    system = b"s" * (20 * BLOCK_BYTES)
    cached(index, ws[1], system[: 10 * BLOCK_BYTES])
    cached(index, ws[2], system)
    prompt = PromptKey.of(system + b"new question")
    assert all(ca.choose(ws, None, (), prompt) is ws[2] for _ in range(5))
    # Tried already: the next longest match.
    assert ca.choose(ws, None, [ws[2]], prompt) is ws[1]
    assert ca.decisions["cache_hit"] == 6
    # Equal matches: the less loaded one.
    cached(index, ws[1], system)
    ws[2].acquire(1)
    assert ca.choose(ws, None, (), prompt) is ws[1]
    assert ca.choose(ws, None, ws, prompt) is None


def test_cache_aware_acts_as_its_fallback_below_the_threshold_and_for_short_prompts():
    index = PrefixIndex()
    ca = CacheAware(index, cache_threshold=0.5, fallback=RoundRobin())
    ws = workers(2)
    data = b"d" * (10 * BLOCK_BYTES)
    cached(index, ws[1], data[: 4 * BLOCK_BYTES])  # 40% of the prompt: under 0.5
    picks = [ca.choose(ws, None, (), PromptKey.of(data)) for _ in range(4)]
    assert picks == [ws[0], ws[1], ws[0], ws[1]]  # round robin, the fallback
    assert ca.decisions == {"no_match": 4}
    cached(index, ws[1], data[: 5 * BLOCK_BYTES])  # 50%: at the threshold it counts
    assert ca.choose(ws, None, (), PromptKey.of(data)) is ws[1]
    assert ca.choose(ws, None, (), PromptKey.of(b"short")) is not None
    assert ca.decisions["short_prompt"] == 1
    assert ca.choose(ws, None, (), None) is not None  # no prompt at all: the fallback


def test_cache_aware_balances_when_load_is_imbalanced():
    index = PrefixIndex()
    ca = CacheAware(index, balance_abs=4, balance_rel=1.5, fallback=LoadAware(random.Random(0)))
    ws = workers(2)
    data = b"c" * (10 * BLOCK_BYTES)
    cached(index, ws[0], data)
    prompt = PromptKey.of(data)
    for _ in range(5):
        ws[0].acquire(1)  # 5 vs 0: more than 4 apart and more than 1.5x
    assert ca.choose(ws, None, (), prompt) is ws[1]
    assert ca.decisions["imbalanced"] == 1
    ws[1].acquire(1)
    ws[1].acquire(1)  # 5 vs 2: 3 apart, within balance_abs: the cache wins again
    assert ca.choose(ws, None, (), prompt) is ws[0]
    for _ in range(20):
        ws[0].acquire(1)
        ws[1].acquire(1)  # 25 vs 22: far apart in absolute terms, but within 1.5x
    assert ca.choose(ws, None, (), prompt) is ws[0]


def test_every_policy_flag_has_a_builder_and_each_builds_its_own_kind():
    from pd.router.config import POLICIES, RouterConfig
    from pd.router.policies import BUILDERS, make_policy

    assert set(BUILDERS) == set(POLICIES)
    cfg = RouterConfig(sticky_load_factor=1.5, sticky_slack=7, cache_threshold=0.6)
    index = PrefixIndex()
    for name in POLICIES:
        assert make_policy(name, cfg, index).name == name
    sticky = make_policy("sticky-to-room", cfg, index)
    assert isinstance(sticky, StickyToRoom) and (sticky.load_factor, sticky.slack) == (1.5, 7)
    cache = make_policy("cache-aware", cfg, index)
    assert isinstance(cache, CacheAware) and cache.index is index and cache.cache_threshold == 0.6
    try:
        make_policy("random", cfg, index)
    except ValueError as e:
        assert "unknown policy 'random'" in str(e)
    else:
        raise AssertionError("an unknown policy was built")
