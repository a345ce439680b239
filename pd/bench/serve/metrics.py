"""From request records to the figures of a run: percentiles, throughput, SLO attainment and
goodput per rate, and the highest rate that keeps 90% of requests within the SLOs.

Definitions (vLLM's goodput, DistServe's attainment):
- a request meets the SLOs when it completed and each given bound holds: TTFT, TPOT (time per
  output token after the first), and the p99 of its own inter-token gaps;
- `slo_attainment` = requests meeting the SLOs / requests sent (errors and timeouts count, as
  failures); with no SLO given it is the share that completed;
- `goodput_rps` = requests meeting the SLOs / the phase's duration (first send to last answer);
- `max_rate_at_90pct` = the highest rate whose attainment is at least 0.9.

Per priority class (`--priority-mix`), the same figures over the class's requests, goodput and
throughput over the whole phase's duration (so the classes' goodputs add up to the phase's),
and the requests by outcome: `completed` + `refused` + `timed_out` + `preempted` + `failed` =
`requests` (client.py defines them).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pd.bench.serve.client import OUTCOMES, RequestRecord

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class SLO:
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    itl_p99_ms: float | None = None

    @property
    def given(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.itl_p99_ms))

    def met(self, r: RequestRecord) -> bool:
        if not r.ok:
            return False
        if self.ttft_ms is not None and (r.ttft_s is None or r.ttft_s * 1000 > self.ttft_ms):
            return False
        tpot = r.tpot_s
        if self.tpot_ms is not None and tpot is not None and tpot * 1000 > self.tpot_ms:
            return False
        if self.itl_p99_ms is not None and r.itl_s:
            if percentile(r.itl_s, 99) * 1000 > self.itl_p99_ms:
                return False
        return True


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile, linear between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    k = (len(ordered) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summary_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for p in PERCENTILES:
        v = percentile(values_s, p) * 1000
        out[f"p{p}"] = None if math.isnan(v) else round(v, 3)
    return out


def phase_duration(records: list[RequestRecord]) -> float:
    """From the first send to the last answer (s)."""
    start = min((r.sent_s for r in records), default=0.0)
    end = max((r.sent_s + (r.e2e_s or 0.0) for r in records), default=0.0)
    return max(end - start, 1e-9)


def summarize(
    records: list[RequestRecord], slo: SLO, duration_s: float | None = None
) -> dict[str, Any]:
    """The figures of one phase (one target at one rate); rates over `duration_s` if given,
    else over the records' own span."""
    done = [r for r in records if r.ok]
    duration = phase_duration(records) if duration_s is None else duration_s
    meeting = sum(slo.met(r) for r in records)
    errors = Counter(r.error for r in records if r.error)
    return {
        "target": records[0].target if records else None,
        "rate": records[0].rate if records else None,
        "requests": len(records),
        "completed": len(done),
        "errors": dict(sorted(errors.items())),
        "duration_s": round(duration, 3),
        "req_per_s": round(len(done) / duration, 4),
        "output_tok_per_s": round(sum(r.output_tokens for r in done) / duration, 2),
        "goodput_rps": round(meeting / duration, 4),
        "slo_attainment": round(meeting / len(records), 4) if records else 0.0,
        "ttft_ms": summary_ms([r.ttft_s for r in done if r.ttft_s is not None]),
        # Multi-turn: the first turn (nothing cached yet) apart from the later ones.
        "ttft_first_turn_ms": summary_ms(
            [r.ttft_s for r in done if r.ttft_s is not None and r.turn == 0]
        ),
        "ttft_later_turns_ms": summary_ms(
            [r.ttft_s for r in done if r.ttft_s is not None and r.turn > 0]
        ),
        "tpot_ms": summary_ms([t for r in done if (t := r.tpot_s) is not None]),
        "itl_ms": summary_ms([g for r in done for g in r.itl_s]),
        "e2e_ms": summary_ms([r.e2e_s for r in done if r.e2e_s is not None]),
        "send_lag_ms": summary_ms([r.lag_s for r in records]),
        "prompt_tokens_total": sum(r.prompt_tokens or 0 for r in done),
        "cached_tokens_total": sum(r.cached_tokens or 0 for r in done),
    }


def summarize_classes(
    records: list[RequestRecord], slo: SLO, classes: Sequence[str]
) -> dict[str, dict[str, Any]]:
    """Per priority class of `classes` (in that order): its figures and its outcome counts."""
    duration = phase_duration(records)
    out = {}
    for cls in classes:
        mine = [r for r in records if r.priority_class == cls]
        figures = summarize(mine, slo, duration)
        del figures["target"], figures["rate"]
        outcomes = Counter(r.outcome for r in mine)
        figures.update({o: outcomes[o] for o in OUTCOMES[1:]})  # `completed` is there already
        out[cls] = figures
    return out


def max_rate_at(results: list[dict[str, Any]], attainment: float = 0.9) -> float | None:
    """The highest rate whose attainment is at least `attainment` (None: no rate does)."""
    rates = [
        r["rate"] for r in results if r["rate"] is not None and r["slo_attainment"] >= attainment
    ]
    return max(rates) if rates else None
