"""The machine's CPU while `pd-bench elastic` runs: the share of all cores busy, sampled from
`/proc/stat` every few seconds in a thread; the mean and the busiest window. Setups run at once
on a few cores share them, and a simulated worker whose host is starved answers late, which no
GPU would (the issue's rule: raise `--time-scale` past 70%)."""

from __future__ import annotations

import threading
import time
from typing import Any

WINDOW_S = 10.0
LIMIT = 0.7  # busier than this, the figures are the machine's, not the modeled GPUs'


def _times(path: str = "/proc/stat") -> tuple[float, float] | None:
    """(busy, total) jiffies of all cores, or None where there is no /proc/stat."""
    try:
        with open(path) as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    total = sum(fields[:8])  # guest time is counted in user already
    return total - idle, total


def busy_share(before: tuple[float, float], after: tuple[float, float]) -> float:
    """The share of all cores busy between two samples."""
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total > 0 else 0.0


class CpuWatch:
    """`with CpuWatch() as cpu: ...`, then `cpu.summary()`."""

    def __init__(self, window_s: float = WINDOW_S, path: str = "/proc/stat") -> None:
        self.window_s = window_s
        self.path = path
        # (its end, `time.time()`; busy and all jiffies of all cores)
        self.windows: list[tuple[float, float, float]] = []
        self.started = time.time()
        self._first: tuple[float, float] | None = None
        self._last: tuple[float, float] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-watch", daemon=True)

    def __enter__(self) -> CpuWatch:
        self.started = time.time()
        self._first = self._last = _times(self.path)
        if self._first is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._sample()

    def _run(self) -> None:
        while not self._stop.wait(self.window_s):
            self._sample()

    def _sample(self) -> None:
        now = _times(self.path)
        if now is None or self._last is None:
            return
        self.windows.append((time.time(), now[0] - self._last[0], now[1] - self._last[1]))
        self._last = now

    def summary(
        self, since: float | None = None, until: float | None = None
    ) -> dict[str, Any] | None:
        """The mean share busy and the busiest window's, of the windows that began at `since`
        (`time.time()`) or later and ended by `until` (None: all; None returned: not measured
        here)."""
        start = self.started if since is None else since
        kept = [
            (end, busy, total)
            for end, busy, total in self.windows
            if total > 0
            and (since is None or end - self.window_s >= since - 1e-6)
            and (until is None or end <= until + 1e-6)
        ]
        if self._first is None or self._last is None or not kept:
            return None
        shares = [busy_share((0, 0), (busy, total)) for _, busy, total in kept]
        busiest = max(range(len(kept)), key=shares.__getitem__)
        return {
            "mean": round(sum(b for _, b, _ in kept) / sum(t for _, _, t in kept), 3),
            "max_window": round(shares[busiest], 3),
            "window_s": self.window_s,
            "over_limit": shares[busiest] > LIMIT,
            "from_s": round(start - self.started, 1),
            # where the busiest window ended and how many were over the line: one peak, or many
            "max_window_end_s": round(kept[busiest][0] - start, 1),
            "windows_over_limit": sum(share > LIMIT for share in shares),
            "windows": len(kept),
        }
