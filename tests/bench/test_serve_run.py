"""Short runs of `pd-bench serve` against a stub server, and its answers to bad input."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from pd.bench.serve.cli import measure, parse_targets
from pd.ports import free_port
from tests.bench.conftest import serve_args
from tests.bench.openai_stub import OpenAIStub

TRACE = str(Path(__file__).parent / "data" / "mini_trace.jsonl")


async def start(aiohttp_server, **kw):
    stub = OpenAIStub(**kw)
    server = await aiohttp_server(stub.app())
    return stub, f"http://127.0.0.1:{server.port}"


async def test_open_loop_run_measures_every_request(aiohttp_server):
    stub, url = await start(aiohttp_server)
    args = serve_args("--url", url, "--rates", "20,40", "--num-requests", "12", "--input-len",
                      "16", "--output-len", "5", "--slo-ttft-ms", "1000", "--warmup", "0")  # fmt: skip
    out, records = await measure(parse_targets(url, [], None), args)
    assert [r["rate"] for r in out["results"]] == [20.0, 40.0]
    for r in out["results"]:
        assert r["requests"] == r["completed"] == 12 and r["errors"] == {}
        assert r["slo_attainment"] == 1.0 and r["cached_tokens_total"] == 36
        assert r["tpot_ms"]["p50"] is not None and r["itl_ms"]["p99"] is not None
    assert out["max_rate_at_90pct"] == 40.0
    assert all(r.output_tokens == 5 and len(r.itl_s) == 4 for r in records)
    assert stub.bodies[0]["model"] == "stub-model" and stub.bodies[0]["ignore_eos"] is True
    assert stub.bodies[0]["stream_options"] == {"include_usage": True}
    # Open loop: 12 requests at 40/s are sent within about 0.3 s, not one after another.
    sends = sorted(r.sent_s for r in records if r.rate == 40.0)
    assert sends[-1] - sends[0] < 1.5


async def test_multi_turn_carries_each_answer_into_the_next_turn(aiohttp_server):
    stub, url = await start(aiohttp_server)
    args = serve_args("--url", url, "--workload", "multi-turn", "--conversations", "2",
                      "--turns", "3", "--prefix-len", "20", "--output-len", "3",
                      "--concurrency", "2", "--warmup", "0")  # fmt: skip
    out, records = await measure(parse_targets(url, [], None), args)
    assert out["results"][0]["completed"] == 6
    by_room: dict[str, list[dict]] = {}
    for body, headers in zip(stub.bodies, stub.headers):
        assert headers["X-Room-Id"] == body["user"]
        by_room.setdefault(body["user"], []).append(body)
    assert len(by_room) == 2
    for bodies in by_room.values():
        assert [len(b["messages"]) for b in bodies] == [2, 4, 6]
        for prev, nxt in zip(bodies, bodies[1:]):
            answer = nxt["messages"][len(prev["messages"])]  # the turn after prev's messages
            first_word = prev["messages"][-1]["content"].split()[0]
            assert answer["role"] == "assistant"
            assert answer["content"] == f"[{len(prev['messages'])} msgs, re {first_word}]ww"
            assert nxt["messages"][: len(prev["messages"])] == prev["messages"]


async def test_trace_replay_honours_timestamps(aiohttp_server, token_text):
    stub, url = await start(aiohttp_server)
    args = serve_args("--url", url, "--trace", TRACE, "--warmup", "0")
    out, records = await measure(parse_targets(url, [], None), args)
    assert out["workload"] == "trace" and out["results"][0]["completed"] == 4
    gaps = [b - stub.arrivals[0] for b in stub.arrivals]
    assert gaps == pytest.approx([0.0, 0.3, 0.5, 0.9], abs=0.08)
    prompts = [b["prompt"] for b in stub.bodies]
    assert prompts[2].startswith(prompts[0])  # hash_ids [0, 1] are a prefix of [0, 1, 3]


@pytest.mark.parametrize(
    "mode, kind",
    [("http_400", "http_400"), ("http_503", "http_503"), ("plain", "no_sse"),
     ("cut", "stream_error"), ("error_event", "stream_error")],
)  # fmt: skip
async def test_failures_count_as_errors_of_their_kind(aiohttp_server, mode, kind):
    stub, url = await start(aiohttp_server, mode=mode)
    args = serve_args("--url", url, "--rates", "50", "--num-requests", "3", "--input-len", "8",
                      "--output-len", "2", "--warmup", "0")  # fmt: skip
    out, _ = await measure(parse_targets(url, [], None), args)
    r = out["results"][0]
    assert r["requests"] == 3 and r["completed"] == 0 and r["errors"] == {kind: 3}
    assert r["slo_attainment"] == 0.0 and out["max_rate_at_90pct"] is None


async def test_compare_alternates_targets_per_rate(aiohttp_server):
    _, url_a = await start(aiohttp_server)
    _, url_b = await start(aiohttp_server, chunk_delay=0.01)
    args = serve_args("--compare", f"a={url_a}", f"b={url_b}", "--rates", "30,60",
                      "--num-requests", "4", "--input-len", "8", "--output-len", "4",
                      "--warmup", "1")  # fmt: skip
    out, _ = await measure(parse_targets(None, args.compare, None), args)
    assert [(r["target"], r["rate"]) for r in out["results"]] == [
        ("a", 30.0),
        ("b", 30.0),
        ("a", 60.0),
        ("b", 60.0),
    ]
    assert set(out["max_rate_at_90pct"]) == {"a", "b"}
    slow = [r for r in out["results"] if r["target"] == "b"]
    fast = [r for r in out["results"] if r["target"] == "a"]
    assert slow[0]["tpot_ms"]["p50"] > fast[0]["tpot_ms"]["p50"]


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--url", "http://127.0.0.1:1", "--workload", "nope"], "unknown workload 'nope'"),
        (["--url", "http://127.0.0.1:1", "--rates", "0"], "every rate must be > 0"),
        (["--url", "http://127.0.0.1:1", "--rates=-2,1"], "every rate must be > 0"),
        (["--url", "http://127.0.0.1:1", "--rates", "fast"], "--rates takes numbers"),
        (["--compare", "nourl"], "--compare takes NAME=URL"),
        (["--compare", "a=ftp://x"], "is not an http(s) URL"),
        (["--url", "http://127.0.0.1:{port}"], "cannot reach http://127.0.0.1:"),
        (["--url", "http://127.0.0.1:1", "--trace", "/nonexistent.jsonl"], "cannot read trace"),
        (["--url", "http://127.0.0.1:1", "--concurrency", "0"], "--concurrency must be > 0"),
    ],
)
def test_bad_input_is_one_line_and_a_nonzero_exit(argv, needle, tmp_path):
    argv = [a.replace("{port}", str(free_port())) for a in argv]
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pd.bench.cli", "serve", *argv],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pd-bench serve: ") and needle in lines[0]
    assert "Traceback" not in proc.stderr and time.monotonic() - t0 < 30


async def test_malformed_trace_is_a_clear_error(aiohttp_server, tmp_path):
    from pd.bench.serve.cli import BenchInputError  # noqa: F401  (the CLI maps both to exit 2)
    from pd.bench.serve.trace import TraceError

    _, url = await start(aiohttp_server)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": "x"}\n')
    with pytest.raises(TraceError, match=r"bad.jsonl:2: 'timestamp' must be a number"):
        await measure(parse_targets(url, [], None), serve_args("--url", url, "--trace", str(bad)))


def test_json_output_shape(tmp_path):
    """`--json` prints one object with the documented keys (against a stub in a subprocess)."""
    port = free_port()
    stub = subprocess.Popen(
        [sys.executable, "-c", STUB_MAIN, str(port)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert stub.stdout is not None and stub.stdout.readline().strip() == "ready"
        proc = subprocess.run(
            [sys.executable, "-m", "pd.bench.cli", "serve", "--url", f"http://127.0.0.1:{port}",
             "--rates", "20", "--num-requests", "4", "--input-len", "8", "--output-len", "3",
             "--json", "--output-dir", str(tmp_path)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        out = orjson.loads(proc.stdout)
        r = out["results"][0]
        for key in ("rate", "requests", "completed", "errors", "req_per_s", "output_tok_per_s",
                    "goodput_rps", "slo_attainment", "ttft_ms", "tpot_ms", "itl_ms",
                    "cached_tokens_total"):  # fmt: skip
            assert key in r
        assert set(r["ttft_ms"]) == {"p50", "p90", "p99"} and "max_rate_at_90pct" in out
        assert (tmp_path / "records.csv").read_text().count("\n") == 5
        if importlib.util.find_spec("matplotlib") is not None:  # the plots are optional
            assert (tmp_path / "ttft_cdf.png").stat().st_size > 1000
    finally:
        stub.kill()
        stub.wait()


STUB_MAIN = """
import asyncio, sys
from aiohttp import web
from tests.bench.openai_stub import OpenAIStub
async def main():
    runner = web.AppRunner(OpenAIStub().app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", int(sys.argv[1])).start()
    print("ready", flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


async def test_a_request_whose_only_token_is_eos_has_a_ttft(aiohttp_server):
    """A stream whose one token chunk has no text but a finish reason still has a TTFT."""
    from aiohttp import web

    async def eos_only(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
        eos = {"choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "stop"}]}
        usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
        for event in (role, eos, usage):
            await resp.write(b"data: " + orjson.dumps(event) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", eos_only)
    server = await aiohttp_server(app)
    url = f"http://127.0.0.1:{server.port}"
    args = serve_args("--url", url, "--workload", "shared-prefix", "--prefix-len", "8",
                      "--num-requests", "2", "--rates", "50", "--slo-ttft-ms", "1000",
                      "--warmup", "0")  # fmt: skip
    out, records = await measure(parse_targets(url, [], None), args)
    assert all(r.ttft_s is not None and r.output_tokens == 1 for r in records)
    assert out["results"][0]["slo_attainment"] == 1.0


async def test_uniform_arrivals_and_max_duration_bound_the_run(aiohttp_server):
    stub, url = await start(aiohttp_server)
    args = serve_args("--url", url, "--rates", "10", "--arrival", "uniform", "--num-requests",
                      "20", "--max-duration", "0.25", "--input-len", "8", "--output-len", "2",
                      "--warmup", "0")  # fmt: skip
    out, records = await measure(parse_targets(url, [], None), args)
    assert sorted(r.planned_s for r in records) == pytest.approx([0.0, 0.1, 0.2])
    assert out["results"][0]["requests"] == 3 and len(stub.bodies) == 3
    assert all(r.lag_s < 0.05 for r in records)


async def test_closed_loop_keeps_n_requests_in_flight(aiohttp_server):
    stub, url = await start(aiohttp_server, chunk_delay=0.02)
    args = serve_args("--url", url, "--concurrency", "3", "--num-requests", "9", "--input-len",
                      "8", "--output-len", "4", "--warmup", "0")  # fmt: skip
    out, records = await measure(parse_targets(url, [], None), args)
    assert out["results"][0]["completed"] == 9 and out["results"][0]["rate"] is None
    sends = sorted(r.sent_s for r in records)
    assert sends[2] - sends[0] < 0.05  # the first three go at once
    assert sends[3] - sends[0] > 0.05  # the fourth waits for one of them to finish


async def test_time_scale_measures_in_modeled_time(aiohttp_server):
    # A target 4x slower than the time it models: gaps of 40 ms real are 10 ms modeled, and
    # arrivals planned 0.1 s apart (modeled) go 0.4 s apart (real).
    stub, url = await start(aiohttp_server, chunk_delay=0.04)
    args = serve_args("--url", url, "--rates", "10", "--arrival", "uniform", "--num-requests",
                      "3", "--input-len", "8", "--output-len", "4", "--warmup", "0",
                      "--time-scale", "4")  # fmt: skip
    t0 = time.perf_counter()
    out, records = await measure(parse_targets(url, [], None), args)
    assert time.perf_counter() - t0 > 0.8  # the last send is due at 0.2 s modeled, 0.8 s real
    assert out["time_scale"] == 4.0
    assert sorted(r.planned_s for r in records) == pytest.approx([0.0, 0.1, 0.2])
    assert all(abs(r.sent_s - r.planned_s) < 0.05 for r in records)
    gaps = sorted(g for r in records for g in r.itl_s)
    # Unscaled they would be >= 40 ms; a loaded machine only lengthens some.
    assert len(gaps) == 9 and gaps[0] > 0.009 and gaps[4] < 0.02
