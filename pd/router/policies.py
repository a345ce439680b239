"""Routing policies: plain Python over the workers' integers, no sockets.

A policy picks one worker among a pool's healthy ones, never one in `exclude` (the workers a
request already tried). It returns None when nothing is left.
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

if TYPE_CHECKING:
    from pd.router.worker import Worker


class Policy(ABC):
    name: str

    def rebuild(self, workers: Sequence[Worker]) -> None:  # noqa: B027 (optional hook)
        """Called when the pool's membership changes (not on health changes)."""

    @abstractmethod
    def choose(
        self, healthy: Sequence[Worker], key: str | None, exclude: Sequence[Worker] = ()
    ) -> Worker | None: ...


class RoundRobin(Policy):
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, healthy, key=None, exclude=()):
        n = len(healthy)
        for i in range(n):
            w = healthy[(self._next + i) % n]
            if w not in exclude:
                self._next = (self._next + i + 1) % n
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
        self._rng = rng or random.Random()

    def choose(self, healthy, key=None, exclude=()):
        cands = [w for w in healthy if w not in exclude] if exclude else healthy
        n = len(cands)
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
    return int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "big")


class StickyToRoom(Policy):
    """Rooms keep their worker, so its caches hit: consistent hashing with bounded loads
    (Mirrokni, Thorup, Zadimoghaddam 2018) seeds a table of room -> home worker.

    A room's home is the first healthy worker clockwise from its key on a ring of virtual nodes,
    recorded in a bounded table (LRU, `max_rooms`) for `room_ttl_s` after its last request.
    A request goes home while home is healthy and its in-flight count stays within
    `load_factor * mean + 1` (mean over the pool's healthy workers, this request included);
    a request over the bound walks on along the ring, and the room keeps its home. A room whose
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
        max_rooms: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ):
        assert load_factor >= 1.0, "load_factor below 1 can leave no worker under the bound"
        self.load_factor = load_factor
        self.vnodes = vnodes
        self.fallback = fallback or LoadAware()
        self.room_ttl_s = room_ttl_s
        self.max_rooms = max_rooms
        self._clock = clock
        self._points: list[int] = []
        self._owners: list[Worker] = []
        self._rooms: OrderedDict[str, tuple[Worker, float]] = OrderedDict()  # home, last use

    def rebuild(self, workers):
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
        entry = self._rooms.get(key)
        if entry is None or self._clock() - entry[1] > self.room_ttl_s:
            return None
        return entry[0]

    def _home(self, healthy: Sequence[Worker], key: str) -> Worker | None:
        home = self.home_of(key)
        if home is None or not home.healthy or home not in healthy:
            home = self._walk(healthy, key, lambda w: True)
        if home is not None:
            self._rooms[key] = (home, self._clock())
            self._rooms.move_to_end(key)
            while len(self._rooms) > self.max_rooms:
                self._rooms.popitem(last=False)
        return home

    def _walk(
        self, healthy: Sequence[Worker], key: str, ok: Callable[[Worker], bool]
    ) -> Worker | None:
        owners = self._owners
        n = len(owners)
        start = bisect_left(self._points, _hash(key))
        for k in range(n):
            w = owners[(start + k) % n]
            if w.healthy and w in healthy and ok(w):
                return w
        return None

    def bound(self, healthy: Sequence[Worker]) -> float:
        """Most in-flight requests a worker may hold after taking one more."""
        total = sum(w.inflight for w in healthy) + 1
        return self.load_factor * total / len(healthy) + 1

    def choose(self, healthy, key=None, exclude=()):
        if key is None or not healthy:
            return self.fallback.choose(healthy, key, exclude)
        cap = self.bound(healthy)
        home = self._home(healthy, key)
        if home is not None and home.inflight + 1 <= cap and home not in exclude:
            return home
        w = self._walk(healthy, key, lambda w: w.inflight + 1 <= cap and w not in exclude)
        if w is not None:
            return w
        # Everything on the ring is excluded, full or gone: the least loaded of what is left.
        left = [w for w in healthy if w not in exclude]
        return min(left, key=lambda w: w.inflight) if left else None


def make_policy(name: str, load_factor: float = 1.25, room_ttl_s: float = 3600.0) -> Policy:
    if name == "round-robin":
        return RoundRobin()
    if name == "load-aware":
        return LoadAware()
    if name == "sticky-to-room":
        return StickyToRoom(load_factor, room_ttl_s=room_ttl_s)
    raise ValueError(f"unknown policy {name!r}")
