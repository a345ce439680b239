"""Kubernetes' Horizontal Pod Autoscaler (autoscaling/v2) as `pd-bench elastic`'s baseline, its
algorithm with its defaults: every `period_s` (15 s) desired = ceil(current x metric / target),
unchanged while the ratio is within `tolerance` (10%) of 1; a scale-up applies at once, a
scale-down only to the highest recommendation of the last `stabilization_s` (300 s); bounded
by min and max. Its metric here is running requests per worker (what a generic autoscaler sees:
requests, not tokens). Pure, on the caller's clock (the benchmark's modeled seconds)."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

PERIOD_S = 15.0
TOLERANCE = 0.1
STABILIZATION_S = 300.0


@dataclass
class HPA:
    target: float  # the metric's target value per worker
    min_replicas: int = 1
    max_replicas: int = 8
    tolerance: float = TOLERANCE
    stabilization_s: float = STABILIZATION_S
    recommendations: deque[tuple[float, int]] = field(default_factory=deque)

    def desired(self, now: float, current: int, metric_per_worker: float) -> int:
        """The replicas it sets now, from `current` ready ones and the metric's mean over them."""
        if current <= 0:
            return self.min_replicas
        ratio = metric_per_worker / self.target
        raw = current if abs(ratio - 1) <= self.tolerance else math.ceil(current * ratio)
        raw = min(max(raw, self.min_replicas), self.max_replicas)
        self.recommendations.append((now, raw))
        while self.recommendations and self.recommendations[0][0] < now - self.stabilization_s:
            self.recommendations.popleft()
        if raw >= current:
            return raw
        return min(current, max(r for _, r in self.recommendations))  # stabilized scale-down
