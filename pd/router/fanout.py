"""A completions request with a list of prompts: one sub-exchange per prompt, each going the
normal way (P then D, P alone when its answer is final, decode-local, or a co-located worker),
routed by its own prompt; their answers merged into the client's.

Choice `c` of prompt `j` is the client's choice `j * n + c` (vLLM's order). Not streamed: the
answers' choices are concatenated with their new index and their usages summed. Streamed: each
sub-exchange's relay writes into a `_Sink` instead of the client; its events go out as they come,
their choices re-indexed, under one id; usage chunks are summed into one, sent at the end when
asked, then one `[DONE]`. A sub-exchange that fails cancels the others (a cancelled exchange
releases what it pinned on P, as when a client leaves) and ends the answer: with its error when
nothing was sent yet, else with an error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any

import orjson
from aiohttp import web

from pd.protocol import error_body
from pd.router.exchange import Exchange
from pd.router.failure import json_response
from pd.router.proxy import SSE_HEADERS, Proxy, _SSEResponse

_USAGE_FIELDS = ("prompt_tokens", "completion_tokens", "total_tokens")


def merge_answers(answers: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """The sub-exchanges' JSON answers (in prompt order) as one."""
    merged = {k: v for k, v in answers[0].items() if k not in ("choices", "usage")}
    choices = []
    for j, answer in enumerate(answers):
        for c in answer.get("choices") or ():
            choices.append({**c, "index": j * n + _index(c)})
    merged["choices"] = sorted(choices, key=_index)
    merged["usage"] = sum_usage([a.get("usage") for a in answers])
    return merged


def sum_usage(usages: list[Any]) -> dict[str, Any]:
    total: dict[str, Any] = {k: 0 for k in _USAGE_FIELDS}
    cached = 0
    for u in usages:
        if not isinstance(u, dict):
            continue
        for k in _USAGE_FIELDS:
            if isinstance(u.get(k), int):
                total[k] += u[k]
        details = u.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            cached += details["cached_tokens"]
    total["prompt_tokens_details"] = {"cached_tokens": cached}
    return total


def _index(c: Any) -> int:
    i = c.get("index", 0) if isinstance(c, dict) else 0
    return i if type(i) is int else 0


class _Sink:
    """Stands in for the client's response in one sub-exchange's relay: splits the SSE bytes
    into events and hands each (but `[DONE]`) to the fan-out."""

    def __init__(self, fan: _StreamFan, j: int) -> None:
        self.fan, self.j = fan, j
        self._buf = b""
        self.done = False  # its [DONE] came
        self.status = 200

    async def prepare(self, request: web.Request) -> None:
        return None

    async def write(self, data: bytes) -> None:
        self._buf += data
        *events, self._buf = self._buf.split(b"\n\n")
        for event in events:
            payload = event.strip()
            if not payload.startswith(b"data:"):
                continue
            payload = payload[5:].strip()
            if payload == b"[DONE]":
                self.done = True
                continue
            obj = orjson.loads(payload)
            if isinstance(obj, dict):
                await self.fan.event(self.j, obj)

    async def write_eof(self, data: bytes = b"") -> None:
        await self.write(data + (b"\n\n" if data and not data.endswith(b"\n\n") else b""))


class SubStreamError(Exception):
    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(str(body))
        self.body = body


