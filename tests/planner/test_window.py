"""The planner's window of polls (pd/planner/window.py): the rate and lengths of a steady load,
a rise in the rate at once, longer prompts at once, and a phase of longer prompts at a lower
rate read as the same tokens a second, not more."""

from __future__ import annotations

import math
import random

import pytest

from pd.planner.window import Totals, windowed

POLL_S = 2.0


def polls(intervals: list[tuple[float, int]], output: int = 64) -> list[Totals]:
    """Totals at each poll of `POLL_S` intervals, each (arrivals a second, prompt tokens): each
    interval's prompts computed within it (nothing queued), `output` tokens each."""
    out = [Totals(0.0, 0, 0, 0, 0, 0.0, 0.0, 0)]
    for rate, prompt in intervals:
        last = out[-1]
        n = round(rate * POLL_S)
        out.append(
            Totals(
                last.at + POLL_S,
                last.arrivals + n,
                last.prefill_tokens + n * prompt,
                last.prefills_done + n,
                last.sampled_tokens + n * (output - 1),
                last.prefill_latency_s + n * 0.5,
                last.ttft_s + n * 0.7,
                last.ttfts + n,
            )
        )
    return out


def test_a_steady_load_reads_its_rate_and_lengths():
    got = windowed(polls([(4.0, 4000)] * 12))
    assert got.arrivals_per_s == pytest.approx(4.0)
    assert got.prompt_tokens == pytest.approx(4000)
    assert got.output_tokens == pytest.approx(64)
    assert got.ttft_overhead_s == pytest.approx(0.2)


def test_a_rise_in_the_rate_shows_at_once_and_a_fall_waits():
    rise = windowed(polls([(2.0, 4000)] * 9 + [(8.0, 4000)] * 3))
    assert rise.arrivals_per_s == pytest.approx(8.0)
    fall = windowed(polls([(8.0, 4000)] * 9 + [(2.0, 4000)] * 3))
    assert fall.arrivals_per_s == pytest.approx((8 * 9 + 2 * 3) / 12)


def test_one_polls_excess_is_not_a_rise_two_in_a_row_are():
    spike = windowed(polls([(4.0, 4000)] * 11 + [(20.0, 4000)]))  # beyond the noise, once
    assert spike.arrivals_per_s == pytest.approx((4 * 11 + 20) / 12)
    step = windowed(polls([(4.0, 4000)] * 10 + [(20.0, 4000)] * 2))
    assert step.arrivals_per_s == pytest.approx((4 + 20 + 20) / 3)


def test_a_steady_random_load_seldom_reads_as_a_rise():
    """Poisson arrivals at 4 a second, polls every 2 s, a window of 12: the last polls' count
    beyond two standard deviations twice in a row (a worker started for nothing) in fewer than
    1 poll in 1000 (one poll alone: 1 in 250)."""
    rng = random.Random(7)
    counts: list[int] = []
    risen = 0
    for _ in range(5000):
        counts = [*counts[-11:], _poisson(rng, 8.0)]
        totals = [Totals(0.0, 0, 0, 0, 0, 0.0, 0.0, 0)]
        for n in counts:
            last = totals[-1]
            totals.append(Totals(last.at + POLL_S, last.arrivals + n, 0, 0, 0, 0.0, 0.0, 0))
        got = windowed(totals).arrivals_per_s
        risen += got > sum(counts) / (POLL_S * len(counts)) + 1e-9
    assert risen < 5, risen


def _poisson(rng: random.Random, mean: float) -> int:
    """Knuth's: the arrivals of one poll."""
    limit, k, p = math.exp(-mean), 0, rng.random()
    while p > limit:
        k += 1
        p *= rng.random()
    return k


def test_longer_prompts_at_the_same_rate_show_at_once():
    got = windowed(polls([(2.0, 4000)] * 9 + [(2.0, 8000)] * 3))
    assert got.prompt_tokens == pytest.approx(8000)
    assert got.arrivals_per_s == pytest.approx(2.0)


def test_longer_prompts_at_a_lower_rate_keep_the_tokens_a_second():
    """4 a second of 4000 tokens, then 2 a second of 8000 (prefill-heavy at 4x's tokens): the
    same 16,000 tokens a second, not the window's 3.5 a second x 8000."""
    got = windowed(polls([(4.0, 4000)] * 9 + [(2.0, 8000)] * 3))
    assert got.prompt_tokens == pytest.approx(8000)
    assert got.arrivals_per_s * got.prompt_tokens == pytest.approx(16000, rel=0.05)


def test_prompts_queued_on_p_count_as_arrived():
    """Tokens that reached P but wait in its queue are tokens a second too."""
    steady = polls([(4.0, 4000)] * 9)
    queued = polls([(2.0, 8000)] * 3)
    backlog = 8000  # one prompt waits at the end
    tail = [
        Totals(
            steady[-1].at + t.at, steady[-1].arrivals + t.arrivals,
            steady[-1].prefill_tokens + t.prefill_tokens - (backlog if i == 3 else 0),
            steady[-1].prefills_done + t.prefills_done - (1 if i == 3 else 0),
            steady[-1].sampled_tokens + t.sampled_tokens, 0.0, 0.0, 0.0,
            backlog if i == 3 else 0,
        )
        for i, t in enumerate(queued) if i
    ]  # fmt: skip
    got = windowed(steady + tail)
    assert got.arrivals_per_s * got.prompt_tokens == pytest.approx(16000, rel=0.05)
