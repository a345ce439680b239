"""A real `pd-worker` process: starts on a free port, serves, and drains on SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import aiohttp
import pytest

from pd.router import RouterConfig
from pd.router import make_app as make_router
from tests.e2e.processes import start_worker

pytestmark = pytest.mark.slow  # loads the real model


@pytest.fixture
def worker_process():
    procs = []

    def start(*args: str):
        proc, url = start_worker(*args)
        procs.append(proc)
        return proc, url

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


async def router_workers(http, router_url: str, until: list[str]) -> list[str]:
    """The router's worker URLs, polled for a few seconds until they equal `until`."""
    for _ in range(100):
        resp = await http.get(f"{router_url}/workers", headers={"Authorization": "Bearer adm"})
        urls = [w["url"] for w in (await resp.json())["workers"]]
        if urls == until:
            break
        await asyncio.sleep(0.05)
    return urls


async def test_sigterm_drains_running_requests_then_exits(worker_process, aiohttp_server):
    router = await aiohttp_server(make_router(RouterConfig(admin_token="adm", port=0)))
    router_url = str(router.make_url("")).rstrip("/")
    proc, url = worker_process(
        "--dtype",
        "float32",
        "--kv-pages",
        "64",
        "--max-model-len",
        "1024",
        "--register-with",
        router_url,
        "--admin-token",
        "adm",
    )
    async with aiohttp.ClientSession() as http:
        assert await router_workers(http, router_url, until=[url]) == [url]  # registered itself
        resp = await http.post(
            f"{url}/v1/completions",
            json={
                "prompt": "Write about the sea.",
                "max_tokens": 60,
                "ignore_eos": True,
                "stream": True,
            },
        )
        assert resp.status == 200
        first = await resp.content.readline()
        assert first.startswith(b"data: ")
        proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        refused = await http.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
        assert refused.status == 503
        assert (await refused.json())["error"]["code"] == "draining"
        body = await resp.content.read()  # the running request still completes
        assert body.rstrip().endswith(b"data: [DONE]")
        chunks = [ln for ln in (first + body).split(b"\n\n") if ln.startswith(b"data: {")]
        assert len(chunks) == 60
        assert proc.wait(timeout=30) == 0
        assert await router_workers(http, router_url, until=[]) == []  # and left it when draining


def test_every_flag_has_help():
    out = subprocess.run(
        [sys.executable, "-m", "pd.worker.main", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0
    for flag in (
        "--role",
        "--host",
        "--port",
        "--model",
        "--tp",
        "--dtype",
        "--page-size",
        "--max-model-len",
        "--kv-pages",
        "--chunk-size",
        "--max-running-requests",
        "--served-model-name",
        "--api-key",
    ):
        assert flag in out.stdout, flag
