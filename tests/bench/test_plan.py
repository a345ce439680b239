"""`pd-bench plan`: workloads as token counts, the search's output, and DistServe's result on
the DES (disaggregation wins when TPOT is tight and prompts long, co-location when it is not)."""

from __future__ import annotations

import os
from typing import Any

import orjson
import pytest

from pd.bench.cli import main
from pd.bench.plan_search import Search, attainment_at, summary_at
from pd.bench.serve.metrics import SLO
from pd.bench.serve.sim_jobs import arrivals_at, natural_rate, trace_jobs, workload_jobs
from pd.bench.serve.text import TokenText
from pd.bench.serve.trace import read_trace
from pd.bench.serve.workloads import DEFAULTS, WorkloadConfig, build
from pd.sim import parse_profile
from pd.sim.cluster import ClusterSpec

TRACE = os.path.join(os.path.dirname(__file__), "data", "mini_trace.jsonl")
TINY = ["plan", "--profile", "llama-3.1-8b:h100", "--tp", "1", "--rate-tolerance", "0.05"]


def plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main([*TINY, *argv, "--json"]) == 0
    return orjson.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    "cfg",
    [
        WorkloadConfig(
            "random", num_requests=20, input_len=300, output_len=40, range_ratio=0.5, seed=3
        ),  # fmt: skip
        WorkloadConfig("mixed", num_requests=16),
        WorkloadConfig("shared-prefix", num_requests=4),
        WorkloadConfig("multi-turn", conversations=2, turns=3),
    ],
)
def test_token_counts_are_the_lengths_pd_bench_serve_sends(
    cfg: WorkloadConfig, token_text: TokenText
) -> None:
    real = build(cfg, token_text)
    sim = workload_jobs(cfg)
    assert [j.job_id for j in real] == [j.job_id for j in sim]
    for rj, sj in zip(real, sim):
        assert [t.max_tokens for t in rj.turns] == [t.output_tokens for t in sj.turns]
        # Turn k's prompt: its system prompt and user turn (the real turn's input_len), after
        # the conversation's earlier user turns and answers.
        prefix = cfg.prefix_len if cfg.prefix_len is not None else DEFAULTS[cfg.name][3]
        history = 0
        for rt, st in zip(rj.turns, sj.turns):
            assert st.prompt_tokens == rt.input_len + history
            if rj.room is not None:
                history += rt.input_len - prefix + rt.max_tokens


def test_shared_prefix_and_conversation_segments() -> None:
    shared = workload_jobs(WorkloadConfig("shared-prefix", num_requests=2))
    a, b = (j.turns[0].segments for j in shared)
    assert a[0] == b[0] and a[0][1] == 1500 and a[1] != b[1]
    (conv,) = workload_jobs(WorkloadConfig("multi-turn", conversations=1, turns=2))
    t0, t1 = conv.turns
    assert t0.segments[0] == t1.segments[0]
    assert t0.segments[1] == ("c0", 50) and t1.segments[1] == ("c0", 50 + 64 + 50)


def test_trace_jobs_share_their_blocks_and_scale_to_a_rate() -> None:
    jobs = trace_jobs(read_trace(TRACE))
    first, second = jobs[0].turns[0], jobs[1].turns[0]
    assert first.segments == ((("trace", 0), 512), (("trace", 1), 188))
    assert second.segments[0] == first.segments[0]  # hash id 0 in both
    own = natural_rate(jobs)
    assert own is not None
    natural = arrivals_at(jobs, own, "poisson", 0)
    assert natural == pytest.approx([j.at_s for j in jobs])
    assert arrivals_at(jobs, 2 * own, "poisson", 0) == pytest.approx([t / 2 for t in natural])


def test_plan_json_shape(capsys: pytest.CaptureFixture[str]) -> None:
    out = plan_json(capsys, "--gpus", "3", "--num-requests", "40", "--input-len", "1000",
                    "--output-len", "16", "--slo-ttft-ms", "500",
                    "--colocated-chunk-sizes", "512,8192")  # fmt: skip
    names = {(s["prefill_workers"], s["decode_workers"]) for s in out["splits"]}
    assert names == {(1, 1), (1, 2), (2, 1)}
    for s in out["splits"] + [out["best"]]:
        assert s["tp"] == {"prefill": 1, "decode": 1}
        assert s["gpus"] == s["prefill_workers"] + s["decode_workers"] <= 3
        assert s["goodput_per_gpu"] == pytest.approx(s["max_rate"] / s["gpus"], abs=1e-3)
    assert out["best"] == max(out["splits"], key=lambda s: s["goodput_per_gpu"])
    assert {k: out["colocated"][k] for k in ("workers", "tp", "gpus")} == {
        "workers": 3, "tp": 1, "gpus": 3}  # fmt: skip
    tried = out["colocated_tried"]
    assert sorted(c["chunk_size"] for c in tried) == [512, 8192]
    assert out["colocated"] == max(tried, key=lambda c: c["goodput_per_gpu"])
    assert {s["chunk_size"] for s in out["splits"]} == {8192}
    assert out["goodput"] == "max-rate" and out["requests"] == 40


