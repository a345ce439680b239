"""Migration, the workers' half (docs/migration.md §1-3), on the real model: the `: pd-ids` lines
of the router's streams, the continuation `pd_continuation` (a continuation after k tokens goes
on exactly as the uninterrupted run: greedy, seeded, stop strings, a JSON grammar, a tool call),
its 400s, and drain by migration (`: pd-migrate`). Every page is free after each test."""

from __future__ import annotations

import asyncio
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import pytest

from pd.signing import sign_continuation
from pd.transfer import nixl_available
from tests.e2e.conftest import assert_all_pages_free, wait_idle
from tests.e2e.processes import CLUSTER_TOKEN, start_worker, stop, wait_pages_free

pytestmark = pytest.mark.slow  # loads the real model

IDS = {"X-PD-Token-Ids": "1"}
PROMPT = "The history of the city of Paris begins"
COMPLETION = "/v1/completions"
CHAT = "/v1/chat/completions"


@dataclass
class Stream:
    """A raw SSE answer: per event its announced ids (None: no line) and its data."""

    events: list[tuple[tuple[int, list[int]] | None, Any]] = field(default_factory=list)
    migrated: bool = False
    raw: bytes = b""

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1][1] == "[DONE]"

    def chunks(self) -> list[tuple[tuple[int, list[int]] | None, dict]]:
        return [(ids, d) for ids, d in self.events if isinstance(d, dict)]

    def ids(self, index: int = 0) -> list[int]:
        return [t for ids, _ in self.events if ids and ids[0] == index for t in ids[1]]

    def groups(self, index: int = 0) -> list[tuple[list[int], list[dict]]]:
        """Per token-carrying delta of choice `index`: its ids and its events' choices (a tool
        call delta may be several events; the ids open the first)."""
        out: list[tuple[list[int], list[dict]]] = []
        for ids, data in self.chunks():
            for choice in data["choices"]:
                if choice["index"] != index:
                    continue
                if ids is not None:
                    assert ids[0] == index, (ids, choice)
                    out.append((ids[1], [choice]))
                elif out:
                    out[-1][1].append(choice)
        return out

    def text(self, index: int = 0) -> str:
        return "".join(
            _text(c) for _, d in self.chunks() for c in d["choices"] if c["index"] == index
        )

    def finish(self, index: int = 0) -> str | None:
        reasons = [
            c["finish_reason"] for _, d in self.chunks() for c in d["choices"]
            if c["index"] == index and c["finish_reason"]
        ]  # fmt: skip
        return reasons[-1] if reasons else None

    def usage(self) -> dict | None:
        found = [d["usage"] for _, d in self.chunks() if d.get("usage")]
        return found[-1] if found else None


def _text(choice: dict) -> str:
    if "text" in choice:
        return choice["text"]
    return choice["delta"].get("content") or ""


def parse_sse(raw: bytes) -> Stream:
    s = Stream(raw=raw)
    for event in raw.split(b"\n\n"):
        if not event:
            continue
        ids, data = None, None
        for line in event.split(b"\n"):
            if line.startswith(b": pd-ids "):
                assert ids is None and data is None, event  # one line, before the data
                index, *tokens = line[len(b": pd-ids ") :].split(b" ")
                ids = (int(index), [int(t) for t in tokens])
                assert tokens, event
            elif line == b": pd-migrate draining":
                s.migrated = True
            elif line.startswith(b"data: "):
                payload = line[len(b"data: ") :]
                data = "[DONE]" if payload == b"[DONE]" else orjson.loads(payload)
            else:
                raise AssertionError(f"unexpected line {line!r}")
        if data is not None:
            s.events.append((ids, data))
        else:
            assert ids is None, event
    return s


async def sse(post, path: str, body: dict, headers: dict | None = IDS) -> Stream:
    resp = await post(path, json={**body, "stream": True}, headers=headers or {})
    raw = await resp.read()
    assert resp.status == 200, raw
    return parse_sse(raw)


