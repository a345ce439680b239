"""The HTTP handler against a stand-in role and engine (no model, no tokenizer files): every 4xx
and 503 it answers itself or passes on from the role is an OpenAI error object, a refused
request queues nothing, and a served one is aborted in the handler's `finally` (a no-op once
finished). The handler asks the role to admit a request and never which role it is."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from pd.config import WorkerConfig
from pd.protocol import APIError, bad_request
from pd.worker.api import server
from pd.worker.api.server import make_app
from pd.worker.build import Worker
from pd.worker.engine import Delta, RequestHandle, Sequence
from pd.worker.metrics import WorkerMetrics
from pd.worker.text.detokenizer import IncrementalDetokenizer
from pd.worker.text.stop import StopChecker
from tests.router.test_client_input import raw_request

MAX_MODEL_LEN = 64


class Tok:
    vocab_size = 50
    max_token_bytes = 4
    eos_token_ids = frozenset({0})
    chat_template = None

    def encode(self, text: str) -> list[int]:
        return [1 + ord(c) % 49 for c in text]

    def apply_chat_template(self, messages, add_generation_prompt: bool, tools=None) -> str:
        return "|".join(m["content"] for m in messages)

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


class StandInEngine:
    """What the HTTP app uses of the engine: its context, start/stop, abort."""

    max_model_len = MAX_MODEL_LEN

    def __init__(self) -> None:
        self.aborted: list[RequestHandle] = []

    def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def abort(self, handle: RequestHandle, reason: str = "the client left") -> None:
        self.aborted.append(handle)

    def reset_prefix_cache(self) -> tuple[int, int]:
        return 0, 0


class StandInRole:
    """Admits with the handler's prompt ids and answers "hi" at once, or refuses."""

    name = "both"
    takes_params = False  # P's kv_transfer_params go unchecked (as on a prefill worker)

    def __init__(self, refuse: APIError | None = None) -> None:
        self.refuse = refuse
        self.prompts: list[list[int]] = []

    def body_limit(self, prompt_limit: int, max_model_len: int) -> int:
        return prompt_limit

    def routes(self) -> dict:
        return {}

    def unanswered(self, handle: RequestHandle, reason: str) -> None:
        pass

    async def body_for(self, path, headers, raw: bytes) -> bytes:
        return raw

    async def run(self) -> None:
        return None

    async def admit(self, req, prompt_ids, rules=None, choice_rules=None) -> RequestHandle:
        ids = await prompt_ids()  # the handler's PromptBuilder: its 400s come from here
        if self.refuse is not None:
            raise self.refuse
        self.prompts.append(ids)
        seq = Sequence(f"req-{len(self.prompts)}", ids, req.options, 4)
        handle = RequestHandle(seq, IncrementalDetokenizer(Tok()), StopChecker(()))
        handle.queue.put_nowait(Delta("hi", [7], [], "stop"))
        return handle


def worker(role: StandInRole, **config) -> Worker:
    engine = StandInEngine()
    return Worker(
        WorkerConfig(served_model_name="stub", **config), Tok(), engine, WorkerMetrics(), "stub",
        role=role, accepted_names=frozenset({"stub"}),
    )  # fmt: skip


async def post(client, body: bytes, headers: dict[str, str] | None = None):
    headers = {"Content-Type": "application/json", **(headers or {})}
    resp = await client.post("/v1/completions", data=body, headers=headers)
    return resp, orjson.loads(await resp.read())


def assert_error(resp, body, status: int, code: str) -> None:
    assert resp.status == status, body
    assert set(body) == {"error"} and body["error"]["code"] == code, body
    assert isinstance(body["error"]["message"], str) and body["error"]["type"]


QUEUE_FULL = APIError(503, "full", "server_busy", "queue_full", headers={"Retry-After": "1"})
KV_REFUSED = bad_request("no kv_transfer_params here", param="kv_transfer_params")


@pytest.mark.parametrize(
    "config, raw, status, code",
    [
        ({"api_key": "k"}, b'{"prompt": "hi"}', 401, "invalid_api_key"),
        ({"max_body_bytes": 1024}, b'{"prompt": "%s"}' % (b"x" * 2000), 413,
         "request_too_large"),
        ({}, b'{"prompt": ', 400, "invalid_json"),
        ({}, b'{"prompt": "hi", "model": "gpt-17"}', 404, "model_not_found"),
        ({}, b'{"prompt": "hi", "tempreture": 0}', 400, "unknown_parameter"),
        # the prompt builder's checks, through the role's `prompt_ids`: bytes, then ids
        ({}, b'{"prompt": "%s"}' % (b"y" * 5 * MAX_MODEL_LEN), 400, "context_length_exceeded"),
        ({}, orjson.dumps({"prompt": [1] * MAX_MODEL_LEN}), 400, "context_length_exceeded"),
        ({}, orjson.dumps({"prompt": [1, 99]}), 400, "invalid_value"),
    ],
)  # fmt: skip
async def test_the_handler_refuses_bad_requests_before_the_role_queues_them(
    aiohttp_client, config, raw, status, code
):
    role = StandInRole()
    w = worker(role, **config)
    client = await aiohttp_client(make_app(w))
    resp, body = await post(client, raw)
    assert_error(resp, body, status, code)
    assert not role.prompts and not w.engine.aborted