class _StreamFan:
    """The client's stream, fed by every sub-exchange's sink."""

    def __init__(self, request: web.Request, n: int, include_usage: bool) -> None:
        self.request = request
        self.n = n
        self.include_usage = include_usage
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.head: dict[str, Any] | None = None
        self.usages: list[Any] = []
        self.resp: web.StreamResponse | None = None
        self._lock = asyncio.Lock()

    async def event(self, j: int, obj: dict[str, Any]) -> None:
        if "error" in obj:
            raise SubStreamError(obj)
        choices = obj.get("choices")
        if not choices:
            if "usage" in obj:
                self.usages.append(obj["usage"])
            return
        if self.head is None:
            self.head = {k: v for k, v in obj.items() if k not in ("choices", "usage", "id")}
        obj = {**obj, "id": self.id}
        obj["choices"] = [
            {**c, "index": j * self.n + _index(c)} for c in choices if isinstance(c, dict)
        ]
        if "usage" in obj:  # (continuous usage is not served: never with choices)
            self.usages.append(obj.pop("usage"))
        await self.write(b"data: " + orjson.dumps(obj) + b"\n\n")

    async def write(self, data: bytes) -> None:
        async with self._lock:
            if self.resp is None:
                self.resp = _SSEResponse(headers=SSE_HEADERS)
                await self.resp.prepare(self.request)
            await self.resp.write(data)

    async def end(self) -> web.StreamResponse:
        if self.include_usage:
            head = self.head or {"object": "text_completion"}
            usage = {**head, "id": self.id, "choices": [], "usage": sum_usage(self.usages)}
            await self.write(b"data: " + orjson.dumps(usage) + b"\n\n")
        await self.write(b"data: [DONE]\n\n")
        assert self.resp is not None
        await self.resp.write_eof()
        return self.resp


async def serve(
    proxy: Proxy,
    request: web.Request,
    exchanges: list[Exchange],
    route: str,
    n: int,
    include_usage: bool,
    stream: bool,
) -> web.StreamResponse:
    """Answer the client from `exchanges` (one per prompt, in order; each with its own body)."""
    if not stream:
        return await _collected(proxy, exchanges, route, n)
    fan = _StreamFan(request, n, include_usage)
    for j, ex in enumerate(exchanges):
        ex.sink = _Sink(fan, j)

    async def one(ex: Exchange) -> None:
        sink: _Sink = ex.sink
        resp = await proxy.handle(ex, route)
        if resp is sink:
            if not sink.done and ex.status not in (None, "499"):
                raise SubStreamError(error_body("a sub-stream broke off", "upstream_error"))
            return
        assert isinstance(resp, web.Response)
        body = resp.body if isinstance(resp.body, bytes) else b""
        if resp.status != 200:
            raise _Failed(resp)
        await sink.write_eof(body)  # P's final answer, as SSE

    error = await _run_all([one(ex) for ex in exchanges])
    if error is None:
        return await fan.end()
    if isinstance(error, _Failed) and fan.resp is None:  # nothing sent yet: its answer as it is
        return error.resp
    body = (
        error.body
        if isinstance(error, SubStreamError)
        else error_body(f"a prompt's answer failed: {error}", "upstream_error", "stream_broken")
    )
    with contextlib.suppress(ConnectionResetError):
        await fan.write(b"data: " + orjson.dumps(body) + b"\n\n")
        assert fan.resp is not None
        await fan.resp.write_eof()
    assert fan.resp is not None
    return fan.resp


class _Failed(Exception):
    """A sub-exchange answered an error (its response, not sent yet)."""

    def __init__(self, resp: web.Response) -> None:
        super().__init__(f"status {resp.status}")
        self.resp = resp


async def _collected(
    proxy: Proxy, exchanges: list[Exchange], route: str, n: int
) -> web.StreamResponse:
    answers: list[dict[str, Any]] = [{} for _ in exchanges]

    async def one(j: int, ex: Exchange) -> None:
        resp = await proxy.handle(ex, route)
        assert isinstance(resp, web.Response)
        if resp.status != 200:
            raise _Failed(resp)
        assert isinstance(resp.body, bytes)
        answers[j] = orjson.loads(resp.body)

    error = await _run_all([one(j, ex) for j, ex in enumerate(exchanges)])
    if isinstance(error, _Failed):
        return error.resp
    if error is not None:
        raise error
    return json_response(merge_answers(answers, n))


async def _run_all(coros: list[Any]) -> BaseException | None:
    """Run every coroutine; at the first failure cancel the others (and wait for them).
    Returns that failure, or None."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        for fut in asyncio.as_completed(tasks):
            try:
                await fut
            except asyncio.CancelledError:
                raise
            except Exception as e:
                return e
        return None
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
