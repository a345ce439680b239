"""Routing policies: plain Python over the workers' integers, no sockets.

A policy picks one worker among a pool's healthy ones, never one in `exclude` (the workers a
request already tried). It returns None when nothing is left. Each counts its decisions by kind
in `decisions` (exported as pd_router_policy_decisions_total).
"""

from __future__ import annotations

import hashlib
import random
import time
from abc import ABC, abstractmethod
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from pd.protocol import header_bytes
from pd.router.prefix_index import BLOCK_BYTES, PrefixIndex, PromptKey

if TYPE_CHECKING:
    from pd.router.config import RouterConfig
    from pd.router.worker import Worker


class Policy(ABC):
    name: str

    def __init__(self) -> None:
        self.decisions: dict[str, int] = {}

    def count(self, decision: str) -> None:
        self.decisions[decision] = self.decisions.get(decision, 0) + 1

    def rebuild(self, workers: Sequence[Worker]) -> None:  # noqa: B027 (optional hook)
        """Called when the pool's membership changes (not on health changes)."""

    @abstractmethod
    def choose(
        self,
        healthy: Sequence[Worker],
        key: str | None,
        exclude: Sequence[Worker] = (),
        prompt: PromptKey | None = None,
    ) -> Worker | None: ...


class RoundRobin(Policy):
    name = "round-robin"

    def __init__(self) -> None:
        super().__init__()
        self._next = 0

    def choose(
        self,
        healthy: Sequence[Worker],
        key: str | None = None,
        exclude: Sequence[Worker] = (),
        prompt: PromptKey | None = None,
    ) -> Worker | None:
        n = len(healthy)
        for i in range(n):
            w = healthy[(self._next + i) % n]
            if w not in exclude:
                self._next = (self._next + i + 1) % n
                self.count("next")
                return w
        return None


def cost(w: Worker) -> float:
    """The load of a worker, in one unit per role, from router counts and its own report.

    Prefill: estimated prompt tokens the router has in flight there plus the queued prefill tokens
    it reported. Decode (and co-located): active requests (the larger of the router's in-flight
    count and the reported running batch) plus queued ones, scaled up as its KV cache fills.
    """
    load = w.load
    if w.role == "prefill":
        return w.inflight_tokens + (load.queued_prefill_tokens if load else 0)
    if load is None:
        return w.inflight + 1.0
    active = max(w.inflight, load.running) + load.waiting + load.inflight_transfers
    return (active + 1.0) / max(1.0 - load.kv_usage, 0.01)


class LoadAware(Policy):
    """Power of two choices: the cheaper of two distinct random candidates."""

    name = "load-aware"

    def __init__(self, rng: random.Random | None = None) -> None:
        super().__init__()
        self._rng = rng or random.Random()

    def choose(
        self,
        healthy: Sequence[Worker],
        key: str | None = None,
        exclude: Sequence[Worker] = (),
        prompt: PromptKey | None = None,
    ) -> Worker | None:
        cands = [w for w in healthy if w not in exclude] if exclude else healthy
        n = len(cands)
        self.count("least_loaded_of_two")
        if n <= 1:
            return cands[0] if n else None
        rand = self._rng.random
        i = int(rand() * n)
        j = int(rand() * (n - 1))
        if j >= i:
            j += 1
        a, b = cands[i], cands[j]
        return b if cost(b) < cost(a) else a


def _hash(s: str) -> int:
    return int.from_bytes(hashlib.blake2b(header_bytes(s), digest_size=8).digest(), "big")


def room_id(key: str) -> bytes:
    """A room key as the table keeps it: 16 bytes, however long the client made the key
    (`X-Room-Id`, `user`, `session_id`). 128 bits: two rooms share a home only by collision."""
    return hashlib.blake2b(header_bytes(key), digest_size=16).digest()


# What one room costs in the table: its 16-byte id, its (worker, time) and the OrderedDict's
# entry, tracemalloc's figure rounded up (docs/EXPERIMENTS.md §23).
ROOM_BYTES = 240


