"""The planner's core (pd/planner) against a fluid model of a PD cluster on a fake clock: its fits
find the model's true costs, a constant load never turns it back and forth, a prefill-heavy load
grows prefill alone, a fall in load shrinks to what the last cool-down needed, and the
budget is shared."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import pytest

from pd.planner import (
    SLO,
    Bounds,
    Observation,
    Planner,
    PlannerKnobs,
    RateFit,
    StepFit,
    StepSample,
    WorkerSignals,
)
from pd.planner.queueing import servers_for
from pd.planner.trend import Trend

# The fluid cluster's true costs (a 70B-like decode step; seconds)
FIXED, PER_ROW, PER_KV = 0.012, 0.00005, 2e-8
PREFILL_RATE = 8000.0  # prompt tokens a busy second, per prefill worker
INTERVAL = 5.0  # seconds between observations


def true_step(rows: float, kv: float) -> float:
    return FIXED + PER_ROW * rows + PER_KV * kv


@dataclass
class Load:
    arrivals: float  # requests a second
    prompt: float = 2000.0
    output: float = 200.0


class Fluid:
    """A PD cluster as flows: prefill queues what its workers cannot compute; decode holds, by
    Little's law, the rows its step time implies (a fixed point)."""

    def __init__(self, prefill: int, decode: int) -> None:
        self.prefill, self.decode = prefill, decode
        self.queued = 0.0  # prompt tokens waiting, over all prefill workers

    def observe(self, at: float, load: Load) -> Observation:
        offered = load.arrivals * load.prompt * INTERVAL
        capacity = self.prefill * PREFILL_RATE * INTERVAL
        done = min(self.queued + offered, capacity)
        self.queued = self.queued + offered - done
        busy = done / PREFILL_RATE / self.prefill
        rows = 1.0
        for _ in range(50):  # rows in flight = arrivals x output x ITL, ITL at those rows
            kv = rows * (load.prompt + load.output / 2)
            rows = max(
                1.0, load.arrivals * load.output * true_step(rows / self.decode, kv / self.decode)
            )
        kv = rows * (load.prompt + load.output / 2)
        per_rows, per_kv = rows / self.decode, kv / self.decode
        # steps about the mean: batches of other sizes, and requests of other contexts
        samples = tuple(
            StepSample(
                max(1, round(per_rows * f)),
                round(per_kv * g),
                true_step(max(1, round(per_rows * f)), round(per_kv * g)),
            )
            for f, g in ((0.8, 1.1), (1.0, 1.0), (1.2, 0.9), (1.0, 0.7))
        )
        workers = [
            WorkerSignals(
                f"p{i}", "prefill", True, round(self.queued / self.prefill),
                prefill_tokens=round(done / self.prefill), prefill_busy_s=busy,
            )
            for i in range(self.prefill)
        ] + [
            WorkerSignals(f"d{i}", "decode", True, running=round(per_rows), kv_tokens=round(per_kv), steps=samples)
            for i in range(self.decode)
        ]  # fmt: skip
        return Observation(at, tuple(workers), load.arrivals, load.prompt, load.output)


def run(planner: Planner, fluid: Fluid, loads: list[Load], start: float = 0.0) -> float:
    """One observation per interval, the fluid cluster resized to each decision at once."""
    at = start
    for load in loads:
        d = planner.observe(fluid.observe(at, load))
        fluid.prefill, fluid.decode = d.prefill, d.decode
        at += INTERVAL
    return at


def minutes(m: float, load: Load) -> list[Load]:
    return [load] * int(m * 60 / INTERVAL)


SLOS = SLO(ttft_s=1.0, itl_s=0.05)


def test_the_step_fit_finds_a_linear_step():
    fit = StepFit()
    assert fit.predict(8, 1000) is None
    fit.add(StepSample(r, kv, true_step(r, kv)) for r in (1, 4, 16, 64) for kv in (1e3, 5e4, 4e5))
    assert fit.coefficients is not None
    for got, want in zip(fit.coefficients, (FIXED, PER_ROW, PER_KV)):
        assert got == pytest.approx(want, rel=0.01)
    assert fit.predict(32, 2e5) == pytest.approx(true_step(32, 2e5), rel=0.01)


