"""Migration of a broken stream (docs/migration.md §4): the client sees one uninterrupted answer."""

from __future__ import annotations

import asyncio
import logging
import re
from functools import partial

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pd.router.keys import HEALTH
from pd.signing import CONTINUATION, SIG, Guard, continuation_payload
from tests.router.conftest import CHAT, COMPLETION, registry_of, sse_events, wait_for
from tests.router.test_cache_routing import metric

CHUNKS = 6
CHAT_PATH, COMPLETION_PATH = "/v1/chat/completions", "/v1/completions"


def idle(client) -> bool:
    return all(w.inflight == 0 and w.inflight_tokens == 0 for w in registry_of(client))


async def two_of(stub, router, mode: str, **cfg):
    """(router client, [P or None], the two stream workers): P + 2 D, or 2 co-located."""
    kw = dict(positional=True, chunks=CHUNKS)
    if mode == "pd":
        p = await stub("prefill", **kw)
        ws = [await stub("decode", **kw), await stub("decode", **kw)]
        client = await router(prefill=[p], decode=ws, policy="round-robin", **cfg)
        return client, p, ws
    ws = [await stub("both", **kw), await stub("both", **kw)]
    return await router(worker=ws, policy="round-robin", **cfg), None, ws


def body_of(chat: bool, stream: bool, usage: bool, **extra) -> dict:
    body = {**(CHAT if chat else COMPLETION), "max_tokens": 16, "stream": stream, **extra}
    if usage:
        body["stream_options"] = {"include_usage": True}
    return body


def read_stream(raw: bytes, chat: bool) -> dict:
    """A client's view of a stream: text and finish per index, ids, usage, [DONE]s, roles."""
    events = sse_events(raw)
    assert events[-1] == b"[DONE]" and events.count(b"[DONE]") == 1, events[-3:]
    assert b": pd-" not in raw  # the router's comments never reach the client
    chunks = [orjson.loads(e) for e in events[:-1]]
    text: dict[int, str] = {}
    finish: dict[int, str] = {}
    roles: dict[int, int] = {}
    usage = None
    for c in chunks:
        assert "error" not in c, c
        if not c["choices"]:
            assert usage is None  # one usage chunk
            usage = c["usage"]
            continue
        for choice in c["choices"]:
            i = choice["index"]
            piece = choice["delta"].get("content", "") if chat else choice["text"]
            text[i] = text.get(i, "") + (piece or "")
            if chat and "role" in choice["delta"]:
                roles[i] = roles.get(i, 0) + 1
            if choice["finish_reason"] is not None:
                assert i not in finish  # one finish per choice
                finish[i] = choice["finish_reason"]
    return {
        "text": text,
        "finish": finish,
        "ids": {c["id"] for c in chunks},
        "created": {c["created"] for c in chunks},
        "usage": usage,
        "roles": roles,
    }


async def answer_of(client, path: str, body: dict, chat: bool):
    resp = await client.post(path, json=body)
    assert resp.status == 200, await resp.text()
    if not body["stream"]:
        answer = await resp.json()
        text = {c["index"]: c["message"]["content"] if chat else c["text"]
                for c in answer["choices"]}  # fmt: skip
        finish = {c["index"]: c["finish_reason"] for c in answer["choices"]}
        return {"text": text, "finish": finish, "usage": answer["usage"]}
    view = read_stream(await resp.read(), chat)
    assert len(view["ids"]) == 1 and len(view["created"]) == 1
    if chat:
        assert set(view["roles"].values()) == {1}, view["roles"]  # one role chunk per choice
    del view["ids"], view["created"], view["roles"]
    return view


BREAKS = {
    "before the first byte": dict(break_at=0),
    "mid-chunk": dict(break_at=2, break_mid=True),
    "after the last token, before [DONE]": dict(break_before_done=True),
}


