"""The prefill floor's queueing formula (pd/planner/queueing.py) against a simulation of the
queue it models: Poisson arrivals, fixed-length prefills, `c` workers, first come first served."""

from __future__ import annotations

import heapq
import random

import pytest

from pd.planner.queueing import erlang_c, servers_for, wait_beyond


def simulated_wait_beyond(c: int, rate: float, service: float, t: float, n: int = 40_000) -> float:
    rng = random.Random(7)
    free = [0.0] * c  # when each worker is next free
    now, late = 0.0, 0
    for i in range(n):
        now += rng.expovariate(rate)
        start = max(now, heapq.heappop(free))
        heapq.heappush(free, start + service)
        late += i > n // 10 and start - now > t  # after a warm-up
    return late / (n - n // 10 - 1)


@pytest.mark.parametrize(
    "c, load, t",
    [(1, 0.5, 0.5), (1, 0.73, 1.136), (2, 0.73, 1.136), (2, 0.85, 0.5), (3, 0.8, 0.3), (4, 0.73, 0.3)],
)
def test_the_wait_tail_is_the_simulated_queues_within_a_few_points(
    c: int, load: float, t: float
) -> None:
    service = 0.364  # 4000 tokens at 11k tokens a second
    rate = load * c / service
    got, want = wait_beyond(c, rate, service, t), simulated_wait_beyond(c, rate, service, t)
    assert abs(got - want) <= 0.04, (got, want)


def test_erlang_c_is_the_textbook_value() -> None:
    assert erlang_c(1, 0.6) == pytest.approx(0.6)  # M/M/1: the server is busy
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)
    assert erlang_c(3, 3.0) == 1.0 and erlang_c(2, 0.0) == 0.0


def test_servers_for_a_ttft_slo() -> None:
    s = 0.364
    assert servers_for(1.0, s, 1.5, 0.9, 8) == 1
    assert servers_for(2.0, s, 1.5, 0.9, 8) == 2  # one would be 73% busy: 13% of prompts late
    assert servers_for(4.0, s, 1.5, 0.9, 8) == 2
    assert servers_for(8.0, s, 1.5, 0.9, 8) == 4
    assert servers_for(8.0, s, 1.5, 0.9, 3) == 3  # at most `most`
    assert servers_for(0.0, s, 1.5, 0.9, 8) == 0
    # prompts longer than the SLO: enough to keep up, no more
    assert servers_for(2.0, 2.0, 1.5, 0.9, 8) == 5
