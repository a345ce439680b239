"""`pd-bench routing`: its setup syntax and arithmetic, and one small run on the real model."""

from __future__ import annotations

import subprocess
import sys

import orjson
import pytest

from pd.bench.routing import Setup, parse_setups, prometheus_sum, summarize_runs
from pd.bench.serve.cli import BenchInputError
from pd.transfer import nixl_available


def test_setups_parse_with_router_flags_and_bad_ones_are_refused():
    a, b = parse_setups("round-robin:0, cache-aware:256:cache-balance-abs=8+cache-threshold=0.5")
    assert a == Setup("round-robin", 0, (), "round-robin:0")
    assert b.policy == "cache-aware" and b.local == 256
    assert b.flags == ("--cache-balance-abs", "8", "--cache-threshold", "0.5")
    for bad in (
        "random:0",
        "cache-aware",
        "cache-aware:x",
        "cache-aware:0:oops",
        "cache-aware:0:=1",
    ):
        with pytest.raises(BenchInputError):
            parse_setups(bad)


def test_prometheus_sum_adds_a_metric_over_its_labels():
    text = "\n".join(
        [
            "# HELP pd_requests_total requests",
            'pd_requests_total{finish_reason="stop"} 3.0',
            'pd_requests_total{finish_reason="length"} 4.0',
            "pd_requests_total_other 100",
            "pd_prefix_cache_hits_total 12.0",
        ]
    )
    assert prometheus_sum(text, "pd_requests_total") == 7.0
    assert prometheus_sum(text, "pd_prefix_cache_hits_total") == 12.0
    assert prometheus_sum(text, "absent") == 0.0


def run_of(setup: str, round_no: int, tokens: int, ttft: float, p_requests: int) -> dict:
    return {
        "setup": setup,
        "round": round_no,
        "p_prefill_tokens": tokens,
        "p_requests": p_requests,
        "local_requests": 0,
        "ttft_first_turn_p50_ms": 1000.0,
        "ttft_later_turns_p50_ms": ttft,
        "ttft_later_turns_p90_ms": ttft,
        "tpot_p50_ms": 50.0,
    }


def test_summary_takes_medians_over_rounds_and_ratios_against_the_first_setup():
    setups = parse_setups("round-robin:0,cache-aware:0,cache-aware:256")
    runs = [
        run_of("round-robin:0", 0, 1000, 800.0, 64),
        run_of("round-robin:0", 1, 3000, 1200.0, 64),
        run_of("cache-aware:0", 0, 500, 300.0, 64),
        run_of("cache-aware:0", 1, 500, 200.0, 64),
        run_of("cache-aware:256", 0, 400, 100.0, 16),
    ]
    s = summarize_runs(runs, setups)
    assert s["medians"]["round-robin:0"]["p_prefill_tokens"] == 2000
    assert s["vs_round-robin:0"]["cache-aware:0"] == {
        "p_prefill_tokens": 0.25,
        "ttft_later_turns_p50": 0.25,
    }
    local = s["local_vs_off"]["cache-aware:256"]
    assert local == {"ttft_later_turns_p50": 0.4, "p_requests": 16, "p_requests_off": 64}


@pytest.mark.slow
@pytest.mark.skipif(not nixl_available(), reason="the PD setups pull KV over NIXL")
def test_a_small_run_reports_each_setup(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (the bench extra)")
    proc = subprocess.run(
        [sys.executable, "-m", "pd.bench.cli", "routing", "--conversations", "2", "--turns", "2",
         "--prefix-len", "300", "--input-len", "20", "--output-len", "8", "--concurrency", "2",
         "--p-kv-pages", "64", "--d-kv-pages", "128", "--dtype", "float32",
         "--setups", "round-robin:0,round-robin:256", "--json", "--output-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = orjson.loads(proc.stdout)
    off, local = out["runs"]
    assert off["completed"] == local["completed"] == 4 and not off["errors"]
    assert off["p_requests"] == 4 and off["local_requests"] == 0
    # Second turns add 20 + 8 tokens: decode-local, never at P.
    assert local["p_requests"] == 2 and local["local_requests"] == 2
    assert off["p_prefill_tokens"] > 0
    assert (tmp_path / "routing.png").stat().st_size > 1000
