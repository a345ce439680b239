"""A rising arrival rate read ahead: the trend of the rate over the polls, and how sure it is.

A ramp needs workers before it arrives: a new one takes its start-up to be ready, and the
window's mean rate lags a ramp by half the window. Each poll interval's rate (its arrivals over
its length) is fitted against the interval's midpoint by least squares, each weighted by its
length; a Poisson count's variance is its mean, so an interval's rate has variance `rate /
length`, and the slope's standard deviation is `sqrt(rate / Sxx)`. The planner reads a slope only
beyond `sigmas` of that (a steady load's noise never reads as a ramp) and then sizes for the
line's value a start-up ahead. Pure."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Trend:
    level: float  # the fitted rate at the last poll (requests a second)
    slope: float  # requests a second, a second
    sd: float  # the slope's standard deviation (inf: too few polls)

    def ahead(self, seconds: float, sigmas: float) -> float | None:
        """The fitted rate `seconds` after the last poll, where the slope rises beyond `sigmas`
        standard deviations (None: no rise that sure)."""
        if not self.slope > sigmas * self.sd:
            return None
        return self.level + self.slope * seconds


def trend(points: Sequence[tuple[float, float]]) -> Trend:
    """The trend of the rate over `points`: (seconds, arrivals counted since any fixed start),
    oldest first."""
    points = list(points)
    xs: list[float] = []
    ys: list[float] = []
    ws: list[float] = []
    for (t0, a0), (t1, a1) in zip(points, points[1:]):
        if t1 > t0:
            xs.append((t0 + t1) / 2)
            ys.append((a1 - a0) / (t1 - t0))
            ws.append(t1 - t0)
    total = sum(ws)
    if len(xs) < 3:
        mean = sum(w * y for w, y in zip(ws, ys)) / total if total else 0.0
        return Trend(mean, 0.0, math.inf)
    xbar = sum(w * x for w, x in zip(ws, xs)) / total
    ybar = sum(w * y for w, y in zip(ws, ys)) / total
    sxx = sum(w * (x - xbar) ** 2 for w, x in zip(ws, xs))
    slope = sum(w * (x - xbar) * (y - ybar) for w, x, y in zip(ws, xs, ys)) / sxx
    rate = max(ybar, 1.0 / total)  # at least one arrival over the span, for the noise
    level = ybar + slope * (points[-1][0] - xbar)
    return Trend(level, slope, math.sqrt(rate / sxx))
