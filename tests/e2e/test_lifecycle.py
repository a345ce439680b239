"""Faults on real processes: a prefill or decode worker SIGKILLed while a pull waits for pages,
a decode worker that refuses P's params, a request no decode worker could take. Each side sees
the other's failure within seconds, never after the (here 60 s) lease, and every page comes
back: `/health` reports `integrity == "ok"`, no page pinned or reserved, every page free.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import pytest

from pd.transfer import nixl_available
from tests.e2e.processes import start_workers, stop, wait_pages_free
from tests.e2e.test_pd import start_router

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not nixl_available(), reason="the KV pull needs a NIXL package"),
]

# A long lease: every release below must come from a heartbeat, an abort or the router.
COMMON = (
    "--dtype",
    "float32",
    "--quantization",
    "none",
    "--max-model-len",
    "2048",
    "--lease-ttl-s",
    "60",
    "--threads",
    "1",
)
# D's 48 pages of 16 tokens: a ~320-token request decoding 300 tokens holds 20 to 39 of them, so
# a ~640-token prompt (40 pages) waits in D's prealloc queue until the first request ends.
D_PAGES = ("--kv-pages", "48")
SENTENCE = "The quick brown fox jumps over the lazy dog. "
HALF, LONG = SENTENCE * 32, SENTENCE * 64  # ~320 and ~640 tokens


@pytest.fixture
def procs():
    """`procs(args, ...)`: a worker per argument list, started at once; [(process, url)]."""
    started: list = []

    def start(*arg_lists: tuple[str, ...]):
        pairs = start_workers(*arg_lists)
        started.extend(proc for proc, _ in pairs)
        return pairs

    yield start
    for proc in started:
        stop(proc)


async def health(http: aiohttp.ClientSession, url: str) -> dict:
    async with http.get(f"{url}/health") as resp:
        return await resp.json()


async def until(pred, timeout_s: float, what: str) -> float:
    t0 = time.monotonic()
    while not await pred():
        assert time.monotonic() - t0 < timeout_s, f"{what}: not within {timeout_s}s"
        await asyncio.sleep(0.05)
    return time.monotonic() - t0


async def prefill(http: aiohttp.ClientSession, p_url: str, prompt: str, max_tokens: int) -> dict:
    body = {
        "prompt": prompt, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True, "max_tokens": max_tokens},
    }  # fmt: skip
    async with http.post(f"{p_url}/v1/completions", json=body) as resp:
        answer = await resp.json()
        assert resp.status == 200, answer
        return answer["kv_transfer_params"]


async def decode(http: aiohttp.ClientSession, d_url: str, prompt: str, params: dict, n: int):
    """D's streamed answer, read to its end: the raw bytes."""
    body = {
        "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
        "stream": True, "kv_transfer_params": params,
    }  # fmt: skip
    async with http.post(f"{d_url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.read()


async def one_pull_waiting_for_pages(http, p_url: str, d_url: str):
    """A long decode holding D's pages, and a second request whose pull waits behind it."""
    first = asyncio.ensure_future(
        decode(http, d_url, HALF, await prefill(http, p_url, HALF, 300), 300)
    )
    await until(lambda: _running(http, d_url), 30, "the first request decoding on D")
    second = asyncio.ensure_future(
        decode(http, d_url, LONG, await prefill(http, p_url, LONG, 8), 8)
    )

    async def queued() -> bool:
        return (await health(http, d_url))["load"]["waiting_for_pages"] == 1

    await until(queued, 10, "the second pull queued for pages on D")
    assert (await health(http, p_url))["load"]["kv_pages_pinned"] >= 40
    return first, second


async def _running(http, d_url: str) -> bool:
    return (await health(http, d_url))["load"]["running"] == 1


async def test_p_sees_a_killed_decode_worker_by_its_heartbeats(procs):
    (_, p_url), (d, d_url) = procs(
        ("--role", "prefill", *COMMON), ("--role", "decode", *COMMON, *D_PAGES)
    )
    async with aiohttp.ClientSession() as http:
        first, second = await one_pull_waiting_for_pages(http, p_url, d_url)
        t0 = time.monotonic()
        os.kill(d.pid, signal.SIGKILL)

        async def released() -> bool:
            return (await health(http, p_url))["load"]["kv_pages_pinned"] == 0

        await until(released, 5.0, "P released the dead D's pins")  # not the 60 s lease
        print(f"P released a dead D's pins {time.monotonic() - t0:.2f}s after SIGKILL")
        for task in (first, second):
            with pytest.raises(aiohttp.ClientError):
                await task
        await wait_pages_free(http, p_url)


async def test_a_pull_waiting_for_pages_fails_within_seconds_when_p_is_killed(procs):
    (p, p_url), (_, d_url) = procs(
        ("--role", "prefill", *COMMON), ("--role", "decode", *COMMON, *D_PAGES)
    )
    async with aiohttp.ClientSession() as http:
        first, second = await one_pull_waiting_for_pages(http, p_url, d_url)
        t0 = time.monotonic()
        os.kill(p.pid, signal.SIGKILL)
        raw = await asyncio.wait_for(second, 10)
        took = time.monotonic() - t0
        assert b"kv_transfer_failed" in raw and b"PeerLost" in raw, raw[-300:]
        assert took < 6.0  # heartbeats (1 s x 3 misses), not the lease or the transfer timeout
        print(f"D failed the waiting pull {took:.2f}s after P's SIGKILL")
        first.cancel()  # the client of the long request leaves: D frees its pages too
        await asyncio.gather(first, return_exceptions=True)
        await wait_pages_free(http, d_url)


async def test_a_decode_refusal_releases_p_at_once_and_p_refuses_what_no_d_could_take(
    procs, aiohttp_server
):
    # D's context is shorter than P's: D refuses the ~640-token prompt with a 400.
    short = ("--dtype", "float32", "--quantization", "none", "--max-model-len", "256", "--lease-ttl-s", "60",
             "--threads", "1")  # fmt: skip
    (_, p_url), (_, d_url) = procs(("--role", "prefill", *COMMON), ("--role", "decode", *short))
    url = await start_router(aiohttp_server, p_url, d_url)
    async with aiohttp.ClientSession() as http:
        body = {"prompt": LONG, "max_tokens": 8, "temperature": 0}
        async with http.post(f"{url}/v1/completions", json=body) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["code"] == "context_length_exceeded"
        t = await until(
            lambda: _pins_gone(http, p_url), 2.0, "P released after D's refusal"
        )  # the router told P: not the 60 s lease
        print(f"P released {t:.2f}s after D refused")
        # prompt + max_tokens beyond P's context: refused by P before it prefills anything
        body = {"prompt": LONG, "max_tokens": 1900, "temperature": 0}
        async with http.post(f"{url}/v1/completions", json=body) as resp:
            error = (await resp.json())["error"]
            assert resp.status == 400 and error["code"] == "context_length_exceeded"
            assert "max_tokens" in error["message"]
        for worker_url in (p_url, d_url):
            await wait_pages_free(http, worker_url)


async def _pins_gone(http, p_url: str) -> bool:
    load = (await health(http, p_url))["load"]
    return load["kv_pages_pinned"] == 0 and load["inflight_transfers"] == 0


async def test_a_prefill_whose_client_left_releases_its_pins_at_once(procs):
    """The router (here: a client) leaves while P prefills: P's answer can reach no one, so
    nothing stays pinned for it once P is done (the lease would hold pins 60 s here): the
    handler's cancellation aborts the prefill, or releases pins taken meanwhile."""
    ((_, p_url),) = procs(("--role", "prefill", *COMMON))
    body = {
        "prompt": SENTENCE * 150, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True, "max_tokens": 8},
    }  # fmt: skip
    async with aiohttp.ClientSession() as http:
        with pytest.raises(TimeoutError):
            timeout = aiohttp.ClientTimeout(total=0.3)
            async with http.post(f"{p_url}/v1/completions", json=body, timeout=timeout) as r:
                await r.read()

        async def done() -> bool:  # the prefill ran to its end (its answer had no one to go to)
            load = (await health(http, p_url))["load"]
            return load["running"] == load["waiting"] == 0

        await until(done, 30.0, "P finished the prefill")
        load = (await health(http, p_url))["load"]
        assert load["kv_pages_pinned"] == 0 and load["inflight_transfers"] == 0, load
        await wait_pages_free(http, p_url)
