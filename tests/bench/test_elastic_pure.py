"""`pd-bench elastic`'s pure parts: the load trace's arrivals follow each phase's rate (a ramp's
rising), and HPA v2's algorithm scales up at once past its tolerance and down only to the highest
recommendation of its stabilization window; the controllers' seconds shrink with the phases; a
bad `--fixed` split is refused."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import pytest

from pd.bench.elastic.cpu import CpuWatch, busy_share
from pd.bench.elastic.hpa import HPA
from pd.bench.elastic.run import (
    FULL_PHASE_SCALE,
    Run,
    Sample,
    Variant,
    add_arguments,
    fewest,
    fixed_candidates,
    given_split,
    given_splits,
    hpa_seconds,
    meets_peak,
    phase_scale_of,
    phases_of,
    planner_seconds,
    planner_variants,
    spares_of,
    stagger_of,
    startup_of,
    summary,
    with_variant,
)
from pd.bench.elastic.trace import Phase, arrivals, bounds, full, quick, scaled


def test_arrivals_follow_each_phases_rate_and_a_ramp_rises():
    phases = [
        Phase("a", 2000, 1.0, 100, 10),
        Phase("b", 2000, 4.0, 100, 10),
        Phase("ramp", 2000, 0.0, 100, 10, ramp=True),
    ]
    got = arrivals(phases, seed=1)
    assert got == sorted(got) and got == arrivals(phases, seed=1)  # ordered, seeded
    counts = [sum(1 for _, i in got if i == k) for k in range(3)]
    assert counts[0] == pytest.approx(2000, rel=0.1)
    assert counts[1] == pytest.approx(8000, rel=0.05)
    assert counts[2] == pytest.approx(4000, rel=0.07)  # from 4 down to 0: the mean is 2
    first_half = sum(1 for t, i in got if i == 2 and t < 5000)
    assert first_half == pytest.approx(3000, rel=0.07)  # a falling ramp: 3/4 in its first half
    assert bounds(phases) == [(0, 2000), (2000, 4000), (4000, 6000)]


def test_the_traces_hold_what_the_issue_asks():
    names = [p.name for p in full(1.0, 4000, 64)]
    assert {"ramp-4x", "hold-4x", "burst-8x", "prefill-heavy", "decode-heavy"} <= set(names)
    burst = next(p for p in full(1.0, 4000, 64) if p.name == "burst-8x")
    assert burst.rate == 8.0 and burst.seconds == 60
    constant = next(p for p in full(1.0, 4000, 64) if p.name == "constant-2x")
    assert constant.seconds >= 600 and constant.plateau
    assert [p.rate for p in quick(1.0, 4000, 64)] == [1.0, 4.0, 1.0]
    short = scaled(full(1.0, 4000, 64), 0.2)
    assert sum(p.seconds for p in short) == pytest.approx(
        0.2 * sum(p.seconds for p in full(1.0, 4000, 64))
    )


def test_hpa_scales_up_at_once_and_down_only_after_its_window():
    hpa = HPA(target=10, min_replicas=1, max_replicas=8)
    assert hpa.desired(0, 2, 10.5) == 2  # within 10%: unchanged
    assert hpa.desired(15, 2, 25) == 5  # ceil(2 x 2.5)
    assert hpa.desired(30, 5, 2) == 5  # down to 1 recommended, but 5 was, 15 s ago
    assert hpa.desired(300, 5, 2) == 5
    assert hpa.desired(316, 5, 2) == 1  # 300 s since the last recommendation of 5
    assert hpa.desired(330, 1, 100) == 8  # bounded


@pytest.mark.parametrize("text", ["0,1", "2", "x,1", "1,2,3"])
def test_a_bad_fixed_split_is_refused_before_anything_starts(text):
    proc = subprocess.run(
        [sys.executable, "-m", "pd.bench.cli", "elastic", "--setups", "fixed", "--fixed", text],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and "--fixed" in proc.stderr, proc.stderr
    assert given_split("3,1") == (3, 1)


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_the_full_trace_is_shrunk_as_a_whole_by_default_and_the_others_are_not():
    full_args = _args()
    assert phase_scale_of(full_args) == FULL_PHASE_SCALE
    assert sum(p.seconds for p in phases_of(full_args)) == pytest.approx(
        FULL_PHASE_SCALE * sum(p.seconds for p in full(1.0, 4000, 64))
    )
    # the start-up shrinks with the phases: a phase keeps its length in start-ups
    assert startup_of(full_args) == pytest.approx(
        FULL_PHASE_SCALE * startup_of(_args("--phase-scale", "1"))
    )
    assert startup_of(_args("--startup-s", "36")) == 36
    assert phase_scale_of(_args("--quick")) == 1.0 and startup_of(_args("--quick")) == 5.0
    assert phase_scale_of(_args("--trace", "plateau")) == 1.0


def test_the_controllers_seconds_shrink_with_the_phases_unless_given():
    """The planner's interval, window and cool-down and HPA's period and stabilization are the
    trace's seconds too: x the phase scale (the defaults at 1), as given when given."""
    f = FULL_PHASE_SCALE
    assert planner_seconds(_args()) == pytest.approx((5 * f, 60 * f, 60 * f))
    assert hpa_seconds(_args()) == pytest.approx((15 * f, 300 * f))
    assert planner_seconds(_args("--phase-scale", "1")) == (5.0, 60.0, 60.0)
    assert hpa_seconds(_args("--phase-scale", "1")) == (15.0, 300.0)
    assert planner_seconds(_args("--cooldown-s", "45", "--interval-s", "3")) == (3.0, 45.0, 36.0)
    assert hpa_seconds(_args("--hpa-stabilization-s", "200")) == pytest.approx((15 * f, 200))
    assert planner_seconds(_args("--quick")) == (2.0, 10.0, 24.0)
    assert hpa_seconds(_args("--quick")) == (15.0, 300.0)