@pytest.mark.parametrize("mode", ["pd", "both"])
@pytest.mark.parametrize("endpoint", ["chat", "completion"])
@pytest.mark.parametrize("shape", ["stream", "stream+usage", "json"])
@pytest.mark.parametrize("point", list(BREAKS))
async def test_a_stream_broken_anywhere_reads_as_uninterrupted(
    stub, router, mode, endpoint, shape, point
):
    chat = endpoint == "chat"
    path = CHAT_PATH if chat else COMPLETION_PATH
    client, p, ws = await two_of(stub, router, mode)
    body = body_of(chat, shape != "json", shape == "stream+usage")
    reference = await answer_of(client, path, body, chat)  # on ws[0] (round-robin)
    assert reference["text"] == {0: "".join(f"t{i} " for i in range(CHUNKS))}
    broken, other = ws[1], ws[0]
    for k, v in BREAKS[point].items():
        setattr(broken, k, v)
    broken.break_times = 1
    before = len(other.requests)
    got = await answer_of(client, path, body, chat)
    assert got == reference
    assert broken.break_times == 0  # it did break
    continued = [b for b in other.requests[before:] if "pd_continuation" in b and b["stream"]]
    asked = (p or other).requests  # the usage probe (no stream) goes to P, or a co-located one
    probes = [b for b in asked if "pd_continuation" in b and not b["stream"]]
    if point == "mid-chunk":  # two whole events relayed; the half one was held back
        (leg,) = continued
        assert leg["pd_continuation"] == {"output_token_ids": [100, 101]}
        assert leg["n"] == 1 and leg["stream"] is True
        if p is not None:  # P got it too, for one token
            (p_leg,) = [b for b in p.requests if "pd_continuation" in b]
            assert p_leg["max_tokens"] == 1 and p_leg["pd_continuation"] == leg["pd_continuation"]
        assert metric(client, "pd_router_migrations_total", reason="broken") == 1
        assert metric(client, "pd_router_migration_wait_seconds_count") == 1
    elif point == "before the first byte":  # a retry, not a migration
        assert continued == [] and metric(client, "pd_router_migrations_total") == 0
    else:  # every token came: nothing to continue (the usage asked of a worker when needed)
        assert continued == []
        if shape == "stream":
            assert probes == []
        else:
            (probe,) = probes
            assert probe["max_tokens"] == CHUNKS and "kv_transfer_params" not in probe
            ids = list(range(100, 100 + CHUNKS))
            assert probe["pd_continuation"] == {"output_token_ids": ids}
    await wait_for(lambda: idle(client))


@pytest.mark.parametrize("stream", [True, False])
async def test_n_2_with_one_choice_migrating(stub, router, stream):
    client, p, ws = await two_of(stub, router, "pd")
    for w in (*ws, p):
        w.seed_lengths = {10: 2}  # choice 0 (seed 10) has two tokens, choice 1 (seed 11) six
    body = body_of(False, stream, stream, n=2, seed=10)
    reference = await answer_of(client, COMPLETION_PATH, body, False)
    assert reference["text"] == {0: "s10t0 s10t1 ", 1: "".join(f"s11t{i} " for i in range(6))}
    assert reference["finish"] == {0: "stop", 1: "length"}
    # Events: t0 of 0 and 1, t1 of 0 (its end) and 1, t2 of 1, then the break.
    ws[1].break_at, ws[1].break_times = 5, 1
    got = await answer_of(client, COMPLETION_PATH, body, False)
    assert got == reference
    (leg,) = [b for b in ws[0].requests if "pd_continuation" in b]
    assert leg["seed"] == 11 and leg["n"] == 1
    assert leg["pd_continuation"] == {"output_token_ids": [100, 101, 102]}
    assert idle(client)


@pytest.mark.parametrize("stream", [True, False])
async def test_the_migration_limit_is_per_choice(stub, router, stream):
    """An n=4 stream whose worker breaks once continues all four choices (four legs), within
    a limit of one migration a choice."""
    client, p, ws = await two_of(stub, router, "pd", migration_limit=1)
    body = body_of(False, stream, stream, n=4, seed=10)
    reference = await answer_of(client, COMPLETION_PATH, body, False)
    ws[1].break_at, ws[1].break_times = 3, 1
    got = await answer_of(client, COMPLETION_PATH, body, False)
    assert got == reference
    assert len([b for b in ws[0].requests if "pd_continuation" in b]) == 4
    assert idle(client)


@pytest.mark.parametrize("stream", [True, False])
async def test_a_list_of_prompts_migrates_each_prompt_on_its_own(stub, router, stream):
    client, p, ws = await two_of(stub, router, "both")
    body = {**body_of(False, stream, stream), "prompt": ["alpha", "beta beta"]}
    resp = await client.post(COMPLETION_PATH, json=body)
    reference = await resp.read()
    ws[0].break_at, ws[0].break_mid, ws[0].break_times = 3, True, 1
    resp = await client.post(COMPLETION_PATH, json=body)
    assert resp.status == 200
    raw = await resp.read()
    if stream:
        got, want = read_stream(raw, False), read_stream(reference, False)
        assert (
            got["text"] == want["text"] == {i: "".join(f"t{k} " for k in range(6)) for i in (0, 1)}
        )
        assert got["usage"] == want["usage"] and len(got["ids"]) == 1
    else:
        got, want = orjson.loads(raw), orjson.loads(reference)
        assert got["choices"] == want["choices"] and got["usage"] == want["usage"]
    assert metric(client, "pd_router_migrations_total") == 1
    assert idle(client)