async def continued(client, path: str, body: dict, k: int) -> tuple[Stream, Stream]:
    """The uninterrupted stream of `body`, and the continuation of its choice after k tokens."""
    whole = await sse(client.post, path, body)
    assert whole.done and len(whole.ids()) > k, whole.raw[-400:]
    given = whole.ids()[:k]
    rest = await sse(client.post, path, {**body, "pd_continuation": {"output_token_ids": given}})
    return whole, rest


def assert_goes_on(whole: Stream, rest: Stream, k: int) -> None:
    """`rest` (after k tokens) is exactly what `whole` showed after its k-th token."""
    groups = whole.groups()
    assert [t for ids, _ in groups[:k] for t in ids] == whole.ids()[:k]
    assert rest.ids() == whole.ids()[k:], (rest.ids(), whole.ids()[k:])
    after = "".join(_text(c) for _, cs in groups[k:] for c in cs)
    assert rest.text() == after, (rest.text(), after)
    assert rest.finish() == whole.finish()
    assert rest.done and not rest.migrated


async def settled(worker) -> None:
    await wait_idle(worker)
    assert_all_pages_free(worker)


# ------------------------------------------------------------------------------ pd-ids lines


async def test_ids_lines_per_event_and_choice_none_without_the_header(client, worker):
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 12,
            "temperature": 0.8, "seed": 3, "n": 2, "stream_options": {"include_usage": True}}  # fmt: skip
    s = await sse(client.post, CHAT, body)
    assert s.done
    for ids, data in s.chunks():
        choices = data["choices"]
        if not choices:  # the usage chunk
            assert ids is None
            continue
        (choice,) = choices
        if "role" in choice["delta"]:
            assert ids is None  # role chunks carry no token
        else:
            assert ids is not None and ids[0] == choice["index"], (ids, choice)
    indexes = [ids[0] for ids, _ in s.chunks() if ids]
    assert set(indexes) == {0, 1}
    usage = s.usage()
    assert usage is not None
    assert len(s.ids(0)) + len(s.ids(1)) == usage["completion_tokens"]
    # Each choice's ids are its tokens, as /detokenize reads them back.
    for i in (0, 1):
        resp = await client.post("/detokenize", json={"tokens": s.ids(i)})
        assert (await resp.json())["prompt"] == s.text(i)
    plain = await sse(client.post, CHAT, body, headers=None)
    assert b": pd-" not in plain.raw and plain.done
    assert plain.text(0) == s.text(0) and plain.text(1) == s.text(1)  # the same answer
    await settled(worker)


async def test_ids_lines_for_a_list_of_prompts(client, worker):
    body = {"prompt": ["One, two,", "Red, green,"], "max_tokens": 6, "temperature": 0}
    s = await sse(client.post, COMPLETION, body)
    for ids, data in s.chunks():
        assert ids is not None and ids[0] == data["choices"][0]["index"]
    assert len(s.ids(0)) == len(s.ids(1)) == 6
    await settled(worker)


# ----------------------------------------------------------------------------- continuation


async def test_greedy_continuation_gives_the_uninterrupted_rest(client, worker):
    body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    for k in (1, 10, 39):
        whole, rest = await continued(client, COMPLETION, body, k)
        assert_goes_on(whole, rest, k)
        usage, full = rest.usage(), whole.usage()
        assert usage is not None and full is not None
        assert usage["prompt_tokens"] == full["prompt_tokens"]
        assert usage["completion_tokens"] == 40 - k  # only this worker's tokens
        await settled(worker)


async def test_seeded_continuation_at_temperature_0_8(client, worker):
    body = {"messages": [{"role": "user", "content": "Tell me a story about a cat."}],
            "max_tokens": 32, "temperature": 0.8, "seed": 11, "ignore_eos": True}  # fmt: skip
    whole, rest = await continued(client, CHAT, body, 10)
    assert_goes_on(whole, rest, 10)
    await settled(worker)


