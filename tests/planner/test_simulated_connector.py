"""The planner's `simulated` connector (pd/planner/processes.py) against a router and a simulated
P and D in this process: told to have two decode workers, it starts a `--simulate` worker
process (or, with spares, activates a parked one), which registers with the router and answers
`starting` for its modeled start-up, then takes requests; told to have one again, it has the
router forget the worker and drains it: the process exits on its own, or, a spare, parks again
(`POST /park`: no process starts while the load runs) and serves again when activated. A spare
started again in the place of one that exited runs at the lowest CPU priority until its
activation. It never stops a worker it did not start, and starts none while one is on
its way."""

from __future__ import annotations

import asyncio
import os
import time

import aiohttp
import pytest

from pd.planner import Decision, Observation
from pd.planner.observe import ClusterReader
from pd.planner.processes import SPARE_NICE, SimulatedConnector, _can_renice, _serving
from tests.planner.test_observe import PROFILE, TOKEN, completion, router_of, serve

ADMIN = "sim-connector-admin"


@pytest.mark.parametrize("spares", [0, 1])
async def test_it_starts_a_worker_that_takes_load_once_ready_and_drains_it(
    aiohttp_server, tmp_path, monkeypatch, spares
):
    monkeypatch.setenv("PD_CLUSTER_TOKEN", TOKEN)  # the in-process workers' and router's
    p, d = await serve(aiohttp_server, "prefill"), await serve(aiohttp_server, "decode")
    router = await router_of(aiohttp_server, prefill=(p,), decode=(d,), admin_token=ADMIN)
    reader = ClusterReader(router, admin_token=ADMIN)
    connector = SimulatedConnector(
        router, PROFILE, startup_s=1.0, admin_token=ADMIN, cluster_token=TOKEN,
        worker_args=["--kv-pages", "512"], log_dir=str(tmp_path), spares=spares,
    )  # fmt: skip
    await connector.start()
    parked = [m for ms in connector.parked.values() for m in ms]
    assert len(parked) == 2 * spares
    async with aiohttp.ClientSession() as http:

        async def observe() -> Observation:
            return await reader.observe(http)

        try:
            obs = await observe()
            assert await connector.apply(Decision(0, 1, 1, ()), obs) == []
            assert {w.url for w in obs.workers} == {p, d}  # a parked spare is not registered
            (started,) = await connector.apply(Decision(0, 1, 2, ()), obs)
            (m,) = connector.workers.values()
            if spares:
                assert started == f"activating spare decode worker {m.url}"
                assert m in parked and not connector.parked["decode"]
            else:
                assert started == f"starting decode worker {m.url}"
            # On its way: the same decision starts no other, and nothing is drained.
            assert await connector.apply(Decision(0, 1, 2, ()), await observe()) == []
            assert connector.pending()["decode"] == {"starting": 1, "leaving": 0}
            deadline = time.monotonic() + 90
            assert await _until_ready(connector, reader, http, m, deadline, tmp_path)
            await _until_served(http, router, m)
            # Down to one: ours goes (the router forgets it first), the one we did not start stays.
            (draining,) = await connector.apply(Decision(0, 1, 1, ()), await observe())
            assert draining == f"draining decode worker {m.url}"
            if not spares:
                code = await asyncio.wait_for(asyncio.to_thread(m.proc.wait), 60)
                assert code == 0
            else:  # back in the pool: the same process, parked, its pages all free
                while connector.parked["decode"] != [m]:
                    assert time.monotonic() < deadline, "the drained spare never parked again"
                    await asyncio.sleep(0.05)
                assert m.proc.poll() is None
                health = await (await http.get(f"{m.url}/health")).json()
                assert health["not_ready_reason"] == "parked"
                walk = await (await http.get(f"{m.url}/integrity")).json()
                assert walk == {"integrity": "ok"}
            listed = await reader.observe(http)
            assert {w.url for w in listed.workers} == {p, d}
            assert await connector.apply(Decision(0, 1, 1, ()), listed) == []
            if spares:
                # Wanted again: activated, it starts again, joins the router and serves
                (started,) = await connector.apply(Decision(0, 1, 2, ()), listed)
                assert started == f"activating spare decode worker {m.url}"
                assert await _until_ready(connector, reader, http, m, deadline + 60, tmp_path)
                await _until_served(http, router, m)
            if spares and _can_renice():
                # A worker that exits (not parked again) is replaced by a spare started while
                # the load runs: the lowest CPU priority until it is activated
                connector.stopped("decode")
                (again,) = connector.parked["decode"]
                await _serving(http, again)
                assert _nices(again.proc.pid) == {SPARE_NICE}
                await connector.apply(Decision(0, 1, 3, ()), await reader.observe(http))
                assert again.state == "starting" and _nices(again.proc.pid) == {0}
        finally:
            await connector.close()
    assert not connector.workers


async def _until_ready(connector, reader, http, m, deadline, logs) -> bool:
    """Decisions of one P and two D until `m` is ready; whether the router listed it not ready
    (starting) on the way."""
    seen_starting = False
    while True:
        assert m.proc.poll() is None, (logs / f"decode-{m.url.rsplit(':', 1)[1]}.log").read_text()
        assert time.monotonic() < deadline, "the new worker never became ready"
        obs = await reader.observe(http)
        mine = [w for w in obs.workers if w.url == m.url]
        if mine and not mine[0].ready:
            seen_starting = True
        done = await connector.apply(Decision(0, 1, 2, ()), obs)
        if m.state == "ready":
            assert done == [f"decode worker {m.url} is ready"]
            return seen_starting
        await asyncio.sleep(0.2)


async def _until_served(http, router, m) -> None:
    """Load-aware picks the cheaper of two at random, and ties (both idle) go either way: rounds
    of six until `m` has sampled more tokens, at most five (1 in 2^30 by chance)."""
    before = (await (await http.get(f"{m.url}/steps")).json())["sampled_tokens"]
    for rnd in range(5):
        await asyncio.gather(*(completion(http, router, 6 * rnd + i, 8) for i in range(6)))
        record = await (await http.get(f"{m.url}/steps")).json()
        if record["sampled_tokens"] > before:
            return
    raise AssertionError("the new worker took none of the requests")


def _nices(pid: int) -> set[int]:
    """The nice values of `pid`'s threads."""
    return {os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}
