"""Percentiles, SLO attainment, goodput and max rate on synthetic records."""

from __future__ import annotations

import math

import pytest

from pd.bench.serve.client import RequestRecord
from pd.bench.serve.metrics import SLO, max_rate_at, percentile, summarize


def rec(sent: float, ttft: float | None, e2e: float | None, out: int, error=None, itl=()):
    r = RequestRecord("t", 2.0, "j", 0, planned_s=sent, sent_s=sent, ttft_s=ttft, e2e_s=e2e,
                      output_tokens=out, itl_s=list(itl), error=error)  # fmt: skip
    return r


def test_percentile_is_linear_between_ranks():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([10], 99) == 10
    assert percentile([0, 100], 99) == pytest.approx(99)
    assert math.isnan(percentile([], 50))


def test_tpot_and_slo():
    r = rec(0, 0.1, 1.1, 11, itl=[0.1] * 9 + [0.3])
    assert r.tpot_s == pytest.approx(0.1)
    assert SLO(ttft_ms=100).met(r) and not SLO(ttft_ms=99).met(r)
    assert SLO(tpot_ms=100).met(r) and not SLO(tpot_ms=90).met(r)
    assert not SLO(itl_p99_ms=200).met(r)  # the 0.3 s gap is the p99
    assert SLO(itl_p99_ms=300).met(r)
    assert not SLO().met(rec(0, None, None, 0, error="timeout"))


def test_summary_keeps_errors_in_the_denominator():
    records = [
        rec(0.0, 0.1, 1.0, 10),
        rec(0.5, 0.5, 2.0, 10),  # misses the TTFT SLO
        rec(1.0, 0.1, 1.0, 10),  # ends at 2.0 s: the phase lasts 2 s
        rec(1.5, None, None, 0, error="http_503"),
    ]
    s = summarize(records, SLO(ttft_ms=200))
    assert s["requests"] == 4 and s["completed"] == 3
    assert s["errors"] == {"http_503": 1}
    assert s["duration_s"] == 2.5  # first send 0.0 to the last answer (0.5 + 2.0)
    assert s["slo_attainment"] == 0.5  # 2 of 4 meet it; the error counts against
    assert s["goodput_rps"] == pytest.approx(2 / 2.5)
    assert s["req_per_s"] == pytest.approx(3 / 2.5)
    assert s["output_tok_per_s"] == pytest.approx(30 / 2.5)
    assert s["ttft_ms"]["p50"] == 100.0
    no_slo = summarize(records, SLO())
    assert no_slo["slo_attainment"] == 0.75  # without SLOs: the share that completed


def test_max_rate_at_90pct():
    results = [
        {"rate": 1.0, "slo_attainment": 1.0},
        {"rate": 2.0, "slo_attainment": 0.95},
        {"rate": 4.0, "slo_attainment": 0.6},
        {"rate": 3.0, "slo_attainment": 0.9},
    ]
    assert max_rate_at(results) == 3.0
    assert max_rate_at([{"rate": 1.0, "slo_attainment": 0.5}]) is None


def test_summary_splits_the_first_turn_from_later_ones():
    first, later = rec(0.0, 0.9, 1.0, 4), rec(1.0, 0.1, 1.0, 4)
    later.turn = 1
    s = summarize([first, later, rec(2.0, 0.7, 1.0, 4)], SLO())
    assert s["ttft_first_turn_ms"]["p50"] == pytest.approx(800.0)
    assert s["ttft_later_turns_ms"]["p50"] == pytest.approx(100.0)
