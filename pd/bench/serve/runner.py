"""Runs one phase: one workload against one target at one rate (open loop), with N clients
(closed loop), or at a trace's timestamps.

Open loop: each job starts at its time whether or not earlier ones are done (no cap on client
connections); the lag between planned and actual send time is recorded. A conversation's turns
wait for each other: turn k+1 is sent when turn k is answered and carries its answer. A
conversation whose turn fails stops there; its unsent turns count as errors (`conversation_cut`).
`max_duration_s` stops starting jobs after that long; started ones finish (or time out).

`time_scale` K > 1 measures a target that runs K times slower than the time it models
(simulated workers with `--time-scale K`): every time of the phase (arrivals, durations, the
timeout) is modeled time, waited K times longer, and every time recorded is real time over K.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from pd.bench.serve.arrivals import arrival_times
from pd.bench.serve.client import RequestRecord, stream_request
from pd.bench.serve.priority import CLASS_HEADER
from pd.bench.serve.workloads import Job


@dataclass(frozen=True)
class Target:
    name: str
    url: str
    model: str | None = None  # None: the body carries no model (the server's default)
    api_key: str | None = None  # sent as 'Authorization: Bearer KEY'

    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True)
class Phase:
    rate: float | None = None  # open loop: jobs per second
    arrival: str = "poisson"
    concurrency: int | None = None  # closed loop: clients
    max_duration_s: float | None = None
    request_timeout_s: float | None = None
    temperature: float = 0.0
    seed: int = 0
    time_scale: float = 1.0  # real seconds per modeled second


async def run_phase(
    target: Target,
    jobs: list[Job],
    phase: Phase,
    on_record: Callable[[RequestRecord], None] | None = None,
) -> list[RequestRecord]:
    records: list[RequestRecord] = []
    connector = aiohttp.TCPConnector(limit=0)  # open loop: no cap on connections
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        t0 = time.perf_counter()
        clock = _Clock(t0, phase.time_scale)

        async def run_job(job: Job, planned: float) -> None:
            await _run_job(http, target, job, phase, clock, planned, records, on_record)

        if phase.concurrency is not None:
            await _closed_loop(jobs, phase, clock, run_job)
        else:
            await _open_loop(jobs, phase, clock, run_job)
    return records


@dataclass(frozen=True)
class _Clock:
    """The phase's modeled time: real seconds since `t0` over `scale`."""

    t0: float
    scale: float

    def now(self) -> float:
        return (time.perf_counter() - self.t0) / self.scale

    async def sleep_until(self, at: float) -> None:
        delay = (at - self.now()) * self.scale
        if delay > 0:
            await asyncio.sleep(delay)


def _scaled(record: RequestRecord, scale: float) -> None:
    """A record's latencies, measured in real time, in modeled time."""
    if scale == 1.0:
        return
    if record.ttft_s is not None:
        record.ttft_s /= scale
    if record.e2e_s is not None:
        record.e2e_s /= scale
    record.itl_s = [g / scale for g in record.itl_s]


async def _open_loop(
    jobs: list[Job], phase: Phase, clock: _Clock, run_job: Callable[[Job, float], Any]
) -> None:
    if all(j.at_s is not None for j in jobs):  # a trace: its own timestamps
        times = [j.at_s or 0.0 for j in jobs]
    else:
        assert phase.rate is not None
        times = arrival_times(len(jobs), phase.rate, phase.arrival, random.Random(phase.seed))
    tasks = []
    for job, at in sorted(zip(jobs, times), key=lambda x: x[1]):
        if phase.max_duration_s is not None and at > phase.max_duration_s:
            break
        await clock.sleep_until(at)
        tasks.append(asyncio.create_task(run_job(job, at)))
    await asyncio.gather(*tasks)


async def _closed_loop(
    jobs: list[Job], phase: Phase, clock: _Clock, run_job: Callable[[Job, float], Any]
) -> None:
    queue = list(reversed(jobs))
    assert phase.concurrency is not None

    async def client() -> None:
        while queue:
            now = clock.now()
            if phase.max_duration_s is not None and now > phase.max_duration_s:
                return
            await run_job(queue.pop(), now)

    await asyncio.gather(*(client() for _ in range(phase.concurrency)))


async def _run_job(
    http: aiohttp.ClientSession,
    target: Target,
    job: Job,
    phase: Phase,
    clock: _Clock,
    planned: float,
    records: list[RequestRecord],
    on_record: Callable[[RequestRecord], None] | None,
) -> None:
    history: list[dict[str, str]] = []
    for k, turn in enumerate(job.turns):
        record = RequestRecord(
            target.name, phase.rate, job.job_id, k, planned, priority_class=job.priority_class
        )
        body: dict[str, Any] = {"max_tokens": turn.max_tokens, "temperature": phase.temperature}
        if target.model is not None:
            body["model"] = target.model
        if job.ignore_eos:
            body["ignore_eos"] = True
        headers = target.auth_headers()
        if job.room is not None:
            body["user"] = job.room
            headers["X-Room-Id"] = job.room
        if job.priority_class is not None:
            headers[CLASS_HEADER] = job.priority_class
        if job.chat:
            assert turn.user is not None
            messages = [{"role": "system", "content": turn.system or ""}]
            messages += history + [{"role": "user", "content": turn.user}]
            body["messages"] = messages
        else:
            body["prompt"] = turn.prompt
        record.sent_s = clock.now()
        timeout = phase.request_timeout_s
        await stream_request(
            http,
            target.url,
            body,
            record,
            chat=job.chat,
            headers=headers,
            timeout_s=None if timeout is None else timeout * phase.time_scale,
        )
        _scaled(record, phase.time_scale)
        records.append(record)
        if on_record is not None:
            on_record(record)
        if not record.ok:
            for j in range(k + 1, len(job.turns)):  # the conversation cannot go on
                cut = RequestRecord(
                    target.name, phase.rate, job.job_id, j, planned, record.sent_s,
                    priority_class=job.priority_class,
                )  # fmt: skip
                cut.error, cut.detail = "conversation_cut", f"turn {k} failed: {record.error}"
                records.append(cut)
                if on_record is not None:
                    on_record(cut)
            return
        history += [
            {"role": "user", "content": turn.user or ""},
            {"role": "assistant", "content": record.text},
        ]
        planned = clock.now()  # the next turn is due now