@pytest.mark.parametrize("stream", [True, False])
async def test_past_the_migration_limit_the_stream_ends_with_todays_error(stub, router, stream):
    kw = dict(positional=True, chunks=CHUNKS, break_at=2)  # every stream breaks, always
    ws = [await stub("both", **kw) for _ in range(3)]
    client = await router(worker=ws, migration_limit=1)
    resp = await client.post(COMPLETION_PATH, json=body_of(False, stream, False))
    if stream:
        assert resp.status == 200
        events = sse_events(await resp.read())
        assert b"[DONE]" not in events
        error = orjson.loads(events[-1])["error"]
        texts = [orjson.loads(e)["choices"][0]["text"] for e in events[:-1]]
        assert texts == ["t0 ", "t1 ", "t2 ", "t3 "]  # two of each leg
    else:
        assert resp.status == 502
        error = (await resp.json())["error"]
    assert error["code"] == "stream_broken"
    assert metric(client, "pd_router_migrations_total", reason="broken") == 1
    assert sum(len(w.requests) for w in ws) == 2  # the first leg and one continuation
    assert idle(client)


async def test_pd_migrate_migrates_and_the_worker_gets_no_new_request(stub, router, caplog):
    client, p, ws = await two_of(stub, router, "pd", health_interval=60.0)
    body = body_of(True, True, True)
    reference = await answer_of(client, CHAT_PATH, body, True)  # on ws[0]
    ws[1].migrate_at = 3  # it drains: every stream opened with the header migrates
    with caplog.at_level(logging.INFO, logger="pd.router"):
        got = await answer_of(client, CHAT_PATH, body, True)
    assert got == reference
    assert metric(client, "pd_router_migrations_total", reason="draining") == 1
    assert any("migrates after 3 tokens" in r.getMessage() for r in caplog.records)
    reg = registry_of(client)
    drained = reg.decode.workers[ws[1].url]
    assert not drained.ready and drained.healthy  # at once, not at the next health poll
    assert drained not in reg.decode.healthy  # (not ejected: its other streams go on)
    seen = len(ws[1].requests)
    for _ in range(3):
        assert await answer_of(client, CHAT_PATH, body, True) == reference
    assert len(ws[1].requests) == seen  # no new request
    await client.server.app[HEALTH].check_all()  # its /health says ready: new requests again
    assert drained.ready and drained in reg.decode.healthy


async def test_a_silent_stream_migrates_after_the_idle_timeout(stub, router):
    client, p, ws = await two_of(stub, router, "both", stream_idle_timeout_s=0.2)
    body = body_of(False, True, True)
    reference = await answer_of(client, COMPLETION_PATH, body, False)
    ws[1].silent_at, ws[1].break_times = 2, 1
    got = await answer_of(client, COMPLETION_PATH, body, False)
    assert got == reference
    assert metric(client, "pd_router_migrations_total", reason="idle") == 1
    await wait_for(lambda: ws[1].cancelled == 1 and ws[1].active == 0)  # it was told
    assert idle(client)


async def test_the_request_id_names_the_migration_in_the_log(stub, router, caplog):
    client, p, ws = await two_of(stub, router, "both")
    ws[0].break_at, ws[0].break_times = 1, 1
    with caplog.at_level(logging.INFO, logger="pd.router"):
        resp = await client.post(
            COMPLETION_PATH, json=body_of(False, False, False), headers={"X-Request-Id": "r-42"}
        )
        assert resp.status == 200
    lines = [r.getMessage() for r in caplog.records if "migrat" in r.getMessage()]
    assert len(lines) == 2, lines
    assert lines[0].startswith("request r-42: choice 0 migrates after 1")
    # Then the wait, once the continuation's first byte came (pd-bench soak reads it).
    assert re.fullmatch(r"request r-42: choice 0 resumed \d+\.\d{3} s after the break, migration 1",
                        lines[1]), lines[1]  # fmt: skip