class StickyToRoom(Policy):
    """Rooms keep their worker, so its caches hit: consistent hashing with bounded loads
    (Mirrokni, Thorup, Zadimoghaddam 2018) seeds a table of room -> home worker.

    A room's home is the first healthy worker clockwise from its key on a ring of virtual nodes,
    recorded in a table bounded in bytes (LRU, `max_bytes`; keys kept as `room_id` hashes) for
    `room_ttl_s` after its last request.
    A request goes home while home is healthy and its in-flight count stays within
    `load_factor * mean + slack` (mean over the pool's healthy workers, this request included;
    the slack keeps a few requests in flight from scattering rooms: a spill is a cache miss);
    a request over the bound walks on along the ring, and the room keeps its home, unless this
    was the room's first request there (new, or just moved): then the room's home is where the
    request landed, which now holds its KV. A room whose
    home dies, drains or leaves the pool moves once, to the next healthy worker on the ring,
    and stays there even when the old one comes back. No key: `fallback` decides.
    """

    name = "sticky-to-room"

    def __init__(
        self,
        load_factor: float = 1.25,
        vnodes: int = 64,
        fallback: Policy | None = None,
        room_ttl_s: float = 3600.0,
        max_bytes: int = 24 << 20,
        clock: Callable[[], float] = time.monotonic,
        slack: int = 4,
    ):
        assert load_factor >= 1.0, "load_factor below 1 can leave no worker under the bound"
        assert slack >= 1, "a slack below 1 can leave no worker under the bound"
        super().__init__()
        self.load_factor = load_factor
        self.slack = slack
        self.vnodes = vnodes
        self.fallback = fallback or LoadAware()
        self.room_ttl_s = room_ttl_s
        self.max_rooms = max(1, max_bytes // ROOM_BYTES)
        self._clock = clock
        self._points: list[int] = []
        self._owners: list[Worker] = []
        # room_id -> (home, last use)
        self._rooms: OrderedDict[bytes, tuple[Worker, float]] = OrderedDict()

    def rebuild(self, workers: Sequence[Worker]) -> None:
        ring = sorted(
            (_hash(f"{w.url}#{i}"), w.url, w) for w in workers for i in range(self.vnodes)
        )
        self._points = [p for p, _, _ in ring]
        self._owners = [w for _, _, w in ring]
        members = set(map(id, workers))
        for room in [r for r, (w, _) in self._rooms.items() if id(w) not in members]:
            del self._rooms[room]  # a removed worker's rooms find a new home

    @property
    def num_rooms(self) -> int:
        return len(self._rooms)

    def home_of(self, key: str) -> Worker | None:
        """The room's recorded home, if it has one that has not expired."""
        return self._home_of(room_id(key))

    def _home_of(self, room: bytes) -> Worker | None:
        entry = self._rooms.get(room)
        if entry is None or self._clock() - entry[1] > self.room_ttl_s:
            return None
        return entry[0]

    def _home(self, healthy: Sequence[Worker], room: bytes) -> tuple[Worker | None, bool]:
        """The room's home, and whether it had one already (False: new, or moved just now)."""
        home = self._home_of(room)
        settled = home is not None and home.healthy and home in healthy
        if not settled:
            self.count("new_home" if home is None else "moved_home")
            home = self._walk(healthy, room, lambda w: True)
        if home is not None:
            self._set_home(room, home)
        return home, settled

    def _set_home(self, room: bytes, home: Worker) -> None:
        self._rooms[room] = (home, self._clock())
        self._rooms.move_to_end(room)
        while len(self._rooms) > self.max_rooms:
            self._rooms.popitem(last=False)

    def _walk(
        self, healthy: Sequence[Worker], room: bytes, ok: Callable[[Worker], bool]
    ) -> Worker | None:
        owners = self._owners
        n = len(owners)
        start = bisect_left(self._points, int.from_bytes(room[:8], "big"))
        for k in range(n):
            w = owners[(start + k) % n]
            if w.healthy and w in healthy and ok(w):
                return w
        return None

    def bound(self, healthy: Sequence[Worker]) -> float:
        """Most in-flight requests a worker may hold after taking one more."""
        total = sum(w.inflight for w in healthy) + 1
        return self.load_factor * total / len(healthy) + self.slack

    def choose(
        self,
        healthy: Sequence[Worker],
        key: str | None = None,
        exclude: Sequence[Worker] = (),
        prompt: PromptKey | None = None,
    ) -> Worker | None:
        if key is None or not healthy:
            self.count("no_room_key")
            return self.fallback.choose(healthy, key, exclude, prompt)
        cap = self.bound(healthy)
        room = room_id(key)  # hashed once: the key may be long
        home, settled = self._home(healthy, room)
        if home is not None and home.inflight + 1 <= cap and home not in exclude:
            self.count("home")
            return home
        self.count("spill")  # home over the load bound, or tried already: the ring walks on
        w = self._walk(healthy, room, lambda w: w.inflight + 1 <= cap and w not in exclude)
        if w is None:
            # Everything on the ring is excluded, full or gone: the least loaded of what is left.
            left = [w for w in healthy if w not in exclude]
            w = min(left, key=lambda w: w.inflight) if left else None
        if w is not None and not settled:
            # A room's first request on a new home makes its home where it lands: its KV is
            # there now. A settled room keeps its home through a spill.
            self._set_home(room, w)
        return w


class CacheAware(Policy):
    """SGLang router's `cache_aware`: the worker expected to hold the longest prefix of the
    prompt, unless the pool's load is imbalanced; then, and when no worker is expected to hold
    at least `cache_threshold` of the prompt, load-aware.

    Expected holdings come from the router's `PrefixIndex`. The pool is imbalanced when the most
    and least loaded healthy candidates (the router's in-flight requests on them) differ by more
    than `balance_abs` and the most loaded has more than `balance_rel` times the least. Among
    equal matches the less loaded worker wins.
    """

    name = "cache-aware"

    def __init__(
        self,
        index: PrefixIndex,
        balance_abs: int = 64,
        balance_rel: float = 1.5,
        cache_threshold: float = 0.3,
        fallback: Policy | None = None,
    ) -> None:
        super().__init__()
        self.index = index
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.cache_threshold = cache_threshold
        self.fallback = fallback or LoadAware()

    def imbalanced(self, cands: Sequence[Worker]) -> bool:
        loads = [w.inflight for w in cands]
        hi, lo = max(loads), min(loads)
        return hi - lo > self.balance_abs and hi > self.balance_rel * lo

    def choose(
        self,
        healthy: Sequence[Worker],
        key: str | None = None,
        exclude: Sequence[Worker] = (),
        prompt: PromptKey | None = None,
    ) -> Worker | None:
        cands = [w for w in healthy if w not in exclude] if exclude else list(healthy)
        if not cands:
            return None
        if prompt is None or not prompt.blocks or not self.index.enabled:
            self.count("short_prompt")  # under one block: nothing to match
            return self.fallback.choose(cands, key, (), prompt)
        if len(cands) > 1 and self.imbalanced(cands):
            self.count("imbalanced")
            return self.fallback.choose(cands, key, (), prompt)
        best, best_n = cands[0], -1
        for w in cands:
            n = self.index.match(w.url, prompt.blocks)
            if n > best_n or (n == best_n and w.inflight < best.inflight):
                best, best_n = w, n
        if best_n > 0 and best_n * BLOCK_BYTES >= self.cache_threshold * len(prompt.data):
            self.count("cache_hit")
            return best
        self.count("no_match")
        return self.fallback.choose(cands, key, (), prompt)


# The registry of policies: name -> how a pool's policy is built from the router's flags and the
# pool's prefix index (config.POLICIES names them for --policy; a test keeps the two equal).
BUILDERS: dict[str, Callable[[RouterConfig, PrefixIndex], Policy]] = {
    RoundRobin.name: lambda cfg, index: RoundRobin(),
    LoadAware.name: lambda cfg, index: LoadAware(),
    StickyToRoom.name: lambda cfg, index: StickyToRoom(
        cfg.sticky_load_factor,
        room_ttl_s=cfg.sticky_room_ttl_s,
        slack=cfg.sticky_slack,
        max_bytes=cfg.sticky_room_table_bytes,
    ),
    CacheAware.name: lambda cfg, index: CacheAware(
        index, cfg.cache_balance_abs, cfg.cache_balance_rel, cfg.cache_threshold
    ),
}


def make_policy(name: str, cfg: RouterConfig, index: PrefixIndex) -> Policy:
    """The policy `name` (a key of BUILDERS) of one pool."""
    build = BUILDERS.get(name)
    if build is None:
        raise ValueError(f"unknown policy {name!r} (known: {', '.join(BUILDERS)})")
    return build(cfg, index)
