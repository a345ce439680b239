"""A tiny OpenAI-compatible streaming server for the serve benchmark's tests.

Each answer has `max_tokens` text chunks, `chunk_delay` apart, then a usage chunk (with
`prompt_tokens_details.cached_tokens`) and `[DONE]`. A chat answer names how many messages it
was sent and echoes the last user message's first word, so a test can follow a conversation.
`mode` makes it fail: "http_400", "http_503", "plain" (JSON, not SSE), "cut" (no [DONE]),
"error_event".
"""

from __future__ import annotations

import asyncio
import time

import orjson
from aiohttp import web


class OpenAIStub:
    def __init__(self, chunk_delay: float = 0.002, mode: str = "ok") -> None:
        self.chunk_delay = chunk_delay
        self.mode = mode
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self.arrivals: list[float] = []  # time.monotonic() of each request

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        return app

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "stub-model"}]})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        self.arrivals.append(time.monotonic())
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        if self.mode.startswith("http_"):
            status = int(self.mode[5:])
            return web.json_response({"error": {"message": "stub says no"}}, status=status)
        n = body.get("max_tokens", 4)
        chat = "messages" in body
        if self.mode == "plain":
            return web.json_response({"choices": [{"text": "x" * n}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if self.mode == "error_event":
            await resp.write(b'data: {"error": {"message": "boom"}}\n\n')
            return resp
        if chat:
            last = body["messages"][-1]["content"].split()[0]
            words = [f"[{len(body['messages'])} msgs, re {last}]"] + ["w"] * (n - 1)
        else:
            words = [f"t{i} " for i in range(n)]
        for i, w in enumerate(words):
            if i:
                await asyncio.sleep(self.chunk_delay)
            choice = {"delta": {"content": w}} if chat else {"text": w}
            await resp.write(
                b"data: " + orjson.dumps({"choices": [{"index": 0, **choice}]}) + b"\n\n"
            )
        if self.mode == "cut":
            return resp
        usage = {"prompt_tokens": 10, "completion_tokens": n, "total_tokens": 10 + n,
                 "prompt_tokens_details": {"cached_tokens": 3}}  # fmt: skip
        await resp.write(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp
