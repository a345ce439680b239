"""Stub workers and an in-process router for the router's tests."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from pd.router import RouterConfig, make_app
from pd.router.keys import REGISTRY
from pd.router.registry import Registry
from pd.bench.stub_worker import StubWorker

# Decode-local prefill is off unless a test turns it on: the flow tests exercise P then D.
FAST = dict(
    health_interval=0.05, health_timeout=2.0, connect_timeout=2.0, local_prefill_max_tokens=0
)


@pytest.fixture
def stub(aiohttp_server) -> Callable[..., Awaitable[StubWorker]]:
    """`await stub(role, **attrs)`: a running stub worker; its base URL is `.url`."""

    async def start(role: str = "both", **attrs) -> StubWorker:
        s = StubWorker(role)
        for k, v in attrs.items():
            assert hasattr(s, k), k
            setattr(s, k, v)
        server = await aiohttp_server(s.app())
        s.url = str(server.make_url("")).rstrip("/")
        s.server = server
        return s

    return start


@pytest.fixture
def router(aiohttp_client):
    """`await router(prefill=[...], decode=[...], **cfg)`: a test client of a running router."""

    async def start(**kw):
        for name in ("prefill", "decode", "worker"):
            kw[name] = tuple(s if isinstance(s, str) else s.url for s in kw.get(name, ()))
        cfg = RouterConfig(**{**FAST, **kw})
        return await aiohttp_client(make_app(cfg))

    return start


def registry_of(client) -> Registry:
    return client.server.app[REGISTRY]


async def wait_for(cond: Callable[[], bool], timeout: float = 2.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


def sse_events(raw: bytes) -> list[bytes]:
    return [e[6:] for e in raw.split(b"\n\n") if e.startswith(b"data: ")]


COMPLETION = {"model": "stub-model", "prompt": "hello", "max_tokens": 8}
CHAT = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