async def test_a_stop_string_completed_by_the_first_new_token_is_found(client, worker):
    body = {"prompt": PROMPT, "max_tokens": 30, "temperature": 0, "ignore_eos": True}
    free = await sse(client.post, COMPLETION, body)
    texts = ["".join(_text(c) for c in cs) for _, cs in free.groups()]
    # A stop string across tokens k-1 and k, found nowhere before.
    k = next(
        i for i in range(8, len(texts))
        if len(texts[i - 1].strip()) >= 2 and len(texts[i].strip()) >= 2
        and (texts[i - 1][-2:] + texts[i][:2]) not in "".join(texts[: i - 1]) + texts[i - 1]
    )  # fmt: skip
    stop = texts[k - 1][-2:] + texts[k][:2]
    whole, rest = await continued(client, COMPLETION, {**body, "stop": [stop]}, k)
    assert whole.finish() == "stop" and len(whole.ids()) == k + 1
    assert_goes_on(whole, rest, k)
    assert stop not in whole.text() and whole.text() + stop in free.text()
    await settled(worker)


async def test_a_json_schema_grammar_continues_valid(client, worker):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
              "age": {"type": "integer"}}, "required": ["name", "age"],
              "additionalProperties": False}  # fmt: skip
    body = {"messages": [{"role": "user", "content": "A person as JSON."}], "max_tokens": 60,
            "temperature": 0.8, "seed": 5,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}}  # fmt: skip
    whole, rest = await continued(client, CHAT, body, 6)
    assert_goes_on(whole, rest, 6)
    assert whole.finish() == "stop"
    given = "".join(_text(c) for _, cs in whole.groups()[:6] for c in cs)
    value = orjson.loads(given + rest.text())
    assert set(value) == {"name", "age"}
    await settled(worker)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
    "required": ["city"], "additionalProperties": False}}}]  # fmt: skip


async def test_a_tool_call_continues_without_a_second_id_or_name(client, worker):
    body = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "tools": TOOLS, "tool_choice": "required", "max_tokens": 60, "temperature": 0}  # fmt: skip
    whole = await sse(client.post, CHAT, body)
    groups = whole.groups()
    named = next(
        i for i, (_, cs) in enumerate(groups)
        if any(c["delta"].get("tool_calls", [{}])[0].get("id") for c in cs)
    )  # fmt: skip
    k = named + 3  # the call's id and name went out; its arguments are streaming
    assert k < len(groups) - 2, groups
    rest = await sse(
        client.post, CHAT, {**body, "pd_continuation": {"output_token_ids": whole.ids()[:k]}}
    )
    assert rest.ids() == whole.ids()[k:]
    calls = [tc for _, d in rest.chunks() for c in d["choices"]
             for tc in c["delta"].get("tool_calls") or ()]  # fmt: skip
    # The call under way goes on with argument pieces only (a later call has its own id).
    assert calls and calls[0]["index"] == 0
    assert all("id" not in tc and "name" not in tc["function"] for tc in calls if tc["index"] == 0)

    def without_ids(choices: list[dict]) -> list[dict]:  # call ids are random
        out = []
        for c in choices:
            calls = c["delta"].get("tool_calls")
            if calls:
                calls = [{k: v for k, v in tc.items() if k != "id"} for tc in calls]
                c = {**c, "delta": {**c["delta"], "tool_calls": calls}}
            out.append(c)
        return out

    assert without_ids([c for _, cs in rest.groups() for c in cs]) == without_ids(
        [c for _, cs in groups[k:] for c in cs]
    )

    def arguments(choices: list[dict]) -> str:
        return "".join(
            tc.get("function", {}).get("arguments", "")
            for c in choices for tc in c["delta"].get("tool_calls") or () if tc["index"] == 0
        )  # fmt: skip

    first = arguments([c for _, cs in groups[:k] for c in cs])
    assert first + arguments([c for _, d in rest.chunks() for c in d["choices"]]) == arguments(
        [c for _, cs in groups for c in cs]
    )
    assert orjson.loads(arguments([c for _, cs in groups for c in cs]))["city"]
    assert rest.finish() == whole.finish() == "tool_calls"
    await settled(worker)


