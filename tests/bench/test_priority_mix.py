"""`pd-bench serve --priority-mix`: each request's class drawn from the mix with the seed, the
flag's checks, the outcomes a router's admission answers (429, 408, 503 preempted) counted per
class, and a run against the in-process router with a concurrency budget of one."""

from __future__ import annotations

import subprocess
import sys

import pytest
from aiohttp import web

from pd.bench.serve.cli import BenchInputError, check_args, emit, measure, parse_targets
from pd.bench.serve.client import RequestRecord
from pd.bench.serve.metrics import SLO, summarize, summarize_classes
from pd.bench.serve.priority import assign_classes, draw_classes, parse_mix
from pd.bench.serve.workloads import Job, Turn
from pd.bench.stub_worker import StubWorker
from pd.router import RouterConfig, make_app
from tests.bench.conftest import serve_args
from tests.bench.openai_stub import OpenAIStub
from tests.router.conftest import FAST

# ------------------------------------------------------------------ the mix and the draw


def test_a_mix_is_normalised_and_ordered_highest_class_first():
    assert parse_mix("batch=0.8,interactive=0.2") == {"interactive": 0.2, "batch": 0.8}
    assert parse_mix("Interactive=1, batch=4") == pytest.approx({"interactive": 0.2, "batch": 0.8})
    assert list(parse_mix("default=1,system=1,batch=2")) == ["system", "default", "batch"]
    assert parse_mix("default=3") == {"default": 1.0}


@pytest.mark.parametrize(
    "text, needle",
    [
        ("vip=1", "unknown class 'vip'"),
        ("batch", "takes CLASS=WEIGHT"),
        ("", "takes CLASS=WEIGHT"),
        ("batch=1,", "takes CLASS=WEIGHT"),
        ("batch=0", "batch's weight must be > 0"),
        ("batch=-1,interactive=2", "batch's weight must be > 0"),
        ("batch=nan", "batch's weight must be > 0"),
        ("batch=inf", "batch's weight must be > 0"),
        ("batch=lots", "batch's weight must be a number"),
        ("batch=1,batch=2", "class batch is given twice"),
    ],
)
def test_a_bad_mix_is_refused(text, needle):
    with pytest.raises(ValueError, match=needle):
        parse_mix(text)
    with pytest.raises(BenchInputError, match=f"--priority-mix .*{needle}"):
        check_args(serve_args("--url", "http://x", "--priority-mix", text))


def test_the_draw_repeats_per_seed_and_follows_the_mix():
    mix = parse_mix("interactive=0.2,batch=0.8")
    drawn = draw_classes(1000, mix, seed=7)
    assert drawn == draw_classes(1000, mix, seed=7)
    assert drawn != draw_classes(1000, mix, seed=8)
    assert set(drawn) == {"interactive", "batch"}
    assert drawn.count("interactive") / 1000 == pytest.approx(0.2, abs=0.04)
    # A job's class does not depend on how many jobs follow it, nor on the flag's order.
    assert draw_classes(100, parse_mix("batch=4,interactive=1"), seed=7) == drawn[:100]
    four = draw_classes(4000, parse_mix("system=1,interactive=2,default=3,batch=4"), seed=0)
    for cls, share in (("system", 0.1), ("interactive", 0.2), ("default", 0.3), ("batch", 0.4)):
        assert four.count(cls) / 4000 == pytest.approx(share, abs=0.03)
    jobs = [Job(f"r{i}", [Turn(1, prompt="x")], True) for i in range(50)]
    assign_classes(jobs, mix, seed=7)
    assert [j.priority_class for j in jobs] == drawn[:50]