def test_the_fixed_splits_tried_and_the_one_that_meets_the_peak():
    assert given_splits("5,1/4,1/4,1") == [(4, 1), (5, 1)]  # smallest first, once each
    assert given_splits("3,1/2,2") == [(2, 2), (3, 1)]  # fewest workers, then fewer prefill
    with pytest.raises(ValueError):
        given_splits("4,1/x")
    assert fixed_candidates(_args("--fixed", "5,1"), []) == [(5, 1)]
    phases = [Phase("hold", 60, 4.0, 100, 10), Phase("ramp", 60, 8.0, 100, 10, ramp=True),
              Phase("burst", 60, 8.0, 100, 10)]  # fmt: skip
    got = {"phases": {"hold": {"attainment": 0.95}, "ramp": {"attainment": 0.2},
                      "burst": {"attainment": 0.9}}}  # fmt: skip
    assert meets_peak(got, phases)  # a ramp is not held
    got["phases"]["burst"]["attainment"] = 0.89
    assert not meets_peak(got, phases)


def test_setups_at_once_start_a_burst_apart():
    full_args = _args()
    burst = next(p for p in phases_of(full_args) if p.name == "burst-8x")
    assert stagger_of(full_args, phases_of(full_args)) == pytest.approx(1.25 * burst.seconds)
    slower = _args("--time-scale", "2")
    assert stagger_of(slower, phases_of(slower)) == pytest.approx(2.5 * burst.seconds)  # real s
    assert stagger_of(_args("--stagger-s", "0"), phases_of(full_args)) == 0


def test_the_cpu_watch_reads_the_share_of_all_cores_busy(tmp_path):
    assert busy_share((100, 400), (250, 600)) == pytest.approx(0.75)
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal
    stat.write_text("cpu  100 0 100 700 100 0 0 0 0 0\ncpu0 ...\n")
    with CpuWatch(window_s=0.05, path=str(stat)) as cpu:
        time.sleep(0.1)
        stat.write_text("cpu  250 0 250 800 100 0 0 0 0 0\n")  # 300 busy of 400 more
        time.sleep(0.15)
    got = cpu.summary()
    assert got is not None and got["mean"] == pytest.approx(0.75)
    assert got["max_window"] == pytest.approx(0.75) and got["over_limit"]
    assert CpuWatch(path=str(tmp_path / "none")).__enter__().summary() is None
    assert cpu.summary(since=time.time() + 60) is None  # no window began that late
    # the windows from `since` on only: the set-ups before the loads are not the measure
    cpu.windows = [(100.0, 90, 100), (110.0, 30, 100), (120.0, 50, 100)]
    cpu.started = 85.0
    late = cpu.summary(since=100.0)
    assert late is not None and late["mean"] == pytest.approx(0.4)
    assert late["max_window"] == pytest.approx(0.5) and not late["over_limit"]
    assert late["from_s"] == 15.0
    assert (late["max_window_end_s"], late["windows_over_limit"], late["windows"]) == (20.0, 0, 2)
    assert cpu.summary()["windows_over_limit"] == 1  # the first, 90% busy
    # ... and those that ended by `until`: the tear-downs after the loads are not either
    early = cpu.summary(since=100.0, until=115.0)
    assert early is not None and early["windows"] == 1 and early["mean"] == pytest.approx(0.3)


