"""The simulated clock: a step ends when its modeled time (stretched by the time scale) is up, and
how far each step's real duration overshoots that is recorded, so a run can say whether this
machine kept up with the model.

`StepClock.finish(start, modeled_s)` sleeps until `start + time_scale * modeled_s` and records the
step: its modeled seconds, its real seconds (from `start` to the end of the sleep) and the
overshoot (`real - time_scale * modeled`; a step whose own Python work took longer than its
modeled time overshoots by that much, a step that slept overshoots by the sleep's lateness).

The clock also records the host gap: from one step's end to the next step's start, the engine's
own work between steps (scheduling, accepting tokens, streaming text) that the modeled time does
not include and that adds to every inter-token latency a client sees (gaps of `IDLE_GAP_S` or more
are taken as an idle engine and not counted). On a GPU the same engine spends that time too, on
a faster CPU; `--time-scale` K shrinks its share by about K.

Pure Python: the simulated runner calls it on its executor thread, `/health` and `/metrics` read
`stats()` from the event loop.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

OVERSHOOT_WINDOW = 1024  # steps the overshoot quantiles are taken over (the latest ones)
IDLE_GAP_S = 0.05  # a gap between steps this long or longer: the engine was idle


@dataclass(frozen=True)
class ClockStats:
    """What the clock has recorded: totals since start, overshoot quantiles over the window."""

    time_scale: float
    steps: int
    modeled_s: float  # the cost model's seconds of every step (unscaled)
    real_s: float  # the seconds the steps really took
    overshoot_p50_s: float
    overshoot_p99_s: float
    overshoot_max_s: float
    window: int  # steps the quantiles cover
    host_gap_p50_s: float = 0.0  # the engine's time between back-to-back steps
    host_gap_p99_s: float = 0.0

    def to_dict(self) -> dict[str, float | int]:
        return {
            "time_scale": self.time_scale,
            "steps": self.steps,
            "modeled_s": round(self.modeled_s, 6),
            "real_s": round(self.real_s, 6),
            "overshoot_p50_s": round(self.overshoot_p50_s, 6),
            "overshoot_p99_s": round(self.overshoot_p99_s, 6),
            "overshoot_max_s": round(self.overshoot_max_s, 6),
            "overshoot_window": self.window,
            "host_gap_p50_s": round(self.host_gap_p50_s, 6),
            "host_gap_p99_s": round(self.host_gap_p99_s, 6),
        }


class StepClock:
    def __init__(
        self,
        time_scale: float = 1.0,
        window: int = OVERSHOOT_WINDOW,
        *,
        now: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self.time_scale = time_scale
        self.now = now
        self._sleep = sleep
        self._lock = threading.Lock()
        self._steps = 0
        self._modeled = 0.0
        self._real = 0.0
        self._overshoot: deque[float] = deque(maxlen=window)
        self._gaps: deque[float] = deque(maxlen=window)
        self._last_end: float | None = None
        self.last_step_s = 0.0  # the latest step's device seconds (`finish`)

    def finish(self, start: float, modeled_s: float) -> float:
        """Sleep until `start + time_scale * modeled_s` (on the clock `now`), record the step and
        return its overshoot in seconds."""
        target = start + self.time_scale * modeled_s
        worked = self.now()
        remaining = target - worked
        if remaining > 0:
            self._sleep(remaining)
        end = self.now()
        # What the step took on the device: its scaled modeled time, or the step's own work
        # where that ran longer; the sleep's lateness (a host thread woken late) is not the
        # device's (the worker's step record reports this: engine/step_log.py).
        self.last_step_s = max(self.time_scale * modeled_s, worked - start)
        if self._last_end is not None and 0 <= start - self._last_end < IDLE_GAP_S:
            with self._lock:
                self._gaps.append(start - self._last_end)
        self._last_end = end
        return self.record(modeled_s, end - start)

    def record(self, modeled_s: float, real_s: float) -> float:
        overshoot = real_s - self.time_scale * modeled_s
        with self._lock:
            self._steps += 1
            self._modeled += modeled_s
            self._real += real_s
            self._overshoot.append(overshoot)
        return overshoot

    def stats(self) -> ClockStats:
        with self._lock:
            window = sorted(self._overshoot)
            gaps = sorted(self._gaps)
            steps, modeled, real = self._steps, self._modeled, self._real
        return ClockStats(
            self.time_scale,
            steps,
            modeled,
            real,
            _quantile(window, 0.5),
            _quantile(window, 0.99),
            window[-1] if window else 0.0,
            len(window),
            _quantile(gaps, 0.5),
            _quantile(gaps, 0.99),
        )


def _quantile(ordered: list[float], q: float) -> float:
    """Nearest rank of a sorted list (0 when empty)."""
    if not ordered:
        return 0.0
    rank = min(max(1, math.ceil(q * len(ordered))), len(ordered))
    return ordered[rank - 1]
