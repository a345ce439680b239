"""Routing policies: plain Python over the workers' integers, no sockets.

A policy picks one worker among a pool's healthy ones, never one in `exclude` (the workers a
request already tried). It returns None when nothing is left.
"""

from __future__ import annotations

import hashlib
import random
from abc import ABC, abstractmethod
from bisect import bisect_left
from collections.abc import Sequence
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
    """Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018).

    A room key hashes onto a ring of virtual nodes; walking clockwise, the first healthy worker
    whose in-flight count stays within `load_factor * mean + 1` (mean over the pool's healthy
    workers, this request included) takes it. Without load, a room always lands on the same
    worker, and removing a worker moves only the rooms it owned. No key: `fallback` decides.
    """

    name = "sticky-to-room"

    def __init__(self, load_factor: float = 1.25, vnodes: int = 64, fallback: Policy | None = None):
        assert load_factor >= 1.0, "load_factor below 1 can leave no worker under the bound"
        self.load_factor = load_factor
        self.vnodes = vnodes
        self.fallback = fallback or LoadAware()
        self._points: list[int] = []
        self._owners: list[Worker] = []

    def rebuild(self, workers):
        ring = sorted(
            (_hash(f"{w.url}#{i}"), w.url, w) for w in workers for i in range(self.vnodes)
        )
        self._points = [p for p, _, _ in ring]
        self._owners = [w for _, _, w in ring]

    def bound(self, healthy: Sequence[Worker]) -> float:
        """Most in-flight requests a worker may hold after taking one more."""
        total = sum(w.inflight for w in healthy) + 1
        return self.load_factor * total / len(healthy) + 1

    def choose(self, healthy, key=None, exclude=()):
        if key is None or not healthy:
            return self.fallback.choose(healthy, key, exclude)
        cap = self.bound(healthy)
        owners = self._owners
        n = len(owners)
        start = bisect_left(self._points, _hash(key))
        for k in range(n):
            w = owners[(start + k) % n]
            if w.healthy and w.inflight + 1 <= cap and w not in exclude and w in healthy:
                return w
        # Everything on the ring is excluded, full or gone: the least loaded of what is left.
        left = [w for w in healthy if w not in exclude]
        return min(left, key=lambda w: w.inflight) if left else None


def make_policy(name: str, load_factor: float = 1.25) -> Policy:
    if name == "round-robin":
        return RoundRobin()
    if name == "load-aware":
        return LoadAware()
    if name == "sticky-to-room":
        return StickyToRoom(load_factor)
    raise ValueError(f"unknown policy {name!r}")