def test_a_bad_mix_is_one_line_and_exit_status_2():
    proc = subprocess.run(
        [sys.executable, "-m", "pd.bench.cli", "serve", "--url", "http://127.0.0.1:1",
         "--priority-mix", "interactive=0.2,vip=0.8"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == [
        "pd-bench serve: --priority-mix unknown class 'vip': choose from system, interactive, "
        "default, batch"
    ]


# ------------------------------------------------------------------ outcomes per class


def _record(cls: str, error: str | None = None, code: str | None = None) -> RequestRecord:
    r = RequestRecord("t", 1.0, "j", 0, 0.0, priority_class=cls, error=error, error_code=code)
    if error is None:
        r.ttft_s, r.e2e_s, r.output_tokens, r.itl_s = 0.01, 0.04, 4, [0.01] * 3
    return r


def test_outcomes_are_counted_per_class_and_add_up():
    records = [
        _record("interactive"),
        _record("interactive", "http_408", "queue_timeout"),
        _record("batch"),
        _record("batch", "http_429", "queue_full"),
        _record("batch", "http_503", "preempted"),
        _record("batch", "http_503"),  # a 503 that is no preemption: a failure
        _record("batch", "timeout"),  # the bench's own timeout: a failure, not `timed_out`
    ]
    classes = summarize_classes(records, SLO(ttft_ms=100), ["interactive", "batch"])
    i, b = classes["interactive"], classes["batch"]
    assert (i["requests"], i["completed"], i["timed_out"], i["refused"]) == (2, 1, 1, 0)
    assert (b["requests"], b["completed"], b["refused"], b["preempted"], b["failed"]) == (
        5, 1, 1, 1, 2,
    )  # fmt: skip
    assert i["slo_attainment"] == 0.5 and b["slo_attainment"] == 0.2
    # Goodput over the whole phase: the classes' add up to the phase's.
    whole = summarize(records, SLO(ttft_ms=100))
    assert i["goodput_rps"] + b["goodput_rps"] == pytest.approx(whole["goodput_rps"], abs=1e-3)
    assert "target" not in i and set(i["ttft_ms"]) == {"p50", "p90", "p99"}


class _AdmissionStub(OpenAIStub):
    """Answers each class as a router's admission may: system streams, interactive 408,
    default 429, batch 503 `preempted`."""

    ANSWERS = {
        "interactive": (408, "queue_timeout"),
        "default": (429, "queue_full"),
        "batch": (503, "preempted"),
    }

    async def generate(self, request: web.Request) -> web.StreamResponse:
        answer = self.ANSWERS.get(request.headers.get("X-Priority-Class", ""))
        if answer is None:
            return await super().generate(request)
        self.headers.append(dict(request.headers))
        status, code = answer
        return web.json_response({"error": {"message": "no", "code": code}}, status=status)


async def test_each_refusal_lands_under_its_class(aiohttp_server):
    stub = _AdmissionStub()
    server = await aiohttp_server(stub.app())
    url = f"http://127.0.0.1:{server.port}"
    mix = "system=1,interactive=1,default=1,batch=1"
    args = serve_args("--url", url, "--rates", "200", "--num-requests", "16", "--input-len", "8",
                      "--output-len", "2", "--priority-mix", mix, "--warmup", "0")  # fmt: skip
    out, records = await measure(parse_targets(url, [], None), args)
    drawn = draw_classes(16, parse_mix(mix), seed=0)
    assert sorted(h["X-Priority-Class"] for h in stub.headers) == sorted(drawn)
    assert {r.job_id: r.priority_class for r in records} == {
        f"r{i}": c for i, c in enumerate(drawn)
    }
    classes = out["results"][0]["classes"]
    assert list(classes) == ["system", "interactive", "default", "batch"]
    expect = {"system": "completed", "interactive": "timed_out", "default": "refused",
              "batch": "preempted"}  # fmt: skip
    for cls, outcome in expect.items():
        c = classes[cls]
        assert c["requests"] == drawn.count(cls) and c[outcome] == c["requests"]
        assert c["completed"] + c["refused"] + c["timed_out"] + c["preempted"] == c["requests"]
        assert c["failed"] == 0
    assert out["max_rate_at_90pct"] is None
    assert out["max_rate_at_90pct_by_class"] == {
        "system": 200.0, "interactive": None, "default": None, "batch": None,
    }  # fmt: skip


# ------------------------------------------------------------------ against the router


async def test_a_run_against_a_router_with_one_slot(aiohttp_server, aiohttp_client, capsys):
    worker = StubWorker("both")
    worker.chunk_delay = 0.03  # ~0.12 s a request: the one slot is busy as requests arrive
    worker_server = await aiohttp_server(worker.app())
    cfg = RouterConfig(**{**FAST, "worker": (str(worker_server.make_url("")).rstrip("/"),),
                          "max_concurrency": 1, "class_reserved": "", "class_queue": "batch=1"})  # fmt: skip
    client = await aiohttp_client(make_app(cfg))
    url = str(client.make_url("")).rstrip("/")
    mix = "interactive=0.25,batch=0.75"
    args = serve_args("--url", url, "--rates", "40", "--arrival", "uniform", "--num-requests",
                      "12", "--input-len", "8", "--output-len", "4", "--priority-mix", mix,
                      "--slo-ttft-ms", "5000", "--seed", "1", "--warmup", "0")  # fmt: skip
    out, records = await measure(parse_targets(url, [], None), args)

    drawn = draw_classes(12, parse_mix(mix), seed=1)
    assert drawn.count("interactive") == 3  # the seed gives both classes enough requests
    assert out["priority_mix"] == {"interactive": 0.25, "batch": 0.75}
    r = out["results"][0]
    classes = r["classes"]
    assert list(classes) == ["interactive", "batch"]
    outcomes = ("completed", "refused", "timed_out", "preempted", "failed")
    for cls, c in classes.items():
        assert c["requests"] == drawn.count(cls)
        assert sum(c[o] for o in outcomes) == c["requests"], (cls, c)
        assert c["timed_out"] == c["failed"] == 0, (cls, c)
    assert sum(c["requests"] for c in classes.values()) == r["requests"] == 12
    assert sum(c["completed"] for c in classes.values()) == r["completed"]
    # One slot, a batch queue of one: batch requests are refused, interactive ones wait.
    i, b = classes["interactive"], classes["batch"]
    assert b["refused"] >= 1 and r["errors"]["http_429"] == b["refused"]
    assert i["refused"] == 0 and i["completed"] == i["requests"]
    assert b["slo_attainment"] < 1.0 and i["slo_attainment"] == 1.0
    assert out["max_rate_at_90pct_by_class"]["interactive"] == 40.0
    # The router turned each request's X-Priority-Class into the body's `priority`.
    priorities = [body.get("priority") for body in worker.requests]
    assert set(priorities) == {-1, 1}
    assert priorities.count(-1) == i["requests"]
    assert b["completed"] <= priorities.count(1) <= b["requests"] - b["refused"]

    args.json = False
    emit(out, records, args)
    text = capsys.readouterr().out
    assert "refused" in text and "preempted" in text
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.strip()}
    assert rows["batch"][1:4] == [str(b["requests"]), str(b["completed"]), str(b["refused"])]
    assert rows["interactive"][1:3] == [str(i["requests"]), str(i["completed"])]