def test_plan_at_a_rate_and_its_sweep_plot(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (the bench extra)")
    png = tmp_path / "plan.png"
    out = plan_json(capsys, "--gpus", "2", "--num-requests", "30", "--input-len", "500",
                    "--output-len", "8", "--slo-ttft-ms", "300", "--at-rate", "1",
                    "--sweep", "0.5,1", "--plot", str(png))  # fmt: skip
    assert out["goodput"] == "at-rate" and [s["gpus"] for s in out["splits"]] == [2]
    assert [p["rate_per_gpu"] for p in out["sweep"]["best"]] == [0.5, 1.0]
    assert png.stat().st_size > 0


def test_disaggregation_wins_when_tpot_is_tight_and_prompts_long(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """4,096-token prompts, 64 output tokens, 8B on 3 H100s. A decode step is 7-10 ms, a prefill
    ~140 ms. Co-located, every prompt that arrives while a request decodes puts a ~140 ms step
    among its 63 gaps, so TPOT <= 12 ms allows a few requests per second per worker; split, D's
    steps stay decode steps and each P takes ~7 prompts a second within the TTFT."""
    argv = ["--gpus", "3", "--num-requests", "150", "--input-len", "4096", "--output-len", "64",
            "--slo-ttft-ms", "1000"]  # fmt: skip
    tight = plan_json(capsys, *argv, "--slo-tpot-ms", "12")
    assert tight["best"]["goodput_per_gpu"] > tight["colocated"]["goodput_per_gpu"]
    # Loose TPOT: prefill is the bottleneck, and co-located every GPU prefills, where a split
    # gives a whole GPU to decoding 64 tokens a request (mostly idle).
    loose = plan_json(capsys, *argv, "--slo-tpot-ms", "200")
    assert loose["colocated"]["goodput_per_gpu"] > loose["best"]["goodput_per_gpu"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gpus", "2"], "give at least one SLO"),
        (["--gpus", "2", "--slo-ttft-ms", "100", "--tp", "3"], "fits on h100 at none of tp [3]"),
        (["--gpus", "2", "--slo-ttft-ms", "100", "--plot", "x.png"], "--plot needs --sweep"),
        (["--gpus", "2", "--slo-ttft-ms", "100", "--policy", "random"], "unknown policy"),
    ],
)
def test_bad_input_is_one_line_and_status_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*TINY[:3], *argv]) == 2
    assert message in capsys.readouterr().err


def test_the_early_stop_never_changes_a_decision() -> None:
    """`attainment_at` stops a run once too many requests missed; at every rate it must agree
    with the full run on meeting the target, and equal it whenever it does."""
    jobs = workload_jobs(WorkloadConfig("random", num_requests=120, input_len=2000, output_len=32))
    spec = ClusterSpec.disaggregated(parse_profile("llama-3.1-8b:h100"), 1, 1, 1, 1)
    search = Search(SLO(ttft_ms=400, tpot_ms=15), attainment=0.9)
    seen = set()
    for rate in (2, 4, 6, 8, 12, 20):
        early = attainment_at(spec, jobs, rate, search)
        full = summary_at(spec, jobs, rate, search)["slo_attainment"]
        assert (early >= 0.9) == (full >= 0.9)
        if full >= 0.9:
            assert early == pytest.approx(full, abs=1e-4)
        seen.add(full >= 0.9)
    assert seen == {True, False}  # both sides of the target were tried


def test_plan_replays_a_trace(capsys: pytest.CaptureFixture[str]) -> None:
    out = plan_json(capsys, "--gpus", "2", "--trace", TRACE, "--slo-ttft-ms", "1000")
    assert (out["workload"], out["requests"]) == ("trace", 4)
    assert out["best"]["max_rate"] is not None and out["best"]["goodput_per_gpu"] > 0


def test_a_search_that_never_misses_is_capped(capsys: pytest.CaptureFixture[str]) -> None:
    """50 prompts of 256 tokens are 12,800 tokens, two steps of one 8B P (0.47 s together):
    even all at once they meet a 500 ms TTFT, so no rate fails and the search stops at its cap."""
    out = plan_json(capsys, "--gpus", "2", "--num-requests", "50", "--slo-ttft-ms", "500")
    assert out["best"]["capped"] is True and out["best"]["attainment"] == 1.0
