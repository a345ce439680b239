"""The simulated step clock: sleeps to the scaled modeled time, counts and ranks the overshoot."""

from __future__ import annotations

import pytest

from pd.sim.clock import StepClock


class FakeTime:
    def __init__(self) -> None:
        self.t = 10.0
        self.slept: list[float] = []
        self.late = 0.0  # how much later than asked each sleep wakes

    def now(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.t += s + self.late


def test_a_step_sleeps_until_its_scaled_modeled_time_and_records_the_overshoot():
    ft = FakeTime()
    clock = StepClock(4.0, now=ft.now, sleep=ft.sleep)
    start = ft.t
    ft.t += 0.001  # the step's own work
    ft.late = 0.0002
    over = clock.finish(start, 0.01)
    assert ft.slept == [pytest.approx(0.039)]  # 4 x 10 ms, less the work already done
    assert over == pytest.approx(0.0002)
    s = clock.stats()
    assert (s.steps, s.modeled_s, s.real_s) == (1, 0.01, pytest.approx(0.0402))
    assert s.overshoot_max_s == pytest.approx(0.0002) and s.time_scale == 4.0


def test_work_longer_than_the_modeled_time_is_an_overshoot_without_a_sleep():
    ft = FakeTime()
    clock = StepClock(1.0, now=ft.now, sleep=ft.sleep)
    start = ft.t
    ft.t += 0.05
    assert clock.finish(start, 0.01) == pytest.approx(0.04) and ft.slept == []


def test_quantiles_are_over_a_bounded_window_of_the_latest_steps():
    clock = StepClock(1.0, window=100)
    for i in range(300):  # the first 200 (large) fall out of the window
        clock.record(0.0, 1.0 if i < 200 else (i - 200) / 1000)
    s = clock.stats()
    assert s.steps == 300 and s.window == 100
    assert s.overshoot_p50_s == pytest.approx(0.049)
    assert s.overshoot_p99_s == pytest.approx(0.098)
    assert s.overshoot_max_s == pytest.approx(0.099)
    assert StepClock().stats().overshoot_p99_s == 0.0  # nothing recorded yet
    d = s.to_dict()
    assert d["steps"] == 300 and d["overshoot_window"] == 100


def test_the_real_clock_sleeps_about_the_scaled_time():
    clock = StepClock(2.0)
    start = clock.now()
    clock.finish(start, 0.02)
    took = clock.now() - start
    assert 0.04 <= took < 0.04 + 0.05, took
    assert 0 <= clock.stats().overshoot_max_s <= took - 0.04


def test_time_scale_must_be_positive():
    with pytest.raises(ValueError):
        StepClock(0.0)


def test_the_host_gap_between_back_to_back_steps_is_recorded_and_idle_time_is_not():
    ft = FakeTime()
    clock = StepClock(1.0, now=ft.now, sleep=ft.sleep)
    for gap in (0.002, 0.004, 5.0, 0.003):  # 5 s: the engine was idle, not busy between steps
        ft.t += gap
        clock.finish(ft.t, 0.01)
    s = clock.stats()
    assert (s.host_gap_p50_s, s.host_gap_p99_s) == (pytest.approx(0.003), pytest.approx(0.004))
    assert s.to_dict()["host_gap_p99_s"] == 0.004
