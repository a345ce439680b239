"""`pd-bench soak`: outcomes, the page-leak check and the report from plain data; the streaming
client against a stub endpoint; and one short real soak on the real model."""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import sys

import aiohttp
import orjson
import pytest
from aiohttp import web

from pd.bench import soak
from pd.bench.cli import SUBCOMMANDS
from pd.bench.soak import (
    OUTCOMES,
    Kill,
    RequestRecord,
    build_report,
    classify,
    count_outcomes,
    format_summary,
    make_prompt,
    pages_leaked,
    settled,
    stream_once,
    worker_end_state,
)
from pd.transfer import nixl_available

DEADLINE = 30.0
REPORT_KEYS = {
    "outcomes", "hung", "kills", "pages_leaked", "integrity", "duration_s", "requests",
    "passed", "failures", "workers",
}  # fmt: skip


def rec(**kw) -> RequestRecord:
    kw.setdefault("end", 5.0)
    return RequestRecord(client=0, start=0.0, **kw)


def health(integrity: str = "ok", **load) -> dict:
    base = {"running": 0, "waiting": 0, "inflight_transfers": 0, "kv_pages_held": 0,
            "kv_pages_total": 100, "kv_pages_free": 100}  # fmt: skip
    return {"status": "ok", "integrity": integrity, "load": {**base, **load}}


# ---------------------------------------------------------------------------- outcomes


@pytest.mark.parametrize(
    "record, outcome",
    [
        (rec(status=200, done=True, chunks=49), "ok"),
        (rec(status=200, chunks=2, disconnect_after=2, disconnected=True), "client_disconnect"),
        (rec(status=400, error="bad"), "error_4xx"),
        (rec(status=503, error="no healthy decode worker"), "error_5xx"),
        (rec(status=502, error="prefill failed"), "error_5xx"),
        (rec(status=200, chunks=3, error='{"code":"stream_broken"}'), "stream_error"),
        (rec(status=200, chunks=3), "stream_error"),  # cut before [DONE]
        (rec(status=None, error="ServerDisconnectedError"), "stream_error"),
        (rec(status=200, done=True, end=None), "hung"),  # abandoned at the end
        (rec(status=200, done=True, end=DEADLINE + 0.1), "hung"),  # ok, but too late
        (rec(status=503, end=DEADLINE + 1), "hung"),
        (rec(status=200, disconnected=True, end=DEADLINE + 1), "hung"),
        (rec(status=None, error="client timeout after 90 s", end=90.0), "hung"),
    ],
)
def test_each_request_gets_one_outcome(record, outcome):
    assert classify(record, DEADLINE) == outcome


def test_outcomes_are_counted_with_every_kind_present():
    records = [rec(status=200, done=True), rec(status=200, done=True), rec(end=None)]
    counts = count_outcomes(records, DEADLINE)
    assert list(counts) == list(OUTCOMES)
    assert counts["ok"] == 2 and counts["hung"] == 1 and sum(counts.values()) == 3


def test_prompts_are_seeded_words_of_about_the_asked_length():
    a = make_prompt(random.Random(1), 300)
    assert a == make_prompt(random.Random(1), 300) != make_prompt(random.Random(2), 300)
    assert 280 <= len(a.split()) <= 300


# -------------------------------------------------------------------------- page leaks


def test_pages_leaked_counts_pages_not_free_and_held_pinned_or_reserved():
    assert pages_leaked(health()) == 0
    assert pages_leaked(health(kv_pages_free=97)) == 3
    assert pages_leaked(health(kv_pages_held=2)) == 2
    assert pages_leaked(health(kv_pages_pinned=4, kv_pages_reserved=1)) == 5
    # An older worker: no `load` object, no pinned/reserved fields.
    flat = {"integrity": "ok", "kv_pages_total": 10, "kv_pages_free": 8}
    assert pages_leaked(flat) == 2


