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
CONTINUATION = "pd_continuation"
TOKEN_IDS = "X-PD-Token-Ids"


class StubWorker:
    def __init__(
        self, role: str = "both", model: str = "stub-model", chunks: int = 4, record: bool = True
    ) -> None:
        self.role = role
        self.model = model
        self.chunks = chunks  # completion tokens a stream carries
        self.record = record
        self.health_status = 200  # anything else: 503 {"status": "unavailable"}
        self.ready = True  # what /health says of readiness (False: no new requests)
        # reported in /health when set (the router pairs P and D on equal ones: pairing.py)
        self.runtime_format: dict[str, str] | None = None
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
        # Drop the connection of each OpenAI request, before any byte of an answer, as a worker
        # the request crashes does; with `dies` the first such drop kills the stub: from then
        # on every connection (/health's too) is dropped unanswered, as a dead worker's.
        self.disconnect = False
        self.dies = False
        self.dead = False
        self.disconnects = 0  # connections dropped that way
        # After this many chunks an error event ends the stream (no [DONE]), as a worker's
        # engine failure does; `send_done=False` ends a stream cleanly without [DONE].
        self.error_after: int | None = None
        self.send_done = True
        # Migration (docs/migration.md): with `X-PD-Token-Ids: 1` every token event carries a
        # `: pd-ids` line (token id 100 + position); `pd_continuation` goes on from its ids'
        # count. `positional`: token `pos`'s text is f"t{pos} " (f"s{seed}t{pos} " seeded),
        # so a continuation's text is checkable; `seed_lengths`: seed -> tokens of a choice
        # sampled with it (others have `chunks`). Knobs, counted in events (token events come
        # first, one per choice and position), for `break_times` streams (None: all):
        self.positional = False
        self.seed_lengths: dict[int, int] = {}
        self.break_at: int | None = None  # drop the connection before event `break_at`
        self.break_mid = False  # ... after writing half of it
        self.break_before_done = False  # drop it after the last token event (no usage, [DONE])
        self.migrate_at: int | None = None  # `: pd-migrate` before this event, then the end
        self.silent_at: int | None = None  # go silent before this event
        self.break_times: int | None = None
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
        self._chunk_cache: dict[tuple, tuple[list[bytes], int]] = {}

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
        if self.dead:
            return self._drop(request)
        if self.health_status != 200:
            return web.json_response({"status": "unavailable", "role": self.role}, status=503)
        body = {
            "status": "ok",
            "ready": self.ready,
            "not_ready_reason": None if self.ready else "the KV pool is full",
            "role": self.role,
            "model": self.model,
            "instance": self.instance,
            "load": self.load,
        }
        if self.runtime_format is not None:
            body["runtime_format"] = self.runtime_format
        return web.json_response(body)

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
            if self.disconnect or self.dead:
                self.disconnects += 1
                self.dead = self.dead or self.dies
                return self._drop(request)
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
            return web.json_response(self._plain_answer(body, chat))
        except (asyncio.CancelledError, ConnectionResetError):
            self.cancelled += 1
            raise
        finally:
            self.active -= 1

    def _drop(self, request: web.Request) -> web.Response:
        """Close the connection without an answer (the response returned is never sent)."""
        assert request.transport is not None
        request.transport.close()
        return web.Response()

    def _usage(self, body: dict, chat: bool, n: int) -> dict[str, Any]:
        """Usage with 4 prompt bytes to a token (as the router's initial estimate)."""
        try:
            path = "/v1/chat/completions" if chat else "/v1/completions"
            plain = {k: v for k, v in body.items() if k != CONTINUATION}
            prompt = max(1, len(prompt_bytes(parse_request(path, plain))) // 4)
        except APIError:
            prompt = 5
        return {
            "prompt_tokens": prompt,
            "completion_tokens": n,
            "total_tokens": prompt + n,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    # ------------------------------------------------------------------ tokens and choices

    def _start(self, body: dict) -> int:
        """Where a continuation (docs/migration.md §3) goes on from: its given ids' count."""
        cont = body.get(CONTINUATION)
        return len(cont.get("output_token_ids") or ()) if isinstance(cont, dict) else 0

    def _seed(self, body: dict, choice: int) -> int | None:
        seed = body.get("seed")
        return seed + choice if type(seed) is int else None

    def _length(self, body: dict, choice: int) -> int:
        """Tokens the uninterrupted choice has: `chunks`, or `seed_lengths[seed + choice]`."""
        seed = self._seed(body, choice)
        return self.seed_lengths.get(seed, self.chunks) if seed is not None else self.chunks

    def _text(self, body: dict, choice: int, pos: int) -> str:
        """Token `pos`'s text: "x", or with `positional` f"t{pos} " (f"s{seed}t{pos} " seeded)."""
        if not self.positional:
            return "x"
        seed = self._seed(body, choice)
        return f"t{pos} " if seed is None else f"s{seed}t{pos} "

    def _answer(
        self, chat: bool, text: str, finish: str, body: dict, tokens: int | None = None
    ) -> dict[str, Any]:
        n = len(text) if tokens is None else tokens
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

    def _plain_answer(self, body: dict, chat: bool) -> dict[str, Any]:
        """A non-streamed answer (a continuation's too: from its start, within max_tokens)."""
        start, length = self._start(body), self._length(body, 0)
        end = min(length, body.get("max_tokens") or length)
        if not self.positional and not start:
            return self._answer(chat, "x" * end, "length", body)
        text = "".join(self._text(body, 0, pos) for pos in range(start, end))
        finish = "stop" if end == length < self.chunks else "length"
        return self._answer(chat, text, finish, body, max(0, end - start))

    def _prefill_answer(self, body: dict, chat: bool) -> web.Response:
        self.completed += 1
        start = self._start(body)
        if start >= self._length(body, 0):  # a continuation with nothing left: it ends at once
            return web.json_response(self._answer(chat, "", "length", body, 0))
        text = self._text(body, 0, start)
        if self.final:
            return web.json_response(self._answer(chat, text, "stop", body, 1))
        answer = self._answer(chat, text, "length", body, 1)
        answer[KV] = {
            "do_remote_prefill": True,
            "transfer_id": answer["id"],
            "first_token_id": 100 + start if self.positional else 7,
            "pd_version": 1,
        }
        return web.json_response(answer)

    def _events(self, chat: bool, body: dict, usage: bool, ids: bool) -> tuple[list[bytes], int]:
        """A stream's events, and how many of them carry tokens (they come first)."""
        n = body.get("n") or 1
        start = self._start(body)
        prompt = body.get("messages") if chat else body.get("prompt")
        key = (chat, self.chunks, n, start, usage, ids, body.get("seed"), orjson.dumps(prompt))
        cached = self._chunk_cache.get(key)
        extra = self.extra_chunk_fields
        if cached is not None and not extra and not self.seed_lengths:
            return cached
        if len(self._chunk_cache) > 64:
            self._chunk_cache.clear()
        head = {
            "id": "cmpl-stub",
            "created": 0,
            "model": self.model,
            "object": "chat.completion.chunk" if chat else "text_completion",
        }
        lengths = [self._length(body, c) for c in range(n)]
        events: list[bytes] = []
        generated = 0
        for pos in range(start, max(lengths + [start + 1])):
            for c in range(n):
                if pos >= max(lengths[c], start + 1):
                    continue
                empty = pos >= lengths[c]  # a continuation with nothing left: no token
                last = pos >= lengths[c] - 1
                finish = None if not last else ("stop" if lengths[c] < self.chunks else "length")
                choice: dict[str, Any] = {"index": c, "logprobs": None, "finish_reason": finish}
                text = "" if empty else self._text(body, c, pos)
                if chat:
                    choice["delta"] = (
                        {"role": "assistant", "content": text}
                        if pos == start
                        else {"content": text}
                    )
                else:
                    choice["text"] = text
                chunk = {**head, "choices": [choice]}
                if len(events) < len(extra):
                    chunk = merged(chunk, extra[len(events)])
                line = f": pd-ids {c} {100 + pos}\n".encode() if ids and not empty else b""
                events.append(line + b"data: " + orjson.dumps(chunk) + b"\n\n")
                generated += 0 if empty else 1
        tokens = len(events)
        if usage:
            u = self._usage(body, chat, generated)
            events.append(b"data: " + orjson.dumps({**head, "choices": [], "usage": u}) + b"\n\n")
        events.append(b"data: [DONE]\n\n")
        if not extra:
            self._chunk_cache[key] = (events, tokens)
        return events, tokens

    def sse(self, chat: bool, body: dict | None = None, usage: bool = False) -> bytes:
        """The stream it writes for `body` (default: a plain one), as a client gets it."""
        return b"".join(self._events(chat, body or {}, usage, False)[0])

    async def _stream(self, request: web.Request, body: dict, chat: bool) -> web.StreamResponse:
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        ids = request.headers.get(TOKEN_IDS) == "1"
        events, tokens = self._events(chat, body, usage, ids)
        knobs = self.break_times is None or self.break_times > 0
        if knobs and self.break_times is not None and self._breaks_here(tokens, ids):
            self.break_times -= 1
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, event in enumerate(events):
            if knobs and ids and i == self.migrate_at:
                await resp.write(b": pd-migrate draining\n\n")
                await resp.write_eof()
                return resp
            if knobs and (i == self.break_at or (self.break_before_done and i == tokens)):
                if self.break_mid:
                    await resp.write(event[: len(event) // 2])
                    await asyncio.sleep(0.01)
                assert request.transport is not None  # prepared above
                request.transport.close()  # a crash mid-stream
                return resp
            if knobs and i == self.silent_at:
                await asyncio.sleep(3600)
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

    def _breaks_here(self, tokens: int, ids: bool) -> bool:
        """Whether one of the break knobs applies to a stream of `tokens` token events."""
        points = [self.break_at, self.silent_at, self.migrate_at if ids else None]
        return any(p is not None and p <= tokens for p in points) or self.break_before_done


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