async def test_a_client_leaving_during_a_migration_leaves_nothing_held(stub, router):
    client, p, ws = await two_of(stub, router, "pd")
    ws[0].break_at, ws[0].break_times = 2, 1
    ws[1].delay = 5.0  # the continuation's D keeps the client waiting
    resp = await client.post(COMPLETION_PATH, json=body_of(False, True, False))
    assert resp.status == 200
    await resp.content.readany()  # the first leg's events
    await wait_for(lambda: ws[1].active == 1)  # P prefilled the continuation, D2 holds it
    resp.close()  # the client goes away
    await wait_for(lambda: ws[1].active == 0 and ws[1].cancelled == 1)
    await wait_for(lambda: len(p.released) == 1)  # P's pages of the continuation released
    (cont,) = [b for b in p.requests if "pd_continuation" in b]
    assert p.released[0]["transfer_id"] is not None
    assert cont["pd_continuation"] == {"output_token_ids": [100, 101]}
    await wait_for(lambda: idle(client))
    await asyncio.sleep(0)


@pytest.mark.parametrize("mode", ["pd", "both"])
async def test_a_router_with_a_cluster_token_signs_its_continuations(stub, router, mode):
    """Each leg's continuation carries the router's signature (pd/signing.py), which a worker
    with the same token accepts from another host, bound to the request's prompt."""
    client, p, ws = await two_of(stub, router, mode, cluster_token="tok")
    body = body_of(True, True, True)
    reference = await answer_of(client, CHAT_PATH, body, True)
    ws[1].break_at, ws[1].break_times = 2, 1
    assert await answer_of(client, CHAT_PATH, body, True) == reference
    legs = [b for w in (*ws, *([p] if p else [])) for b in w.requests if CONTINUATION in b]
    assert len(legs) == (2 if mode == "pd" else 1)  # (P and D see the leg in PD)
    for leg in legs:
        Guard(b"tok").check(
            CONTINUATION, "192.0.2.9", continuation_payload(leg), leg[CONTINUATION][SIG]
        )
        assert leg["messages"] == body["messages"]
    assert idle(client)


async def test_a_client_cannot_send_its_own_continuation(stub, router):
    client, p, ws = await two_of(stub, router, "both", ignore_unknown_fields=True)
    body = {**body_of(False, False, False), "pd_continuation": {"output_token_ids": [1, 2]}}
    resp = await client.post(COMPLETION_PATH, json=body)
    assert resp.status == 200
    assert all("pd_continuation" not in b for w in ws for b in w.requests)


async def test_a_worker_ejected_mid_stream_migrates(stub, router):
    client, p, ws = await two_of(stub, router, "pd")
    body = body_of(False, False, False)
    reference = await answer_of(client, COMPLETION_PATH, body, False)  # on ws[0]
    ws[1].chunk_delay = 0.1
    task = asyncio.ensure_future(answer_of(client, COMPLETION_PATH, body, False))
    await wait_for(lambda: len(ws[1].requests) == 1)
    await asyncio.sleep(0.15)  # a token or two relayed
    ws[1].health_status = 503  # the health checks eject it
    assert await task == reference
    assert metric(client, "pd_router_migrations_total", reason="ejected") == 1
    assert not registry_of(client).decode.workers[ws[1].url].healthy
    await wait_for(lambda: idle(client))


def _event(i: int, finish: str | None = None, index: int = 0) -> bytes:
    choice = {"index": index, "text": f"t{i} ", "finish_reason": finish}
    data = orjson.dumps({"id": "cmpl-a", "created": 7, "choices": [choice]})
    return f": pd-ids {index} {100 + i}\n".encode() + b"data: " + data + b"\n\n"


def test_the_tracker_relays_whole_events_without_pd_lines_however_the_bytes_are_cut():
    from pd.router.tracker import Tracker

    stream = b"".join([_event(0), _event(1, index=1), b": pd-migrate draining\n\n"])
    want = b"".join(e[e.index(b"data: ") :] for e in (_event(0), _event(1, index=1)))
    for cut in range(1, len(stream)):  # every split of the stream into two reads
        drained: list[int] = []
        t = Tracker(None, partial(drained.append, 1))  # type: ignore[arg-type]
        out = t.feed(stream[:cut]) + t.feed(stream[cut:])
        assert out == want, cut
        assert t.ids_of(0) == [100] and t.ids_of(1) == [101] and t.count() == 2
        assert t.migrate and drained == [1]
        assert orjson.loads(t.head or b"{}")["id"] == "cmpl-a"
    t = Tracker(None)  # type: ignore[arg-type]
    assert t.feed(_event(0)[:-5]) == b""  # a partial event is held back, its ids not counted
    assert t.ids_of(0) == [] and t.finished == set()
    assert t.feed(_event(0)[-5:] + _event(1, "length")).count(b"data: ") == 2
    assert t.ids_of(0) == [100, 101] and t.finished == {0}


