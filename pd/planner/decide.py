"""How many prefill and decode workers: one decision per observation.

Per role, the estimate against the SLO, from tokens:

- prefill: a new request's TTFT with `n` prefill workers is the uncached prompt tokens queued on
  them spread over `n`, plus its own, over the fitted prefill rate (tokens a busy second), plus
  the TTFT's part no prefill worker serves (measured: the router's mean TTFT less P's);
- decode: the ITL with `n` decode workers is the fitted step time (`StepFit`) at the running rows
  and KV tokens spread over `n`.

The target is the largest of: the workers there are; a predictive floor, from the arrival rate
and mean lengths (prefill: the fewest workers that queueing (queueing.py, M/D/c) says meet the
TTFT SLO for `ttft_quantile` of the prompts, each prompt's prefill its mean tokens over the
fitted rate; decode: by Little's law the rows in flight if every request decodes at the
SLO's pace, and the fewest workers whose fitted step at those rows meets the ITL); and one worker
more when the estimate misses the SLO (a reactive step). The floor sizes for the arrivals x
(1 + `headroom`): a burst shorter than a worker's start-up is met only by workers already
there; and where the arrival rate's trend rises beyond 3 standard deviations (trend.py), it
sizes for the trend's line `forecast_s` (a start-up) ahead. The floor has a dead band
(`floor_band`): it grows a role when the arrivals less 10% need it, and lets a worker go only
when the arrivals plus 10% do not. A role shrinks to the most workers any observation of the
last `cooldown_s` needed (HPA's stabilization window, on tokens): an observation needs all the
workers there are (or more, where it grew them) unless its floor allowed fewer and the load
spread over them estimated within `down_margin` of the SLO, and then the fewest such. So a
constant load never turns it back and forth, and a fall is followed a cool-down behind it.
Bounds per role, and a budget of workers both roles share: when the two targets exceed it, the
role further from its SLO keeps its growth first.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass, field, replace

from pd.planner.fit import RateFit, StepFit
from pd.planner.queueing import servers_for
from pd.planner.signals import Observation

log = logging.getLogger("pd.planner")

ROLES = ("prefill", "decode")
DECISIONS_KEPT = 10_000  # the latest decisions a planner keeps (14 hours at one each 5 s)


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    itl_s: float


@dataclass(frozen=True)
class Bounds:
    min_prefill: int = 1
    max_prefill: int = 8
    min_decode: int = 1
    max_decode: int = 8
    budget: int = 16  # workers (GPUs, or cores here) both roles share

    def of(self, role: str) -> tuple[int, int]:
        return (
            (self.min_prefill, self.max_prefill)
            if role == "prefill"
            else (self.min_decode, self.max_decode)
        )


TTFT_QUANTILE = 0.9  # the share of prompts whose TTFT the prefill floor sizes for (queueing.py)


@dataclass(frozen=True)
class PlannerKnobs:
    cooldown_s: float = 60.0  # a role shrinks no sooner than this after its last change
    down_margin: float = 0.8  # one worker fewer must estimate within this share of the SLO
    ttft_quantile: float = TTFT_QUANTILE  # the share of prompts the prefill floor sizes for
    # The floor's dead band: it adds a worker when the arrivals less this share need it, and
    # lets one go only when the arrivals plus this share do not (a load at a boundary, and its
    # noise, never turn it back and forth)
    floor_band: float = 0.1
    # The floor sizes for the arrivals x (1 + headroom): workers kept ready for a burst shorter
    # than a start-up, and ahead of a ramp by the same share
    headroom: float = 0.0
    # A ramp sized ahead: where the arrival rate's trend rises beyond `trend_sigmas`, the floor
    # sizes for its line `forecast_s` ahead (a worker's start-up; 0: no forecast)
    forecast_s: float = 0.0
    trend_sigmas: float = 3.0
    kv_high: float = 0.9  # a decode role whose KV pools are fuller than this grows by one
    confirm: int = 2  # observations in a row that must miss the SLO before a reactive step


@dataclass(frozen=True)
class Decision:
    at: float
    prefill: int
    decode: int
    reasons: tuple[str, ...]
    ttft_s: float | None = None  # the estimates with the workers there were
    itl_s: float | None = None

    def line(self) -> str:
        """The decision's log line."""
        est = f"ttft {_fmt(self.ttft_s)} s, itl {_fmt(self.itl_s)} s"
        return (
            f"plan prefill={self.prefill} decode={self.decode} ({est}): {'; '.join(self.reasons)}"
        )