async def test_a_non_utf8_api_key_is_a_401_and_a_deep_body_a_400(aiohttp_client):
    """Headers are compared as bytes; JSON nested past 64 levels is refused (a 500 before)."""
    role = StandInRole()
    client = await aiohttp_client(make_app(worker(role, api_key="k")))
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    status, answer = await raw_request(
        client.server.port, head + b"Authorization: Bearer \xff\xfe\r\n", b'{"prompt": "hi"}'
    )
    assert status == 401 and orjson.loads(answer)["error"]["code"] == "invalid_api_key"
    deep = b'{"prompt": "hi", "metadata": %s}' % (b"[" * 300 + b"]" * 300)
    resp, body = await post(client, deep, headers={"Authorization": "Bearer k"})
    assert_error(resp, body, 400, "invalid_json")
    assert not role.prompts


@pytest.mark.parametrize("error, code", [(KV_REFUSED, "invalid_value"), (QUEUE_FULL, "queue_full")])
async def test_a_role_refusal_is_answered_as_it_is_and_queues_nothing(aiohttp_client, error, code):
    w = worker(StandInRole(refuse=error))
    client = await aiohttp_client(make_app(w))
    resp, body = await post(client, b'{"prompt": "hi"}')
    assert_error(resp, body, error.status, code)
    assert resp.headers.get("Retry-After") == error.headers.get("Retry-After")
    assert not w.engine.aborted


async def test_draining_is_a_503_with_retry_after(aiohttp_client):
    role = StandInRole()
    w = worker(role)
    w.draining = True
    client = await aiohttp_client(make_app(w))
    resp, body = await post(client, b'{"prompt": "hi"}')
    assert_error(resp, body, 503, "draining")
    assert resp.headers["Retry-After"] == "1" and not role.prompts


@pytest.mark.parametrize("stream", [False, True])
async def test_a_served_request_is_answered_and_aborted_once_in_finally(aiohttp_client, stream):
    role = StandInRole()
    w = worker(role, api_key="k")
    client = await aiohttp_client(make_app(w))
    raw = orjson.dumps({"prompt": "hi", "stream": stream})
    resp = await client.post(
        "/v1/completions",
        data=raw,
        headers={"Authorization": "Bearer k", "Content-Type": "application/json"},
    )
    text = await resp.text()
    assert resp.status == 200 and "hi" in text, text
    assert role.prompts == [Tok().encode("hi")]
    assert [h.seq.request_id for h in w.engine.aborted] == ["req-1"]


async def test_a_post_body_must_be_json_and_reset_prefix_cache_needs_none(aiohttp_client):
    role = StandInRole()
    client = await aiohttp_client(make_app(worker(role, api_key="k")))
    auth = {"Authorization": "Bearer k"}
    resp = await client.post(
        "/v1/completions", data=b'{"prompt": "hi"}', headers={**auth, "Content-Type": "text/plain"}
    )
    body = orjson.loads(await resp.read())
    assert_error(resp, body, 415, "unsupported_media_type")
    assert not role.prompts
    assert (await client.post("/reset_prefix_cache")).status == 401  # the key, where one is set
    assert (await client.post("/reset_prefix_cache", headers=auth)).status == 200


class SlowRole(StandInRole):
    """Answers "hi" after `delay` seconds: a request that waits for the batch or for pages."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    async def admit(self, req, prompt_ids, rules=None, choice_rules=None) -> RequestHandle:
        handle = await super().admit(req, prompt_ids, rules, choice_rules)
        delta = handle.queue.get_nowait()
        asyncio.get_running_loop().call_later(self.delay, handle.queue.put_nowait, delta)
        return handle


async def test_a_waiting_stream_carries_keep_alive_comments(aiohttp_client, monkeypatch):
    """At least one every KEEPALIVE_S while nothing else is sent (10 s at most: the router's
    idle watch and proxies see the stream alive); none once events flow."""
    monkeypatch.setattr(server, "KEEPALIVE_S", 0.1)
    client = await aiohttp_client(make_app(worker(SlowRole(0.55))))
    resp = await client.post(
        "/v1/completions",
        data=orjson.dumps({"prompt": "hi", "stream": True}),
        headers={"Content-Type": "application/json"},
    )
    text = (await resp.read()).decode()
    before, after = text.split("data: ", 1)
    assert 3 <= before.count(": keep-alive\n\n") <= 6, text
    assert ": keep-alive" not in after and text.endswith("data: [DONE]\n\n")