async def test_the_budget_counts_the_given_ids(client, worker):
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    whole = await sse(client.post, COMPLETION, body)
    ids = whole.ids()
    for given, new in ((ids[:3], 2), (ids, 0), (ids + ids[:2], 0)):
        s = await sse(
            client.post, COMPLETION, {**body, "pd_continuation": {"output_token_ids": given}}
        )
        assert len(s.ids()) == new and s.finish() == "length" and s.done
        assert s.usage()["completion_tokens"] == new  # type: ignore[index]
    # Not streamed: the same answer, the prompt not echoed again.
    del body["stream_options"]
    resp = await client.post(
        COMPLETION, json={**body, "echo": True, "pd_continuation": {"output_token_ids": ids[:3]}}
    )
    answer = await resp.json()
    assert answer["choices"][0]["text"] == "".join(
        _text(c) for _, cs in whole.groups()[3:] for c in cs
    )
    assert answer["usage"]["completion_tokens"] == 2
    await settled(worker)


@pytest.mark.parametrize(
    "extra",
    [
        {"pd_continuation": [1, 2]},
        {"pd_continuation": {"output_token_ids": [1], "more": 1}},
        {"pd_continuation": {"output_token_ids": "1 2"}},
        {"pd_continuation": {"output_token_ids": [True]}},
        {"pd_continuation": {"output_token_ids": [10**7]}},  # past any vocabulary
        {"pd_continuation": {"output_token_ids": [60000]}},  # past this one's (49152)
        {"pd_continuation": {"output_token_ids": [1] * 2100}},  # past the 2048 context
        {"pd_continuation": {"output_token_ids": [1]}, "n": 2},
        {"pd_continuation": {"output_token_ids": [1]}, "prompt": ["a", "b"]},
    ],
)
async def test_a_malformed_continuation_is_a_400(client, worker, extra):
    body = {"prompt": PROMPT, "max_tokens": 4, **extra}
    resp = await client.post(COMPLETION, json=body)
    answer = await resp.json()
    assert resp.status == 400, answer
    error = answer["error"]
    assert error["param"] == "pd_continuation" and error["code"] == "invalid_value", error
    assert error["type"] == "invalid_request_error" and error["message"]
    await settled(worker)


# ---------------------------------------------------------------------------- drain