async def test_a_decode_local_stream_migrates_decode_local(stub, router):
    client, p, ws = await two_of(stub, router, "pd", local_prefill_max_tokens=1024)
    body = body_of(True, True, True)
    reference = await answer_of(client, CHAT_PATH, body, True)
    assert p.requests == []  # decode-local: D prefilled itself
    ws[1].break_at, ws[1].break_mid, ws[1].break_times = 3, True, 1
    assert await answer_of(client, CHAT_PATH, body, True) == reference
    (leg,) = [b for b in ws[0].requests if "pd_continuation" in b]
    assert leg["pd_continuation"] == {"output_token_ids": [100, 101, 102]}
    assert "kv_transfer_params" not in leg and p.requests == []
    assert idle(client)


def _reference(stream: bytes) -> tuple[bytes, list[bytes], bool]:
    """What the tracker makes of a whole stream, line by line: the events less their `: pd-`
    lines (an event left empty dropped), the ids lines' text, whether `: pd-migrate` came."""
    out, ids, migrate = [], [], False
    for event in stream.split(b"\n\n")[:-1]:
        kept = []
        for line in event.split(b"\n"):
            if line.startswith(b": pd-ids "):
                ids.append(line[9:])
            elif line.split(b" ", 2)[1] == b"pd-migrate":
                migrate = True
            elif not line.startswith(b": pd-"):
                kept.append(line)
        if kept:
            out.append(b"\n".join(kept) + b"\n\n")
    return b"".join(out), ids, migrate


_TEXTS = st.sampled_from(["t", "a: pd-ids 1 2", "\n: pd-x", "x\n\ny", ": pd-migrate", ""])


def _token_event(index: int, text: str, finish: str | None) -> bytes:
    choice = {"index": index, "text": text, "finish_reason": finish}
    data = orjson.dumps({"id": "cmpl-a", "created": 7, "choices": [choice]})
    return f": pd-ids {index} {len(text)}\n".encode() + b"data: " + data + b"\n\n"


_EVENTS = st.one_of(
    st.builds(_token_event, st.integers(0, 2), _TEXTS, st.sampled_from([None, "stop"])),
    st.just(b'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n'),
    st.just(b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n'),
    st.just(b": pd-migrate draining\n\n"),
    st.just(b": pd-ids 0 7\n: pd-migrated 1\ndata: {}\n\n"),  # shapes the contract does not use:
    st.just(b": pd-ids 1 8\n\n"),  # still stripped exactly
    st.just(b"data: {}\n: pd-ids 0 9\n\n"),
)


@given(
    events=st.lists(_EVENTS, max_size=12),
    cuts=st.lists(st.integers(0, 2000), max_size=8),
    tail=st.sampled_from([b"", b"data: [DONE]\n\n", b": pd-ids 0 1\nda"]),
)
@settings(max_examples=200, deadline=None)
def test_the_tracker_matches_a_line_by_line_reading(events, cuts, tail):
    from pd.router.tracker import Tracker

    stream = b"".join(events) + tail
    whole = stream[: stream.rfind(b"\n\n") + 2] if b"\n\n" in stream else b""
    want, ids, migrate = _reference(whole)
    drained: list[int] = []
    t = Tracker(None, partial(drained.append, 1))  # type: ignore[arg-type]
    at, out = 0, []
    for cut in sorted({min(c, len(stream)) for c in cuts} | {len(stream)}):
        piece = t.feed(stream[at:cut])
        assert piece == b"" or piece.endswith(b"\n\n")  # whole events only
        out.append(piece)
        at = cut
    assert b"".join(out) == want
    for index in range(3):
        want_ids = [
            int(i) for line in ids if line.split()[0] == b"%d" % index for i in line.split()[1:]
        ]
        assert t.ids_of(index) == want_ids
    assert t.count() == sum(len(line.split()) - 1 for line in ids)
    assert t.migrate == migrate and drained == ([1] if migrate else [])
    want_finished = {
        c["index"]
        for e in _reference(whole)[0].split(b"\n\n")
        if e.startswith(b"data: {")
        for c in orjson.loads(e[6:]).get("choices", ())
        if c.get("finish_reason")
    }
    assert t.finished == want_finished
