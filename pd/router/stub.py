"""A stub worker that speaks the worker contract without a model, for tests and `pd-bench router`.

It answers `/health` (role, model, load), `/v1/models`, and the two OpenAI endpoints. As prefill
(`kv_transfer_params.do_remote_decode`) it answers one token and params for D; as decode (params
present) or co-located it streams `chunks` SSE chunks. Attributes can be changed while it runs
to inject failures; it records what it received and how many requests were cut off.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import orjson
from aiohttp import web

from pd.protocol import APIError, error_body, parse_request
from pd.router.prefix_index import prompt_bytes

KV = "kv_transfer_params"


class StubWorker:
    def __init__(
        self, role: str = "both", model: str = "stub-model", chunks: int = 4, record: bool = True
    ) -> None:
        self.role = role
        self.model = model
        self.chunks = chunks  # completion tokens a stream carries
        self.record = record
        self.health_status = 200  # anything else: 503 {"status": "unavailable"}
        self.load: dict[str, Any] = {
            "role": role,
            "running": 0,
            "waiting": 0,
            "queued_prefill_tokens": 0,
            "kv_pages_total": 100,
            "kv_pages_free": 100,
        }
        self.fail_status: int | None = None  # answer the OpenAI endpoints with this status
        self.fail_times: int | None = None  # ... this many times (None: always)
        self.delay = 0.0  # seconds before the answer's headers
        self.chunk_delay = 0.0  # seconds between stream chunks
        self.eof_delay = 0.0  # seconds between a stream's [DONE] and the end of its body
        self.break_after: int | None = None  # drop the connection after this many chunks
        # After this many chunks an error event ends the stream (no [DONE]), as a worker's
        # engine failure does; `send_done=False` ends a stream cleanly without [DONE].
        self.error_after: int | None = None
        self.send_done = True
        self.release_status = 200  # what /kv/release answers
        self.final = False  # as prefill: the first token ends the request (no params)
        self.instance = "stub-1"  # change it to look restarted
        self.cached_tokens = 0  # reported in usage.prompt_tokens_details
        # Fields a newer worker might add, merged into what it sends (`merged`): the i-th dict
        # into the stream's i-th content chunk, and `extra_answer_fields` into a JSON answer
        # (P's included). E.g. {"system_fingerprint": "fp"} or {"choices": [{"delta": {...}}]}.
        self.extra_chunk_fields: list[dict[str, Any]] = []
        self.extra_answer_fields: dict[str, Any] = {}
        self.requests: list[dict[str, Any]] = []  # bodies received
        self.released: list[dict[str, Any]] = []  # bodies of /kv/release calls (as prefill)
        self.headers: list = []  # their headers (CIMultiDicts)
        self.active = 0  # requests being answered now
        self.cancelled = 0  # requests whose client (the router) went away
        self.completed = 0
        self._ids = itertools.count()
        self._chunk_cache: dict[tuple[bool, int, str], list[bytes]] = {}

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_post("/kv/release", self._release)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._tokenize)
        return app

    async def _tokenize(self, request: web.Request) -> web.Response:
        """/tokenize and /detokenize: the body back, with who answered and what it was sent."""
        body = orjson.loads(await request.read())
        self.requests.append(body)
        self.headers.append(request.headers.copy())
        return web.json_response({"path": request.path, "instance": self.instance, **body})

    async def _release(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        self.released.append(body)
        if self.release_status != 200:
            return web.json_response(
                error_body("stub release failure", "server_error"), status=self.release_status
            )
        return web.json_response({"transfer_id": body.get("transfer_id"), "released": True})

    async def _health(self, request: web.Request) -> web.Response:
        if self.health_status != 200:
            return web.json_response({"status": "unavailable", "role": self.role}, status=503)
        return web.json_response(
            {
                "status": "ok",
                "role": self.role,
                "model": self.model,
                "instance": self.instance,
                "load": self.load,
            }
        )

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": self.model, "object": "model"}]}
        )

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        if self.record:
            self.requests.append(body)
            self.headers.append(request.headers.copy())  # case-insensitive
        self.active += 1
        try:
            if self.delay:
                await asyncio.sleep(self.delay)
            if self.fail_status is not None and (self.fail_times is None or self.fail_times > 0):
                if self.fail_times is not None:
                    self.fail_times -= 1
                headers = {"Retry-After": "1"} if self.fail_status == 503 else None
                return web.json_response(
                    error_body("stub failure", "server_error"),
                    status=self.fail_status,
                    headers=headers,
                )
            chat = request.path.endswith("/chat/completions")
            kvp = body.get(KV) or {}
            if kvp.get("do_remote_decode"):
                return self._prefill_answer(body, chat)
            if body.get("stream"):
                return await self._stream(request, body, chat)
            n = min(self.chunks, body.get("max_tokens") or self.chunks)
            return web.json_response(self._answer(chat, "x" * n, "length", body))
        except (asyncio.CancelledError, ConnectionResetError):
            self.cancelled += 1
            raise
        finally:
            self.active -= 1

    def _usage(self, body: dict, chat: bool, n: int) -> dict[str, Any]:
        """Usage with 4 prompt bytes to a token (as the router's initial estimate)."""
        try:
            path = "/v1/chat/completions" if chat else "/v1/completions"
            prompt = max(1, len(prompt_bytes(parse_request(path, body))) // 4)
        except APIError:
            prompt = 5
        return {
            "prompt_tokens": prompt,
            "completion_tokens": n,
            "total_tokens": prompt + n,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def _answer(self, chat: bool, text: str, finish: str, body: dict) -> dict[str, Any]:
        n = len(text)
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        answer = {
            "id": f"cmpl-{next(self._ids)}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [choice],
            "usage": self._usage(body, chat, n),
        }
        return merged(answer, self.extra_answer_fields)

    def _prefill_answer(self, body: dict, chat: bool) -> web.Response:
        self.completed += 1
        if self.final:
            return web.json_response(self._answer(chat, "x", "stop", body))
        answer = self._answer(chat, "x", "length", body)
        answer[KV] = {
            "do_remote_prefill": True,
            "transfer_id": answer["id"],
            "first_token_id": 7,
            "pd_version": 1,
        }
        return web.json_response(answer)

    def _events(self, chat: bool, usage: dict | None) -> list[bytes]:
        # usage differs by prompt: a bounded cache, cleared when full
        key = (chat, self.chunks, str(usage))
        cached = self._chunk_cache.get(key)
        extra = self.extra_chunk_fields
        if cached is not None and not extra:
            return cached
        if len(self._chunk_cache) > 64:
            self._chunk_cache.clear()
        head = {
            "id": "cmpl-stub",
            "created": 0,
            "model": self.model,
            "object": "chat.completion.chunk" if chat else "text_completion",
        }
        events = []
        for i in range(self.chunks):
            last = i == self.chunks - 1
            choice: dict[str, Any] = {
                "index": 0,
                "logprobs": None,
                "finish_reason": "length" if last else None,
            }
            if chat:
                choice["delta"] = (
                    {"role": "assistant", "content": "x"} if i == 0 else {"content": "x"}
                )
            else:
                choice["text"] = "x"
            chunk = {**head, "choices": [choice]}
            if i < len(extra):
                chunk = merged(chunk, extra[i])
            events.append(b"data: " + orjson.dumps(chunk) + b"\n\n")
        if usage:
            events.append(
                b"data: " + orjson.dumps({**head, "choices": [], "usage": usage}) + b"\n\n"
            )
        events.append(b"data: [DONE]\n\n")
        if not extra:
            self._chunk_cache[key] = events
        return events

    async def _stream(self, request: web.Request, body: dict, chat: bool) -> web.StreamResponse:
        usage = None
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = self._usage(body, chat, self.chunks)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, event in enumerate(self._events(chat, usage)):
            if self.break_after is not None and i >= self.break_after:
                assert request.transport is not None  # prepared above
                request.transport.close()  # a crash mid-stream
                return resp
            if i == self.error_after:
                error = error_body("stub engine failure", "server_error", "engine_error")
                await resp.write(b"data: " + orjson.dumps(error) + b"\n\n")
                break
            if event.startswith(b"data: [DONE]") and not self.send_done:
                break
            if i and self.chunk_delay:
                await asyncio.sleep(self.chunk_delay)
            await resp.write(event)
        if self.eof_delay:
            await asyncio.sleep(self.eof_delay)
        await resp.write_eof()
        self.completed += 1
        return resp


def merged(base: Any, extra: Any) -> Any:
    """`base` with `extra` merged in: dicts key by key, lists item by item, else `extra`."""
    if isinstance(base, dict) and isinstance(extra, dict):
        out = dict(base)
        for k, v in extra.items():
            out[k] = merged(base[k], v) if k in base else v
        return out
    if isinstance(base, list) and isinstance(extra, list):
        return [merged(b, e) for b, e in zip(base, extra)] + base[len(extra) :] + extra[len(base) :]
    return extra