def test_settled_needs_no_work_no_pages_and_intact_accounting():
    assert settled(health())
    assert not settled(health(integrity="page 3 in two states"))
    assert not settled(health(kv_pages_free=99))
    for busy in ("running", "waiting", "inflight_transfers", "waiting_for_pages"):
        assert not settled(health(**{busy: 1})), busy


def test_a_worker_that_cannot_be_read_is_not_ok():
    state = worker_end_state("http://w", None, "ClientConnectorError")
    assert state["integrity"].startswith("unreachable") and state["pages_leaked"] is None


# ------------------------------------------------------------------------------ report


def kill(role: str, **kw) -> Kill:
    k = Kill(role, f"http://{role}", 10.0, 3, 6, 0.4, 5.0, 5.5, 7.0)
    for name, value in kw.items():
        setattr(k, name, value)
    return k


def workers(p: dict | None = None, d: dict | None = None) -> dict:
    return {
        "prefill": worker_end_state("http://p", p or health()),
        "decode": worker_end_state("http://d", d or health()),
    }


def test_a_clean_soak_passes_and_its_report_has_every_key():
    records = [rec(status=200, done=True), rec(status=503, error="no healthy decode worker")]
    report = build_report(records, DEADLINE, [kill("decode"), kill("prefill")], workers(), 60, [])
    assert REPORT_KEYS <= set(report)
    assert report["passed"] and report["failures"] == []
    assert report["hung"] == 0 and report["pages_leaked"] == 0 and report["requests"] == 2
    assert report["integrity"] == {"prefill": "ok", "decode": "ok"}
    assert report["kills"][0]["role"] == "decode" and report["kills"][0]["kill_to_eject_s"] == 0.4
    assert report["errors"]["error_5xx"] == ["status 503: no healthy decode worker"]
    orjson.dumps(report)  # one JSON object
    summary = format_summary(report)
    assert summary.startswith("pd-bench soak: PASS") and "kill decode at 10.0 s" in summary


@pytest.mark.parametrize(
    "records, kills, ws, exits, reason",
    [
        ([rec(end=None)], [], workers(), [], "1 requests hung"),
        ([], [], workers(d=health(kv_pages_reserved=3)), [], "3 pages leaked"),
        ([], [], workers(p=health(kv_pages_free=90, kv_pages_pinned=2)), [], "12 pages leaked"),
        ([], [], workers(p=health("refcount of page 7 is 2")), [], "prefill integrity"),
        ([], [kill("decode", kill_to_eject_s=None)], workers(), [], "never ejected"),
        ([], [kill("prefill", restart_to_first_success_s=None)], workers(), [], "no request"),
        ([], [], workers(), ["router exited on its own with code 1"], "router exited"),
    ],
)
def test_a_soak_fails_for_each_reason(records, kills, ws, exits, reason):
    report = build_report(records, DEADLINE, kills, ws, 60, exits)
    assert not report["passed"]
    assert any(reason in f for f in report["failures"]), report["failures"]
    assert format_summary(report).startswith("pd-bench soak: FAIL")


def test_an_unreachable_worker_fails_the_soak():
    ws = {**workers(), "prefill": worker_end_state("http://p", None, "refused")}
    report = build_report([], DEADLINE, [], ws, 60, [])
    assert not report["passed"] and report["integrity"]["prefill"] == "unreachable: refused"


# --------------------------------------------------------------------- the stream client


def _sse(event: dict | str) -> bytes:
    return b"data: " + (event.encode() if isinstance(event, str) else orjson.dumps(event)) + b"\n\n"


CHUNK = {"choices": [{"index": 0, "delta": {"content": " word"}, "finish_reason": None}]}


@pytest.fixture
async def stub(aiohttp_server):
    """A chat endpoint whose behaviour the prompt names: ok, error, cut, 503, slow."""
    seen: dict[str, bool] = {}

    async def chat(request: web.Request) -> web.StreamResponse:
        kind = (await request.json())["messages"][0]["content"]
        if kind == "503":
            return web.json_response({"error": {"message": "no healthy decode worker"}}, status=503)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(5):
                await resp.write(_sse(CHUNK))
                if kind == "slow":
                    await asyncio.sleep(10)
                if kind == "error" and i == 1:
                    await resp.write(_sse({"error": {"code": "stream_broken"}}))
                    return resp
                await asyncio.sleep(0.01)
            if kind != "cut":
                await resp.write(_sse("[DONE]"))
        except (ConnectionResetError, asyncio.CancelledError):
            seen[kind] = True  # the client went away
            raise
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    server = await aiohttp_server(app)  # test servers cancel handlers on disconnect
    return str(server.make_url("")).rstrip("/"), seen


