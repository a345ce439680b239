"""The planner's online fits, from what workers report: a decode step's time as a linear function
of its rows and the KV tokens they attend to (`StepFit`: a roofline step is weights' bytes, plus
per-row and per-KV-token work, which is linear in both), and a prefill worker's rate in prompt
tokens a busy second (`RateFit`). Each is exported as metrics, so that its error against a
simulated profile's true costs can be read."""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable

from pd.planner.signals import StepSample

# Decode steps a fit keeps, the most recent (a worker's costs may drift): about a minute of one
# decode worker's steps (~60 a second), so that a loaded host's few seconds of late steps are a
# few percent of them, which the trim drops (512, eight seconds, let one read a step 2.4x its
# cost: EXPERIMENTS §32 run 3, §33)
WINDOW = 4096
SPREAD_ROWS = 4  # distinct batch sizes before the fit's slope is extrapolated (`spread`)
SPREAD_MAX_ROWS = 8
TRIM_MADS = 3.0  # a step this many median absolute deviations over the fit ran late (`_trimmed`)
RIDGE = 1e-9  # keeps the normal equations solvable when a sample's columns are collinear


class StepFit:
    """seconds ~ fixed + per_row * rows + per_kv_token * kv_tokens, least squares over the last
    `window` samples (coefficients at least 0)."""

    def __init__(self, window: int = WINDOW) -> None:
        self.samples: deque[StepSample] = deque(maxlen=window)
        self.coefficients: tuple[float, float, float] | None = None

    def add(self, samples: Iterable[StepSample]) -> None:
        new = [s for s in samples if s.rows > 0 and s.seconds > 0]
        if not new:
            return  # nothing new: the coefficients stand
        self.samples.extend(new)
        if len(self.samples) >= 3:
            self.coefficients = _trimmed(list(self.samples))

    @property
    def spread(self) -> bool:
        """Whether its samples span enough batch sizes (`SPREAD_ROWS` distinct, up to at least
        `SPREAD_MAX_ROWS`) for a slope to be read off them: at a few rows a step is its fixed
        cost plus noise, and an extrapolation from there is the noise's."""
        rows = {s.rows for s in self.samples}
        return len(rows) >= SPREAD_ROWS and max(rows, default=0) >= SPREAD_MAX_ROWS

    def predict(self, rows: float, kv_tokens: float) -> float | None:
        """A step's seconds at `rows` rows over `kv_tokens` KV tokens; None before 3 samples."""
        if self.coefficients is None:
            return None
        fixed, per_row, per_kv = self.coefficients
        return fixed + per_row * rows + per_kv * kv_tokens


def _trimmed(samples: list[StepSample]) -> tuple[float, float, float]:
    """Least squares, then again without the steps that ran late: a measured step is its cost
    plus the host's delays (a thread waiting for the GIL, a loaded machine), which only ever add,
    and a few long ones would tilt the slopes. Dropped: residuals above the median by more than
    `TRIM_MADS` median absolute deviations."""
    coef = _least_squares(samples)
    residuals = [s.seconds - _at(coef, s) for s in samples]
    mid = statistics.median(residuals)
    mad = statistics.median(abs(r - mid) for r in residuals)
    kept = [s for s, r in zip(samples, residuals) if r <= mid + TRIM_MADS * mad]
    return _least_squares(kept) if 3 <= len(kept) < len(samples) else coef


def _at(coef: tuple[float, float, float], s: StepSample) -> float:
    return coef[0] + coef[1] * s.rows + coef[2] * s.kv_tokens


def _least_squares(samples: Iterable[StepSample]) -> tuple[float, float, float]:
    """The normal equations of [1, rows, kv] -> seconds, solved by Gaussian elimination, with
    the columns scaled to comparable sizes first; negative coefficients clipped to 0."""
    raw = [(1.0, float(s.rows), float(s.kv_tokens)) for s in samples]
    ys = [s.seconds for s in samples]
    scale = [max(1.0, max(abs(x[j]) for x in raw)) for j in range(3)]
    xs = [[x[j] / scale[j] for j in range(3)] for x in raw]
    a = [
        [sum(x[i] * x[j] for x in xs) + (RIDGE if i == j else 0.0) for j in range(3)]
        for i in range(3)
    ]
    b = [sum(x[i] * y for x, y in zip(xs, ys)) for i in range(3)]
    for col in range(3):  # elimination with partial pivoting
        pivot = max(range(col, 3), key=lambda r: abs(a[r][col]))
        a[col], a[pivot], b[col], b[pivot] = a[pivot], a[col], b[pivot], b[col]
        for r in range(col + 1, 3):
            f = a[r][col] / a[col][col]
            a[r] = [a[r][k] - f * a[col][k] for k in range(3)]
            b[r] -= f * b[col]
    coef = [0.0, 0.0, 0.0]
    for r in (2, 1, 0):
        coef[r] = (b[r] - sum(a[r][k] * coef[k] for k in range(r + 1, 3))) / a[r][r]
    fixed, per_row, per_kv = (max(0.0, coef[j] / scale[j]) for j in range(3))
    return fixed, per_row, per_kv


class RateFit:
    """Prompt tokens a prefill worker computes a busy second: the tokens over the busy time of
    every report so far, each report weighted down by `decay` at each new one."""

    def __init__(self, decay: float = 0.9) -> None:
        self.decay = decay
        self._tokens = 0.0
        self._seconds = 0.0

    def add(self, tokens: float, busy_s: float) -> None:
        if busy_s <= 0:
            return
        self._tokens = self._tokens * self.decay + tokens
        self._seconds = self._seconds * self.decay + busy_s

    @property
    def tokens_per_s(self) -> float | None:
        return self._tokens / self._seconds if self._seconds > 0 else None