async def test_migrate_streams_ends_the_routers_streams_and_frees_their_pages(client, worker):
    long = {"prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    tasks = [asyncio.create_task(sse(client.post, COMPLETION, long)) for _ in range(2)]
    tasks.append(asyncio.create_task(sse(client.post, COMPLETION, {**long, "n": 2})))
    plain = asyncio.create_task(sse(client.post, COMPLETION, {**long, "max_tokens": 30}, None))
    # Every choice of the three streams has tokens out.
    while len(worker.migratable) < 3 or not all(
        len(h.seq.output_ids) > 2 for choices in worker.migratable for h in choices
    ):
        await asyncio.sleep(0.02)
    assert worker.migrate_streams() == 3
    for s in await asyncio.gather(*tasks):
        assert s.migrated and not s.done, s.raw[-200:]
        assert s.raw.endswith(b"\n\n: pd-migrate draining\n\n")
        assert 0 < len(s.ids()) < 400 and s.finish() is None
    unmigrated = await plain
    assert unmigrated.done and unmigrated.finish() == "length" and not unmigrated.migrated
    assert not worker.migratable
    await settled(worker)


# ------------------------------------------------------------------- real processes (e2e)


async def _post_stream(http: aiohttp.ClientSession, url: str, body: dict) -> Stream:
    return await sse(lambda p, **kw: http.post(url + p, **kw), COMPLETION, body)


async def test_sigterm_migrates_the_routers_streams_and_exits_fast():
    proc, url = start_worker("--role", "both", "--dtype", "float32", "--quantization", "none", "--kv-pages", "256",
                             "--max-model-len", "2048", "--threads", "1")  # fmt: skip
    try:
        body = {"prompt": PROMPT, "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
        async with aiohttp.ClientSession() as http:
            tasks = [asyncio.create_task(_post_stream(http, url, body)) for _ in range(4)]
            while True:  # every stream under way
                load = await (await http.get(f"{url}/health")).json()
                if load["running"] == 4:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            streams = await asyncio.wait_for(asyncio.gather(*tasks), 10)
        await asyncio.get_running_loop().run_in_executor(None, proc.wait, 10)
        took = time.monotonic() - t0
        print(f"exited {took:.2f} s after SIGTERM")
        assert took < 10 and proc.returncode == 0
        for s in streams:
            assert s.migrated and not s.done and s.ids(), s.raw[-200:]
    finally:
        stop(proc)


@pytest.mark.skipif(not nixl_available(), reason="the KV pull needs a NIXL package")
async def test_pd_continuation_through_prefill_and_decode(fp32_pair):
    p_url, d_url = fp32_pair
    body = {"prompt": PROMPT, "max_tokens": 64, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    async with aiohttp.ClientSession() as http:

        async def via_pd(extra: dict) -> Stream:
            prefill = {**body, **extra, "stream": False, "max_tokens": 1,
                       "kv_transfer_params": {"do_remote_decode": True, "max_tokens": 64}}  # fmt: skip
            del prefill["stream_options"]
            resp = await http.post(p_url + COMPLETION, json=prefill)
            answer = await resp.json()
            assert resp.status == 200, answer
            kvp = answer["kv_transfer_params"]
            given = extra.get("pd_continuation", {}).get("output_token_ids")
            assert kvp["output_token_ids"] == given
            assert kvp["num_tokens"] == len(kvp["prompt_token_ids"]) + len(given or [])
            decode = {**body, **extra, "kv_transfer_params": kvp}
            return await sse(lambda p, **kw: http.post(d_url + p, **kw), COMPLETION, decode)

        whole = await via_pd({})
        assert len(whole.ids()) == 64
        # Signed as the router signs it (pd/signing.py): P and D check it, and P signs its params.
        ten = {**body, "pd_continuation": {"output_token_ids": whole.ids()[:10]}}
        signed = sign_continuation(CLUSTER_TOKEN.encode(), ten)["pd_continuation"]
        rest = await via_pd({"pd_continuation": signed})
        assert_goes_on(whole, rest, 10)
        assert rest.usage()["completion_tokens"] == 54  # type: ignore[index]
        # D refuses params that disagree with the continuation.
        prefill = {"prompt": PROMPT, "temperature": 0, "max_tokens": 1,
                   "kv_transfer_params": {"do_remote_decode": True, "max_tokens": 64}}  # fmt: skip
        kvp = (await (await http.post(p_url + COMPLETION, json=prefill)).json())[
            "kv_transfer_params"
        ]
        resp = await http.post(
            d_url + COMPLETION,
            json={**body, "stream": True, "kv_transfer_params": kvp,
                  "pd_continuation": {"output_token_ids": whole.ids()[:3]}},
        )  # fmt: skip
        assert resp.status == 400 and (await resp.json())["error"]["param"] == "pd_continuation"
        # P's params are signed; D refuses them changed (here another first token), even from
        # loopback, and pulls nothing.
        forged = {**kvp, "first_token_id": (kvp["first_token_id"] + 1) % 1000}
        forged_body = {**body, "stream": True, "kv_transfer_params": forged}
        resp = await http.post(d_url + COMPLETION, json=forged_body)
        error = (await resp.json())["error"]
        assert resp.status == 403 and error["code"] == "unsigned_internal_field", error
        await http.post(p_url + "/kv/release", json={"transfer_id": kvp["transfer_id"]})
        for url in (p_url, d_url):
            await wait_pages_free(http, url)