def test_turns_are_counted_by_phase_and_within_a_phase():
    """A move into a phase that follows the load is no turn within it; a reversal after a move
    of the same phase is (the issue's "direction changes per plateau")."""
    phases = [Phase("a", 100, 1.0, 100, 10), Phase("b", 100, 2.0, 100, 10)]
    sizes = [(0, 1), (50, 2), (110, 1), (150, 2), (170, 3), (190, 2)]  # (at, prefill)
    run = Run("planner", samples=[
        Sample(at, {"prefill": p, "decode": 1}, {"prefill": p, "decode": 1}) for at, p in sizes
    ])  # fmt: skip
    got = summary(run, _args(), phases)
    assert (got["scale_ups"], got["scale_downs"]) == (3, 2)
    assert got["direction_changes"] == 3
    assert got["direction_changes_per_phase"] == {"b": 3}
    assert got["direction_changes_within_phase"] == {"b": 2}  # 110's down followed the load


def test_several_headrooms_are_a_planner_each():
    assert _args().headroom == [0.25]
    assert _args("--headroom", "0.25,1").headroom == [0.25, 1.0]
    for bad in ("-1", "a", ","):
        with pytest.raises(SystemExit):
            _args("--headroom", bad)


def test_spares_cover_a_roles_growth_unless_given():
    assert spares_of(_args()) == 5  # 1 to 6 workers a role
    assert spares_of(_args("--max-prefill", "9")) == 8
    assert spares_of(_args("--quick")) == 5 and spares_of(_args("--spares", "0")) == 0


def test_headrooms_and_quantiles_pair_into_planners():
    assert planner_variants(_args()) == [Variant(0.25, 0.9)]
    assert planner_variants(_args("--headroom", "0.25,1")) == [
        Variant(0.25, 0.9),
        Variant(1.0, 0.9),
    ]
    both = _args("--headroom", "0.25,1", "--ttft-quantile", "0.9,0.99")
    assert planner_variants(both) == [Variant(0.25, 0.9), Variant(1.0, 0.99)]
    assert planner_variants(_args("--ttft-quantile", "0.9,0.99")) == [
        Variant(0.25, 0.9), Variant(0.25, 0.99),
    ]  # fmt: skip
    with pytest.raises(ValueError, match="--headroom has 2 values and --ttft-quantile 3"):
        planner_variants(_args("--headroom", "0,1", "--ttft-quantile", "0.5,0.9,0.99"))
    assert [v.name for v in planner_variants(both)] == [
        "headroom 0.25", "headroom 1 quantile 0.99",
    ]  # fmt: skip
    for bad in ("1", "0", "x"):
        with pytest.raises(SystemExit):
            _args("--ttft-quantile", bad)


def test_a_planner_spec_adds_a_planner_with_its_own_knobs():
    args = _args("--planner", "headroom=1,quantile=0.99,cooldown-s=120,min-prefill=2",
                 "--planner", "quantile=0.99")  # fmt: skip
    first, own, plain = planner_variants(args)
    assert first == Variant(0.25, 0.9)
    assert own == Variant(1.0, 0.99, 120.0, 2)
    assert own.name == "headroom 1 quantile 0.99 cool-down 120 s min-prefill 2"
    assert plain == Variant(0.25, 0.99)  # keys not given: the first planner's
    one = with_variant(args, own)
    assert (one.headroom, one.ttft_quantile, one.cooldown_s, one.min_prefill) == (
        [1.0],
        [0.99],
        120.0,
        2,
    )
    assert (args.cooldown_s, args.min_prefill) == (None, 1)  # the run's, for the others
    assert planner_seconds(one)[1] == 120.0 and planner_seconds(args)[1] == 60 * 0.4
    assert fewest(one) == (2, 1) and fewest(args) == (1, 1)
    for bad in (
        "headroom=-1",
        "quantile=1",
        "min-prefill=1.5",
        "speed=2",
        "headroom",
        "cooldown-s=x",
    ):
        with pytest.raises(SystemExit):
            _args("--planner", bad)
    with pytest.raises(ValueError, match="two planners are the same"):
        planner_variants(_args("--planner", "headroom=0.25"))
