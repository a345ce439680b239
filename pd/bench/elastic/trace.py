"""`pd-bench elastic`'s load: phases of an arrival rate (held, or ramped from the last phase's)
and request lengths, and the Poisson arrivals they give (a ramp by thinning). Pure, seeded.

The full trace (rates as multiples of `base`, seconds in modeled time): a ramp to 4x, a hold,
a burst to 8x for a minute, back to 4x, a prefill-heavy and a decode-heavy phase at 4x's
tokens, and 10 minutes of constant 2x (where nothing should change). `--quick` is one step up
and back down; `plateau` is the 4x plateau alone (where HPA's target is tuned).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Phase:
    name: str
    seconds: float
    rate: float  # requests a second at its end (held throughout unless `ramp`)
    prompt_tokens: int
    output_tokens: int
    ramp: bool = False  # rises (or falls) linearly from the previous phase's rate

    @property
    def plateau(self) -> bool:
        return not self.ramp


def full(base: float, prompt: int, output: int) -> list[Phase]:
    return [
        Phase("base", 300, base, prompt, output),
        Phase("ramp-4x", 300, 4 * base, prompt, output, ramp=True),
        Phase("hold-4x", 600, 4 * base, prompt, output),
        Phase("burst-8x", 60, 8 * base, prompt, output),
        Phase("back-4x", 300, 4 * base, prompt, output),
        # The same tokens a second as 4x, spent apart: long prompts, then long answers.
        Phase("prefill-heavy", 500, 2 * base, 2 * prompt, max(1, output // 4)),
        Phase("decode-heavy", 500, 2 * base, max(1, prompt // 4), 2 * output),
        Phase("constant-2x", 600, 2 * base, prompt, output),
    ]


def quick(base: float, prompt: int, output: int) -> list[Phase]:
    return [
        Phase("low", 10, base, prompt, output),
        Phase("high-4x", 30, 4 * base, prompt, output),
        Phase("low-again", 25, base, prompt, output),
    ]


def plateau(base: float, prompt: int, output: int) -> list[Phase]:
    """A minute at 1x, then the 4x plateau held: where HPA's target is tuned (`--hpa-tune`)."""
    return [
        Phase("base", 60, base, prompt, output),
        Phase("hold-4x", 240, 4 * base, prompt, output),
    ]


TRACES = {"full": full, "quick": quick, "plateau": plateau}


def scaled(phases: list[Phase], factor: float) -> list[Phase]:
    """Every phase `factor` times as long (a shorter run of the same shape)."""
    return [replace(ph, seconds=ph.seconds * factor) for ph in phases]


def arrivals(phases: list[Phase], seed: int = 0) -> list[tuple[float, int]]:
    """(time, phase index) of every request: a Poisson process at each phase's rate (a ramp's
    rate rising linearly, drawn at its highest and thinned)."""
    rng = random.Random(seed)
    out: list[tuple[float, int]] = []
    start, before = 0.0, phases[0].rate if phases else 0.0
    for i, ph in enumerate(phases):
        top = max(ph.rate, before) if ph.ramp else ph.rate
        t = start
        while top > 0:
            t += rng.expovariate(top)
            if t >= start + ph.seconds:
                break
            rate = before + (ph.rate - before) * (t - start) / ph.seconds if ph.ramp else ph.rate
            if rng.random() * top < rate:
                out.append((t, i))
        start += ph.seconds
        before = ph.rate
    return out


def bounds(phases: list[Phase]) -> list[tuple[float, float]]:
    """Each phase's (start, end) seconds."""
    out, t = [], 0.0
    for ph in phases:
        out.append((t, t + ph.seconds))
        t += ph.seconds
    return out
