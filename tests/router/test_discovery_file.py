"""`pd-router --discovery file`: the workers of a watched file of `ROLE URL` lines join and
leave the router; a removed worker's streams finish; a bad file keeps the last good list; only
the workers the file added are ever removed (issue 44)."""

from __future__ import annotations

import asyncio
import os

import pytest

from pd.router import RouterConfig
from pd.router.discovery import WorkerSet, parse_worker_file
from pd.router.registry import Registry
from tests.router.conftest import COMPLETION, registry_of, sse_events, wait_for


def test_a_worker_file_is_roles_and_urls_with_comments() -> None:
    text = """
    # the prefill workers
    prefill http://10.0.0.1:8001
    decode  http://10.0.0.2:8002/   # a trailing slash is the same URL
    both 10.0.0.3:8003
    """
    assert parse_worker_file(text) == {
        "http://10.0.0.1:8001": "prefill",
        "http://10.0.0.2:8002": "decode",
        "http://10.0.0.3:8003": "both",
    }
    assert parse_worker_file("") == {}


@pytest.mark.parametrize(
    "text, why",
    [
        ("router http://h:1", "line 1: expected 'ROLE URL'"),
        ("prefill", "line 1: expected 'ROLE URL'"),
        ("decode http://h:1 extra", "line 1"),
        ("\nprefill http://h:1\ndecode http://h:1", "line 3: http://h:1 is listed as prefill"),
        ("prefill ftp://h:1", "line 1"),
    ],
)
def test_a_bad_line_is_named(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_worker_file(text)


def test_the_set_removes_only_what_it_added() -> None:
    registry = Registry(RouterConfig(prefill=("http://flag:1",)))
    s = WorkerSet(registry, "test")
    s.apply({"http://flag:1": "prefill", "http://d:2": "decode"})
    assert registry.find("http://d:2") is not None and s.owned == {"http://d:2": "decode"}
    s.apply({})  # the flag's worker stays; the file's goes
    assert registry.find("http://flag:1") is not None
    assert registry.find("http://d:2") is None
    s.apply({"http://d:2": "both"})
    s.apply({"http://d:2": "decode"})  # a new role: moved to its pool
    assert registry.find("http://d:2").role == "decode" and s.changes == 4  # type: ignore[union-attr]


def _write(path: str, text: str) -> None:
    """As an orchestrator would: a new file renamed over the old one."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


async def test_workers_join_and_leave_with_the_file_and_a_removed_ones_stream_finishes(
    stub, router, tmp_path
):
    p, d1, d2 = await stub("prefill"), await stub("decode"), await stub("decode")
    d1.chunk_delay = 0.05  # a stream of 8 chunks: ~0.4 s
    path = str(tmp_path / "workers")
    _write(path, f"prefill {p.url}\ndecode {d1.url}\n")
    client = await router(discovery="file", discovery_file=path, discovery_interval_s=0.05)
    reg = registry_of(client)
    await wait_for(lambda: bool(reg.prefill.healthy and reg.decode.healthy), timeout=15.0)
    resp = await client.post("/v1/completions", json={**COMPLETION, "stream": True})
    assert resp.status == 200
    first = await resp.content.readline()  # the stream is on d1
    assert first.startswith(b"data: ")
    _write(path, f"prefill {p.url}\ndecode {d2.url}\n")  # d1 leaves, d2 joins
    await wait_for(lambda: d1.url not in reg.decode.workers and d2.url in reg.decode.workers)
    rest = first + await resp.read()
    events = sse_events(rest)
    assert events[-1] == b"[DONE]" and len(events) == d1.chunks + 1, events  # whole
    assert not any(b'"error"' in e for e in events), events
    await wait_for(lambda: bool(reg.decode.healthy), timeout=15.0)
    before = len(d1.requests)
    assert (await client.post("/v1/completions", json=COMPLETION)).status == 200
    assert len(d1.requests) == before and len(d2.requests) == 1  # new work goes to d2
    # A half-written or wrong file keeps the last good list.
    _write(path, f"prefill {p.url}\ndecoder {d2.url}\n")
    await asyncio.sleep(0.3)
    assert set(reg.decode.workers) == {d2.url} and set(reg.prefill.workers) == {p.url}
    os.remove(path)
    await asyncio.sleep(0.3)
    assert set(reg.decode.workers) == {d2.url}
    _write(path, f"prefill {p.url}\n")  # and a good one applies again
    await wait_for(lambda: not reg.decode.workers)
    assert (await client.post("/v1/completions", json=COMPLETION)).status == 503


def test_the_flags_go_together() -> None:
    with pytest.raises(ValueError, match="--discovery file and --discovery-file"):
        RouterConfig(discovery="file")
    with pytest.raises(ValueError, match="--discovery file and --discovery-file"):
        RouterConfig(discovery_file="/x")
    with pytest.raises(ValueError, match="--discovery must be one of"):
        RouterConfig(discovery="dns")
