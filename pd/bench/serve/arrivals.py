"""When requests start: open loop (Poisson or uniform inter-arrival at a rate), or a trace's own
timestamps. Closed loop (a fixed number of clients) has no schedule: see `runner.py`."""

from __future__ import annotations

import random

ARRIVALS = ("poisson", "uniform")


def arrival_times(n: int, rate: float, kind: str, rng: random.Random) -> list[float]:
    """Start times (seconds from the run's start) of `n` jobs at `rate` per second."""
    if rate <= 0:
        raise ValueError(f"a rate must be > 0, got {rate}")
    if kind not in ARRIVALS:
        raise ValueError(f"unknown arrival process {kind!r}: choose from {', '.join(ARRIVALS)}")
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += rng.expovariate(rate) if kind == "poisson" else 1.0 / rate
    return times