async def _ask(url: str, kind: str, timeout_s: float = 10.0, **kw) -> RequestRecord:
    record = RequestRecord(client=0, start=0.0, **kw)
    async with aiohttp.ClientSession() as http:
        body = {"messages": [{"role": "user", "content": kind}], "stream": True}
        await stream_once(http, url, body, record, timeout_s)
    record.start, record.end = 0.0, 1.0  # classify by what happened, not by how long
    return record


async def test_the_client_reads_streams_to_their_outcome(stub):
    url, seen = stub
    ok = await _ask(url, "ok")
    assert classify(ok, DEADLINE) == "ok" and ok.chunks == 5 and ok.done
    error = await _ask(url, "error")
    assert classify(error, DEADLINE) == "stream_error" and "stream_broken" in (error.error or "")
    cut = await _ask(url, "cut")
    assert classify(cut, DEADLINE) == "stream_error" and cut.chunks == 5 and not cut.done
    busy = await _ask(url, "503")
    assert classify(busy, DEADLINE) == "error_5xx" and "no healthy" in (busy.error or "")


async def test_the_client_disconnects_after_its_chunks_and_the_server_sees_it(stub):
    url, seen = stub
    gone = await _ask(url, "slow", disconnect_after=1)
    assert classify(gone, DEADLINE) == "client_disconnect" and gone.chunks == 1
    for _ in range(100):
        if seen.get("slow"):
            break
        await asyncio.sleep(0.02)
    assert seen.get("slow"), "the server never saw the client go"


async def test_a_silent_stream_runs_into_the_client_timeout(stub):
    url, _ = stub
    slow = await _ask(url, "slow", timeout_s=0.3)
    assert slow.error == "client timeout after 0.3 s" and slow.chunks == 1


# --------------------------------------------------------------------------------- CLI


def test_the_cli_has_the_soak_and_refuses_bad_flags(capsys):
    assert "soak" in SUBCOMMANDS
    parser = argparse.ArgumentParser()
    soak.add_arguments(parser)
    args = parser.parse_args([])
    assert (args.duration, args.clients, args.disconnect_frac, args.threads) == (60.0, 6, 0.2, 1)
    assert args.prefill_timeout + args.read_timeout == 30.0
    bad = parser.parse_args(["--disconnect-frac", "1.5"])
    assert soak.run(bad) == 2  # before anything starts
    assert "--disconnect-frac" in capsys.readouterr().err


# --------------------------------------------------------------------------- real soak


@pytest.mark.slow
@pytest.mark.skipif(not nixl_available(), reason="the KV pull between P and D needs NIXL")
def test_a_short_real_soak_has_no_hung_request_and_no_leaked_page():
    proc = subprocess.run(
        [sys.executable, "-m", "pd.bench.cli", "soak", "--duration", "40", "--json"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.stdout, proc.stderr[-3000:]
    report = orjson.loads(proc.stdout)
    assert REPORT_KEYS <= set(report), report
    assert [k["role"] for k in report["kills"]] == ["decode", "prefill"]
    assert report["outcomes"]["ok"] > 0
    assert report["hung"] == 0, report["errors"]
    assert all(k["kill_to_eject_s"] is not None for k in report["kills"]), report["kills"]
    assert all(k["restart_to_first_success_s"] is not None for k in report["kills"])
    assert report["pages_leaked"] == 0, report["workers"]
    assert report["integrity"] == {"prefill": "ok", "decode": "ok"}, report["workers"]
    assert proc.returncode == 0, report["failures"]
