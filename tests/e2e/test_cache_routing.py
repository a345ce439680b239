"""Routing that uses the caches, for real: router + P + D processes on the default model (fp32).

- A multi-turn conversation whose later turns add little goes decode-local (P never sees them)
  and gives the same greedy text as the same turns through P with the threshold at 0.
- A room whose decode worker is killed continues on the other one, and stays there.
After each scenario every live worker holds no page and its accounting is intact.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from pd.router import RouterConfig
from pd.router import make_app as make_router
from pd.router.keys import METRICS, REGISTRY
from pd.transfer import nixl_available
from tests.e2e.conftest import PAIR_FLAGS
from tests.e2e.processes import start_workers, stop, wait_pages_free

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not nixl_available(), reason="the KV pull needs a NIXL package"),
]

FLAGS = PAIR_FLAGS  # fp32, 256 pages, 2048 context, one thread each
SYSTEM = (
    "You are a careful assistant for a travel agency. Answer in one short sentence. "
    "The agency sells trips to Paris, Rome, Lisbon, Vienna and Prague, by train or by plane, "
    "with hotels of three or four stars, guided tours of museums and old towns, and dinners in "
    "local restaurants. Prices depend on the season, the length of the stay and the hotel. "
) * 3  # about 330 tokens: the first turn goes through P under a 256-token threshold
QUESTIONS = ["Which cities can I visit?", "Which one is cheapest?", "How do I get there?"]


@pytest.fixture(scope="module")
def cluster():
    started = start_workers(*(("--role", role, *FLAGS) for role in ("prefill", "decode", "decode")))
    procs = [proc for proc, _ in started]
    try:
        yield dict(zip(("p", "d1", "d2"), (url for _, url in started))), procs
    finally:
        for proc in procs:
            stop(proc)


async def start_router(aiohttp_server, p: str, decode: list[str], **kw):
    """An in-process router (its app, to read its metrics and registry) once it sees them all."""
    cfg = RouterConfig(
        port=0, prefill=(p,), decode=tuple(decode), health_interval=0.2, health_failures=1, **kw
    )
    app = make_router(cfg)
    server = await aiohttp_server(app)
    url = str(server.make_url("")).rstrip("/")
    async with aiohttp.ClientSession() as http:
        deadline = time.monotonic() + 10
        while True:
            health = await (await http.get(f"{url}/health")).json()
            if health["pools"]["decode"]["healthy"] == len(decode) and health["status"] == "ok":
                break
            assert time.monotonic() < deadline, f"the router never saw its workers: {health}"
            await asyncio.sleep(0.05)
    return url, app


def routed(app, route: str) -> int:
    return sum(n for (status, r), n in app[METRICS].requests.items() if r == route)


async def p_requests(http, p_url: str) -> float:
    text = await (await http.get(f"{p_url}/metrics")).text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("pd_requests_total{")
    )


async def converse(http, url: str, room: str | None = None) -> list[str]:
    """The conversation's turns, greedy, each carrying the answers so far."""
    messages = [{"role": "system", "content": SYSTEM}]
    answers = []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        body = {"messages": messages, "max_tokens": 24, "temperature": 0}
        if room:
            body["user"] = room
        resp = await http.post(f"{url}/v1/chat/completions", json=body)
        answer = await resp.json()
        assert resp.status == 200, answer
        text = answer["choices"][0]["message"]["content"]
        answers.append(text)
        messages.append({"role": "assistant", "content": text})
    return answers


async def test_later_turns_go_decode_local_with_the_same_greedy_text(cluster, aiohttp_server):
    urls, _ = cluster
    local_url, local = await start_router(
        aiohttp_server, urls["p"], [urls["d1"]], local_prefill_max_tokens=256
    )
    off_url, off = await start_router(
        aiohttp_server, urls["p"], [urls["d1"]], local_prefill_max_tokens=0
    )
    async with aiohttp.ClientSession() as http:
        before = await p_requests(http, urls["p"])
        with_local = await converse(http, local_url)
        assert routed(local, "pd") == 1 and routed(local, "local") == len(QUESTIONS) - 1
        assert await p_requests(http, urls["p"]) == before + 1, "turns 2+ never reached P"
        through_p = await converse(http, off_url)
        assert routed(off, "pd") == len(QUESTIONS) and routed(off, "local") == 0
        assert with_local == through_p
        assert all(with_local), with_local
        # What the router expected D to hold, against what D reported (both in tokens).
        m = local[METRICS]
        assert m.cached_actual["decode"] > 0 and m.cached_expected["decode"] > 0
        for worker_url in (urls["p"], urls["d1"]):
            await wait_pages_free(http, worker_url)


async def test_a_room_whose_decode_worker_dies_continues_on_the_other(cluster, aiohttp_server):
    urls, procs = cluster
    url, app = await start_router(
        aiohttp_server,
        urls["p"],
        [urls["d1"], urls["d2"]],
        decode_policy="sticky-to-room",
        local_prefill_max_tokens=256,
    )
    pool = app[REGISTRY].decode
    # A room whose home is d2 (the worker this test may kill; d1 serves the module's other test).
    room = next(
        f"room-{i}"
        for i in range(100)
        if pool.policy.choose(pool.healthy, f"room-{i}").url == urls["d2"]
    )
    async with aiohttp.ClientSession() as http:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi!"}]
        body = {"messages": messages, "max_tokens": 8, "temperature": 0, "user": room}
        assert (await http.post(f"{url}/v1/chat/completions", json=body)).status == 200
        stop(procs[2])  # SIGKILL d2, the room's home
        answers = await converse(http, url, room)
        assert all(answers)
        assert pool.policy.home_of(room).url == urls["d1"]  # moved once, and stays
        assert not pool.workers[urls["d2"]].healthy
        assert pool.index.blocks(urls["d2"]) == 0  # forgotten with its ejection
        for worker_url in (urls["p"], urls["d1"]):
            await wait_pages_free(http, worker_url)