def test_a_host_stall_of_a_few_seconds_does_not_move_the_step_fit():
    """A loaded host runs every step late for a while (§32 run 3: a stretch of late simulated
    steps read as decode cost, 4 D taken for 31 s): the fit keeps a minute of steps at one
    decode worker's pace (~60 a second), so a stall of 4 polls' steps is a few percent of them,
    which the trim drops. Delays only add, as a host's do."""
    rng = random.Random(7)

    def poll(n: int, late: float = 1.0) -> list[StepSample]:
        out = []
        for _ in range(n):
            rows = rng.randint(1, 48)
            kv = rows * rng.randint(500, 5000)
            out.append(StepSample(rows, kv, true_step(rows, kv) * late + rng.expovariate(2000)))
        return out

    fit = StepFit()
    for _ in range(30):  # a minute of 2-s polls at ~60 steps a second
        fit.add(poll(120))
    for _ in range(4):  # 8 s of a stalled host: every step 2.5x its cost
        fit.add(poll(120, late=2.5))
    assert fit.predict(32, 32 * 2500) == pytest.approx(true_step(32, 32 * 2500), rel=0.1)


def test_the_rate_fit_weighs_tokens_over_busy_time():
    fit = RateFit()
    assert fit.tokens_per_s is None
    fit.add(8000, 1.0)
    fit.add(0, 0.0)  # an idle report says nothing
    fit.add(4000, 0.5)
    assert fit.tokens_per_s == pytest.approx(8000)


def test_a_constant_load_for_ten_minutes_never_turns_back():
    """Ten minutes of constant metrics on a cluster that meets the SLOs: no change at all."""
    planner = Planner(SLOS)
    fluid = Fluid(prefill=3, decode=1)  # 16k prompt tokens a second offered, 24k computable
    run(planner, fluid, minutes(10, Load(arrivals=8.0)))
    assert {(d.prefill, d.decode) for d in planner.decisions} == {(3, 1)}
    assert planner.direction_changes == 0
    last = planner.decisions[-1]
    assert last.ttft_s is not None and last.ttft_s <= SLOS.ttft_s
    assert last.itl_s is not None and last.itl_s <= SLOS.itl_s
    # the fit is within 10% of the cluster's true step costs, off its operating point too
    for rows, kv in ((1, 1e4), (8, 1e5), (64, 1e6)):
        assert planner.step_fit.predict(rows, kv) == pytest.approx(true_step(rows, kv), rel=0.1)
    assert planner.rate_fit.tokens_per_s == pytest.approx(PREFILL_RATE, rel=0.01)


