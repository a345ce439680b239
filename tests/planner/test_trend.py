"""The arrival rate's trend (pd/planner/trend.py) on seeded Poisson arrivals: a ramp reads as
one, ahead by the start-up; a steady load's noise almost never does."""

from __future__ import annotations

import random

import pytest

from pd.planner.trend import trend

POLL = 5.0


def polls(rate_at, seconds: float, seed: int) -> list[tuple[float, float]]:
    """(poll time, arrivals so far) every POLL seconds of a Poisson process at `rate_at(t)`
    (by thinning at the highest rate)."""
    rng = random.Random(seed)
    top = max(rate_at(t) for t in range(int(seconds) + 1))
    t, n, out, next_poll = 0.0, 0, [(0.0, 0.0)], POLL
    while True:
        t += rng.expovariate(top)
        while next_poll <= min(t, seconds):
            out.append((next_poll, float(n)))
            next_poll += POLL
        if t >= seconds:
            return out
        n += rng.random() * top < rate_at(t)


def test_a_ramp_reads_as_one_and_is_sized_ahead():
    # 2 to 8 requests a second over 240 s (the full trace's ramp at half its length), read at
    # its middle over a 120 s window
    ramp = polls(lambda t: 2.0 + 6.0 * t / 240, 120.0, seed=1)
    got = trend(ramp)
    assert got.slope == pytest.approx(6.0 / 240, rel=0.35)
    assert got.level == pytest.approx(5.0, rel=0.15)  # the rate now, not the window's mean
    ahead = got.ahead(36.0, sigmas=3.0)
    assert ahead is not None and ahead == pytest.approx(5.9, rel=0.15)


def test_a_steady_load_almost_never_reads_as_a_rise():
    rises = sum(
        trend(polls(lambda t: 4.0, 120.0, seed=s)).ahead(36.0, sigmas=3.0) is not None
        for s in range(200)
    )
    assert rises <= 2  # 3 standard deviations: 0.13% a window


def test_too_few_polls_say_nothing():
    got = trend([(0.0, 0.0), (5.0, 10.0)])
    assert got.level == 2.0 and got.ahead(30.0, 0.0) is None