def _fmt(v: float | None) -> str:
    return "?" if v is None else f"{v:.3f}"


@dataclass
class _RoleState:
    target: int | None = None
    last_step: int = 0  # +1 or -1: the direction of its last change
    direction_changes: int = 0
    ups: int = 0  # decisions that grew it, and that shrank it
    downs: int = 0
    floor: int = 0  # the predictive floor of the last observation
    since: float = math.inf  # its first observation
    misses: int = 0  # observations in a row whose estimate missed the SLO
    # (at, workers it needed) of each observation of the last cool-down: a shrink goes to
    # their most (HPA's stabilization window)
    needs: deque[tuple[float, int]] = field(default_factory=deque)


class Planner:
    def __init__(
        self, slo: SLO, bounds: Bounds | None = None, knobs: PlannerKnobs | None = None
    ) -> None:
        self.slo = slo
        self.bounds = bounds or Bounds()
        self.knobs = knobs or PlannerKnobs()
        self.step_fit = StepFit()
        self.rate_fit = RateFit()
        self.roles = {r: _RoleState() for r in ROLES}
        self.decisions: list[Decision] = []
        self.last: Observation | None = None

    # ------------------------------------------------------------------------------ estimates

    def ttft(self, obs: Observation, n: int) -> float | None:
        """A new request's TTFT with `n` prefill workers (None: no rate fitted yet)."""
        rate = self.rate_fit.tokens_per_s
        if rate is None or n <= 0:
            return None
        queued = sum(w.queued_prefill_tokens for w in obs.of("prefill"))
        return (queued / n + obs.prompt_tokens) / rate + obs.ttft_overhead_s

    def itl(self, obs: Observation, n: int) -> float | None:
        """The decode step with the running load spread over `n` decode workers."""
        if n <= 0:
            return None
        ds = obs.of("decode")
        rows = sum(w.running for w in ds)  # none: the fit's fixed cost, an idle step's
        return self.step_fit.predict(rows / n, sum(w.kv_tokens for w in ds) / n)

    def kv_use(self, obs: Observation, n: int) -> float | None:
        """The decode workers' KV in use spread over `n` of their pools (None: not reported)."""
        ds = [w for w in obs.of("decode") if w.kv_pages_total]
        if not ds or n <= 0:
            return None
        pool = sum(w.kv_pages_total for w in ds) / len(ds)
        return sum(w.kv_pages_used for w in ds) / (n * pool)

    def floor(self, obs: Observation, role: str, load: float = 1.0) -> int:
        """The predictive floor: the workers the arrival rate (x `load`) and lengths need (0:
        unknown)."""
        if obs.arrivals_per_s <= 0:
            return 0
        if load != 1.0:
            obs = replace(obs, arrivals_per_s=obs.arrivals_per_s * load)
        if role == "prefill":
            rate = self.rate_fit.tokens_per_s
            if rate is None:
                return 0
            if obs.prompt_tokens <= 0:
                return 0
            _, most = self.bounds.of("prefill")
            service = obs.prompt_tokens / rate
            slack = self.slo.ttft_s - obs.ttft_overhead_s  # what P's queue and prefill may take
            return servers_for(obs.arrivals_per_s, service, slack, self.knobs.ttft_quantile, most)
        return self._decode_floor(obs)

    def _decode_floor(self, obs: Observation) -> int:
        """The fewest decode workers whose fitted step holds the ITL at the rows the arrivals
        keep in flight, and whose pools hold those rows' KV. By Little's law the rows are
        `arrivals x output tokens x step`, and the step grows with the rows per worker: with the
        fit's `a + (b + c x context) x rows / n`, the rows are `arrivals x output x a / (1 -
        arrivals x output x (b + c x context) / n)` (none: the load outruns n workers)."""
        if self.step_fit.coefficients is None or not self.step_fit.spread:
            return 0  # the slope is not known yet: the reactive steps decide
        a, b, c = self.step_fit.coefficients
        context = obs.prompt_tokens + obs.output_tokens / 2  # a row's mean KV tokens
        demand = obs.arrivals_per_s * obs.output_tokens  # tokens a second to decode
        pools = [w for w in obs.of("decode") if w.kv_pages_total and w.kv_page_size]
        pool = sum(w.kv_pages_total * w.kv_page_size for w in pools) / len(pools) if pools else None
        _, most = self.bounds.of("decode")
        for n in range(1, most + 1):
            spare = 1 - demand * (b + c * context) / n
            if spare <= 0:
                continue
            rows = demand * a / spare
            step = a + (b + c * context) * rows / n
            fits = pool is None or rows * context / n <= self.knobs.kv_high * pool
            if step <= self.slo.itl_s and fits:
                return n
        return most

    # ------------------------------------------------------------------------------ decision

    def observe(self, obs: Observation) -> Decision:
        """Take in `obs` (its reports feed the fits) and decide both roles' workers."""
        self.last = obs
        for w in obs.workers:
            if w.role == "prefill":
                self.rate_fit.add(w.prefill_tokens, w.prefill_busy_s)
        # every decode worker's steps, starting or draining too, in one refit a poll
        self.step_fit.add(s for w in obs.workers if w.role == "decode" for s in w.steps)
        reasons: list[str] = []
        want: dict[str, int] = {}
        pressure: dict[str, float] = {}
        estimates = {
            "prefill": (self.ttft, self.slo.ttft_s, "ttft"),
            "decode": (self.itl, self.slo.itl_s, "itl"),
        }
        now_est: dict[str, float | None] = {}
        sized, ahead = self._ahead(obs)
        for role in ROLES:
            state = self.roles[role]
            current = state.target
            if current is None:  # first sight: it shrinks only after a cool-down seen whole
                current = state.target = len([w for w in obs.workers if w.role == role])
                state.since = obs.at
            estimate, slo, name = estimates[role]
            low, high = self.bounds.of(role)
            est = estimate(obs, current)
            now_est[role] = est
            pressure[role] = (est / slo) if est is not None else 0.0
            target = max(current, low)
            load = 1 + self.knobs.headroom  # the arrivals x this, as `floor` takes them
            state.floor = self.floor(sized, role, load)
            band = self.knobs.floor_band
            grow = self.floor(sized, role, load * (1 - band))  # to grow: needed even at 1 - band
            if grow > target:
                target = grow
                reasons.append(f"{role}: the arrivals{ahead} need {grow}")
            floor = self.floor(sized, role, load * (1 + band))  # to shrink: not even at 1 + band
            # A reactive step waits for the last one: its worker is not ready yet (the load it
            # would take still shows on the others).
            settled = len(obs.of(role)) >= current
            full = self._kv_full(obs, current) if role == "decode" else None
            missed = (est is not None and est > slo) or full is not None
            state.misses = state.misses + 1 if missed else 0  # one noisy poll is not a trend
            if missed and state.misses >= self.knobs.confirm and target <= current and settled:
                target = current + 1
                why = (
                    f"{name} {est:.3f} s over {slo:.3f}" if est is not None and est > slo else full
                )
                reasons.append(f"{role}: {why}")
            fewest = (
                self._fewest(obs, role, max(low, floor), current) if target == current else None
            )
            # Stabilized as HPA's scale-down: to the most workers any observation of the last
            # cool-down needed (all there were, or more, where it could not do with fewer)
            state.needs.append((obs.at, target if fewest is None else fewest))
            while state.needs[0][0] <= obs.at - self.knobs.cooldown_s:
                state.needs.popleft()
            most = max(n for _, n in state.needs)
            if fewest is not None and most < current:
                if obs.at - state.since >= self.knobs.cooldown_s:  # a cool-down seen whole
                    target = most
                    fewer = estimate(obs, target)
                    assert fewer is not None
                    reasons.append(f"{role}: {target} would hold {name} {fewer:.3f} s")
            want[role] = min(max(target, low), high)
        self._within_budget(want, pressure, reasons)
        for role in ROLES:
            self._record(role, want[role])
        decision = Decision(
            obs.at,
            want["prefill"],
            want["decode"],
            tuple(reasons) or ("holds",),
            now_est["prefill"],
            now_est["decode"],
        )
        if reasons:
            log.info("%s", decision.line())
        self.decisions.append(decision)
        del self.decisions[:-DECISIONS_KEPT]
        return decision

    def _ahead(self, obs: Observation) -> tuple[Observation, str]:
        """`obs` with the arrival rate the floor sizes for: a rising trend's line a start-up
        ahead (`forecast_s`) where that is higher; and the words for a reason."""
        if self.knobs.forecast_s <= 0 or obs.trend is None:
            return obs, ""
        ahead = obs.trend.ahead(self.knobs.forecast_s, self.knobs.trend_sigmas)
        if ahead is None or ahead <= obs.arrivals_per_s:
            return obs, ""
        words = f" ({ahead:.2f}/s in {self.knobs.forecast_s:g} s, rising)"
        return replace(obs, arrivals_per_s=ahead), words

    def _fewest(self, obs: Observation, role: str, least: int, current: int) -> int | None:
        """The fewest workers, from `least`, below `current` whose estimate stays within
        `down_margin` of the SLO (and, for decode, whose pools hold the KV in use with that
        margin); None: not one fewer."""
        estimate, slo = (
            (self.ttft, self.slo.ttft_s) if role == "prefill" else (self.itl, self.slo.itl_s)
        )
        for n in range(max(least, 1), current):
            est = estimate(obs, n)
            if est is None:
                return None
            if est <= self.knobs.down_margin * slo and (role != "decode" or self._kv_room(obs, n)):
                return n
        return None

    def _kv_full(self, obs: Observation, n: int) -> str | None:
        """Why `n` decode workers' KV pools are too full (None: they are not)."""
        waiting = sum(w.waiting_for_pages for w in obs.of("decode"))
        if waiting:
            return f"{waiting} requests wait for KV pages"
        use = self.kv_use(obs, n)
        if use is not None and use > self.knobs.kv_high:
            return f"KV {use:.0%} full (over {self.knobs.kv_high:.0%})"
        return None

    def _kv_room(self, obs: Observation, n: int) -> bool:
        """Whether the KV in use fits `n` decode workers' pools with the shrink's margin."""
        use = self.kv_use(obs, n)
        return use is None or use <= self.knobs.down_margin * self.knobs.kv_high

    def _within_budget(
        self, want: dict[str, int], pressure: dict[str, float], reasons: list[str]
    ) -> None:
        """Trim the growth of the role nearer its SLO first, down to its workers there were."""
        while sum(want.values()) > self.bounds.budget:
            grown = [r for r in ROLES if want[r] > (self.roles[r].target or 0)]
            if not grown:
                break
            role = min(grown, key=lambda r: pressure[r])
            want[role] -= 1
            reasons.append(f"{role}: held back by the budget ({self.bounds.budget})")

    def _record(self, role: str, target: int) -> None:
        state = self.roles[role]
        before = state.target or 0
        if target == before:
            return
        step = 1 if target > before else -1
        if state.last_step and step != state.last_step:
            state.direction_changes += 1
        if step > 0:
            state.ups += 1
        else:
            state.downs += 1
        state.last_step, state.target = step, target

    @property
    def direction_changes(self) -> int:
        return sum(s.direction_changes for s in self.roles.values())
