"""`pd-planner` as a whole: its flags refuse what cannot work (exit 2 with the reason), and its
service, with the `virtual` connector, reads a router + simulated P + D in this process, writes
its decision for an external system, and exports its targets, fits and polls as metrics."""

from __future__ import annotations

import json

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pd.planner.main import parse_config
from pd.planner.service import PlannerService
from tests.planner.test_observe import completion, router_of, serve

BASE = ["--router", "http://127.0.0.1:1", "--slo-ttft-ms", "1000", "--slo-itl-ms", "50"]


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (BASE[2:], "--router is required"),
        (BASE[:2], "--slo-ttft-ms and --slo-itl-ms are required"),
        ([*BASE, "--slo-itl-ms", "0"], "the SLOs must be > 0 ms"),
        ([*BASE, "--min-decode", "3", "--max-decode", "2"], "--min-decode must be >= 0 and <="),
        ([*BASE, "--budget", "1"], "--budget is below"),
        ([*BASE, "--connector", "simulated"], "needs --simulate PROFILE"),
        ([*BASE, "--connector", "virtual"], "needs --decision-file"),
        ([*BASE, "--connector", "local", "--worker-args", "'--threads"], "quotation"),
        ([*BASE, "--ttft-quantile", "1"], "--ttft-quantile must be > 0 and < 1"),
    ],
)
def test_bad_flags_exit_2_with_the_reason(argv, said, capsys):
    with pytest.raises(SystemExit) as e:
        parse_config(argv)
    assert e.value.code == 2
    assert said in capsys.readouterr().err


def test_the_floors_knobs_come_from_the_flags():
    plan = [*BASE, "--decision-file", "plan.json"]
    knobs = parse_config([*plan, "--headroom", "1", "--ttft-quantile", "0.99"]).knobs
    assert (knobs.headroom, knobs.ttft_quantile) == (1.0, 0.99)
    assert parse_config(plan).knobs.ttft_quantile == 0.9


async def test_the_service_decides_writes_and_exports(aiohttp_server, tmp_path):
    p, d = await serve(aiohttp_server, "prefill"), await serve(aiohttp_server, "decode")
    router = await router_of(aiohttp_server, prefill=(p,), decode=(d,))
    plan = tmp_path / "plan.json"
    cfg = parse_config([
        "--router", router, "--slo-ttft-ms", "5000", "--slo-itl-ms", "100",
        "--connector", "virtual", "--decision-file", str(plan), "--port", "0",
    ])  # fmt: skip
    service = PlannerService(cfg)
    async with aiohttp.ClientSession() as http:
        await service.tick(http)
        for i in range(4):
            await completion(http, router, i, 8)
        await service.tick(http)
        written = json.loads(plan.read_text())
        assert (written["revision"], written["prefill"], written["decode"]) == (1, 1, 1)
        assert service.actions == ["wrote revision 1: prefill=1 decode=1"]
        app = await aiohttp_server(service.app())
        health = await (await http.get(str(app.make_url("/health")))).json()
        assert health["targets"] == {"prefill": 1, "decode": 1} and health["observations"] == 2
        text = await (await http.get(str(app.make_url("/metrics")))).text()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    assert samples[("pd_planner_workers", (("role", "decode"), ("state", "ready")))] == 1
    assert samples[("pd_planner_workers", (("role", "prefill"), ("state", "target")))] == 1
    assert samples[("pd_planner_observations_total", (("outcome", "ok"),))] == 2
    assert samples[("pd_planner_slo_seconds", (("slo", "itl"),))] == 0.1
    assert samples[("pd_planner_prefill_tokens_per_second", ())] > 0  # P's rate, fitted
    assert samples[("pd_planner_arrivals_per_second", ())] > 0
    assert ("pd_planner_step_fit_seconds", (("term", "fixed"),)) in samples