def test_an_undersized_cluster_grows_drains_its_backlog_and_then_holds():
    """From one worker each under a constant load: the arrivals' floor at once, a step more while
    the backlog drains, given back after the cool-down, then nothing for the rest of the run."""
    planner = Planner(SLOS)
    fluid = Fluid(prefill=1, decode=1)
    run(planner, fluid, minutes(10, Load(arrivals=12.0)))
    sizes = [(d.prefill, d.decode) for d in planner.decisions]
    assert sizes[0][0] >= 4  # 24k tokens a second at 8k a worker, 80% busy at most
    assert planner.direction_changes <= 1
    assert len(set(sizes[len(sizes) // 2 :])) == 1, "settled within five minutes"
    last = planner.decisions[-1]
    assert last.ttft_s is not None and last.ttft_s <= SLOS.ttft_s


def test_a_prefill_heavy_load_grows_prefill_alone():
    planner = Planner(SLOS)
    fluid = Fluid(prefill=2, decode=2)
    at = run(planner, fluid, minutes(3, Load(arrivals=4.0, prompt=1000, output=100)))
    before = planner.decisions[-1]
    run(planner, fluid, minutes(3, Load(arrivals=4.0, prompt=6000, output=100)), at)
    after = planner.decisions[-1]
    assert after.prefill > before.prefill
    assert after.decode <= before.decode + 1
    assert after.ttft_s is not None and after.ttft_s <= SLOS.ttft_s


def test_a_fall_in_load_shrinks_after_the_cooldown_to_what_it_needed_throughout():
    """A fall shrinks a role to the most workers any observation of the last cool-down needed
    (HPA's stabilized scale-down, on tokens): a cool-down after the peak's last observation to
    the level the load passed on its way down, a cool-down after that level's last to one."""
    knobs = PlannerKnobs(cooldown_s=60.0)
    planner = Planner(SLOS, knobs=knobs)
    fluid = Fluid(prefill=1, decode=1)
    at = run(planner, fluid, minutes(4, Load(arrivals=12.0)))
    peak = planner.decisions[-1]
    fell = at
    at = run(planner, fluid, minutes(0.5, Load(arrivals=6.0)), at)  # half the peak's, 30 s
    at = run(planner, fluid, minutes(8, Load(arrivals=1.0)), at)
    low = planner.decisions[-1]
    assert low.prefill == 1 and low.decode == 1 and peak.prefill >= 4
    changes = [
        (a, b)
        for a, b in zip(planner.decisions, planner.decisions[1:])
        if (b.prefill, b.decode) != (a.prefill, a.decode) and b.at >= fell
    ]
    prefill = [(b.at, b.prefill) for a, b in changes if b.prefill != a.prefill]
    assert len(prefill) == 2, prefill  # to the half load's need, then to one
    (first_at, first), (second_at, second) = prefill
    # each level goes a cool-down after the last observation that needed it: not sooner, and
    # not a cool-down after the change before (HPA's stabilization window, not a timer)
    last_peak = fell - INTERVAL  # the last observation at the peak
    last_half = fell + 30 - INTERVAL  # ... and at the half load
    assert first_at - last_peak == knobs.cooldown_s
    assert second_at - last_half == knobs.cooldown_s
    half = Planner(SLOS, knobs=knobs)
    half.rate_fit = planner.rate_fit
    assert first == max(2, half.floor(Fluid(first, 1).observe(0, Load(6.0)), "prefill", 1.1))
    assert second == 1 and first < peak.prefill
    assert planner.direction_changes <= 2  # one turn per role, up then down
    for d in planner.decisions:
        assert d.prefill >= 1 and d.decode >= 1


def test_the_budget_is_shared_and_the_role_further_from_its_slo_grows_first():
    planner = Planner(SLOS, Bounds(budget=4))
    fluid = Fluid(prefill=1, decode=1)
    run(planner, fluid, minutes(3, Load(arrivals=20.0, prompt=4000)))
    for d in planner.decisions:
        assert d.prefill + d.decode <= 4
    assert any("budget" in r for d in planner.decisions for r in d.reasons)
    last = planner.decisions[-1]
    assert last.prefill >= last.decode  # prefill is the one far from its SLO


def test_no_fit_yet_means_no_estimate_and_no_change():
    planner = Planner(SLOS)
    workers = (WorkerSignals("p", "prefill", True), WorkerSignals("d", "decode", True))
    d = planner.observe(Observation(0.0, workers))
    assert (d.prefill, d.decode, d.ttft_s, d.itl_s) == (1, 1, None, None)
    assert d.reasons == ("holds",) and planner.roles["prefill"].last_step == 0


def decode_worker(url: str, used: int, waiting: int = 0, ready: bool = True) -> WorkerSignals:
    steps = tuple(StepSample(r, 1000 * r, true_step(r, 1000 * r)) for r in (1, 2, 4))
    return WorkerSignals(url, "decode", ready, running=4, kv_tokens=4000, kv_pages_used=used,
                         kv_pages_total=100, kv_page_size=16, waiting_for_pages=waiting,
                         steps=steps)  # fmt: skip


def test_full_kv_pools_grow_decode_once_until_the_new_worker_is_ready():
    planner = Planner(SLO(ttft_s=60.0, itl_s=60.0), knobs=PlannerKnobs(cooldown_s=10.0))
    p = WorkerSignals("p", "prefill", True)
    once = planner.observe(Observation(0.0, (p, decode_worker("d1", 95))))
    assert once.decode == 1  # one observation is not a trend
    d = planner.observe(Observation(2.0, (p, decode_worker("d1", 95))))
    assert d.decode == 2 and "KV 95% full" in " ".join(d.reasons)
    # Its worker is still starting: the same pressure does not start another.
    assert planner.observe(Observation(5.0, (p, decode_worker("d1", 99, waiting=3)))).decode == 2
    two = (p, decode_worker("d1", 50), decode_worker("d2", 45))
    assert planner.observe(Observation(10.0, two)).decode == 2  # 95 of 100 pages on one: held
    low = (p, decode_worker("d1", 20), decode_worker("d2", 20))
    assert planner.observe(Observation(15.0, low)).decode == 2  # calm, but not for 10 s yet
    assert planner.observe(Observation(26.0, low)).decode == 1  # 40 of 100 on one: shrinks
    assert planner.direction_changes == 1


def test_the_decode_floor_waits_for_a_fit_with_a_slope():
    """Steps of one or two rows only: a slope from them is noise, so no floor from it."""
    planner = Planner(SLOS)
    few = tuple(StepSample(r, 4000 * r, 0.0145 + 0.004 * r) for r in (1, 2, 1, 2, 1))
    d = WorkerSignals("d", "decode", True, running=2, kv_tokens=8000, steps=few)
    obs = Observation(0.0, (WorkerSignals("p", "prefill", True), d), 4.0, 4000, 64)
    planner.observe(obs)
    assert not planner.step_fit.spread and planner.floor(obs, "decode") == 0
    wide = tuple(StepSample(r, 4000 * r, 0.0145 + 0.004 * r) for r in (1, 4, 8, 16))
    planner.step_fit.add(wide)
    assert planner.step_fit.spread and planner.floor(obs, "decode") >= 2


def test_a_load_at_the_floors_boundary_with_its_noise_never_turns_back():
    """Arrivals whose mean sits where the prefill floor goes from 2 workers to 3, read each poll
    with a Poisson window's noise (6%): the floor's dead band holds one size for ten minutes."""
    service = 2000 / PREFILL_RATE
    edge = next(
        x / 100 for x in range(100, 2000)
        if servers_for(x / 100, service, SLOS.ttft_s, 0.9, 8) == 3
    )  # fmt: skip
    rng = random.Random(3)
    loads = [Load(arrivals=edge * (1 + rng.gauss(0, 0.06))) for _ in range(int(600 / INTERVAL))]
    planner = Planner(SLOS)
    run(planner, Fluid(prefill=3, decode=1), loads)
    assert planner.direction_changes == 0, [
        d.line() for d in planner.decisions if d.reasons != ("holds",)
    ]
    assert planner.roles["prefill"].downs + planner.roles["prefill"].ups <= 1
    # without the band, the same noise turns it
    flappy = Planner(SLOS, knobs=PlannerKnobs(floor_band=0.0, cooldown_s=30.0))
    run(flappy, Fluid(prefill=3, decode=1), loads)
    assert flappy.direction_changes >= 1


def test_the_ttfts_part_outside_prefill_counts_in_the_estimate_and_the_floor():
    """What the router measures beyond P's queue and prefill (hops, the KV pull, D's first
    token) is added to the TTFT estimate and taken from the floor's slack; headroom sizes the
    floor for more arrivals than there are."""
    fluid = Fluid(prefill=2, decode=1)
    obs = fluid.observe(0.0, Load(arrivals=5.0))  # 2 P meet a 1 s TTFT, not a 0.4 s one
    planner = Planner(SLOS)
    planner.observe(obs)
    base_ttft, base_floor = planner.ttft(obs, 2), planner.floor(obs, "prefill")
    assert base_ttft is not None
    late = Observation(obs.at, obs.workers, obs.arrivals_per_s, obs.prompt_tokens,
                       obs.output_tokens, ttft_overhead_s=0.6)  # fmt: skip
    assert planner.ttft(late, 2) == pytest.approx(base_ttft + 0.6)
    service = obs.prompt_tokens / PREFILL_RATE
    assert planner.floor(late, "prefill") == servers_for(5.0, service, SLOS.ttft_s - 0.6, 0.9, 8)
    assert planner.floor(late, "prefill") > base_floor
    roomy = Planner(SLOS, knobs=PlannerKnobs(headroom=0.5))
    roomy.observe(obs)
    assert roomy.roles["prefill"].floor == servers_for(7.5, service, SLOS.ttft_s, 0.9, 8)
    assert roomy.roles["prefill"].floor > planner.roles["prefill"].floor
    # Sized for 99% of prompts in time, not 90%: at 6 a second 3 P, not 2
    six = Fluid(prefill=2, decode=1).observe(0.0, Load(arrivals=6.0))
    strict, loose = Planner(SLOS, knobs=PlannerKnobs(ttft_quantile=0.99)), Planner(SLOS)
    assert (strict.observe(six).prefill, loose.observe(six).prefill) == (3, 2)
    assert strict.roles["prefill"].floor == servers_for(6.0, service, SLOS.ttft_s, 0.99, 8)


def test_a_rising_trend_is_sized_a_start_up_ahead_only_when_asked():
    fluid = Fluid(prefill=2, decode=1)
    obs = fluid.observe(0.0, Load(arrivals=5.0))
    rising = replace(obs, trend=Trend(level=5.0, slope=0.1, sd=0.01))  # 5/s, +0.1/s a second
    service = obs.prompt_tokens / PREFILL_RATE
    ahead = Planner(SLOS, knobs=PlannerKnobs(forecast_s=30.0))
    d = ahead.observe(rising)
    assert ahead.roles["prefill"].floor == servers_for(8.0, service, SLOS.ttft_s, 0.9, 8) > 2
    assert d.prefill > 2 and any("rising" in r for r in d.reasons), d.reasons
    # not asked, or not sure: the rate there is
    assert Planner(SLOS).observe(rising).prefill == 2
    unsure = replace(obs, trend=Trend(level=5.0, slope=0.1, sd=0.05))
    assert Planner(SLOS, knobs=PlannerKnobs(forecast_s=30.0)).observe(unsure).prefill == 2
