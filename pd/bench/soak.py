"""`pd-bench soak`: a fault soak of router + prefill + decode on the real default model.

It starts a prefill worker (P), `--decode-workers` decode workers (D; named `decode`, `decode2`,
...) and a pd-router in front of them (decode-local prefill off: every request goes through P,
then a D), each worker with `--threads` cores (by default the machine's cores split among the
workers, at least 1 each: with 3 workers on 2 cores each gets 1 and they share; the report's
`config.cores` says how many there were), and keeps `--clients` streaming chat completions in
flight in a closed loop (prompts of about `--prompt-tokens` tokens, answers of `--max-tokens`
with `ignore_eos`, the usage asked). A share `--disconnect-frac` of the requests (drawn per
request from `--seed`) closes its connection after reading a few SSE chunks, as a client that
goes away would. Over `--duration` seconds:

1. warm-up: load only, until a fifth of the duration has passed and a request has succeeded;
2. the first D (`decode`) is SIGKILLed while streams are running on it (its own `/health` shows
   running requests: its share of the clients if that comes within 5 s, else at least one), and
   restarted on the same port (the router's configured URL stays valid) once the router has
   ejected it; the soak waits for the router to re-admit it and for a request started after the
   restart to succeed. With one D the kill cuts its streams; with two or more the router
   migrates them to another D (docs/migration.md), and the restart also waits (at most the
   deadline) until every stream in flight at the kill has read a chunk since or ended: where
   the workers share cores, a D's start-up (long, on a busy machine) would
   otherwise compete with the continuations' prefills on P, and the wait measured would be the
   restart's (docs/EXPERIMENTS.md section 6);
3. the same for P, from 55% of the duration on (and not before D has recovered);
4. the load goes on to the end of the duration (at least a few seconds after P recovered), stops,
   and the requests still in flight are given the deadline to end;
5. settling: within one lease (`--lease-ttl-s` plus a few seconds) every worker's `/health` must
   report no request, no transfer, and every KV page free (none referenced, held, pinned or
   reserved), with their page accounting's `integrity` "ok" (`/integrity`: every page walked).

Every request ends with one outcome: `ok` (`[DONE]`, no error event, and the usage says all
`--max-tokens` tokens with finish reason `length`), `migrated` (the same, but the router migrated
its stream at least once: not counted in `ok`), `client_disconnect` (intended), `error_4xx`,
`error_5xx`, `stream_error` (an error event inside the stream, a stream cut before `[DONE]`, a
`[DONE]` short of its tokens, or a connection that broke) or `hung`: alive past its deadline,
the router's `--prefill-timeout` plus `--read-timeout` (the client's own timeout is three
deadlines, so a hang is seen, not masked). Errors while a worker is down are expected; hangs and
leaked pages are not. For each kill it reports the time from the kill to the router ejecting the
worker (polled on `GET /workers`), from the restart to the first successful (`ok` or
`migrated`) request started after it and to the first request the restarted worker itself
finished (its `/metrics`: with two D's the first success may be the other one's), and the
outcomes of the requests that ended in its window
(from the kill to the next kill or the end; the first window also holds the warm-up).

Migrations are known per request: each request sends its own `X-Request-Id`, which the router's
log lines of a migration name, with the wait from the break to the continuation's first byte
(pd/bench/soak_migrations.py). The report's `migration` has the count of `migrated`, the
migrations per reason from the router's `/metrics`, the p50/p99/max of that wait from the log
lines (exact; nearest rank, so with fewer than 100 migrations p99 is the max) with the
histogram's count and bucket bounds beside them, and the longest silence each migrated stream
had at its client (the wait as the client saw it, from its last token before the break).

It exits 0 only when no request hung, no page leaked, every worker's integrity is ok, every
killed worker recovered and no process exited on its own; with two or more decode workers also
only when no request ended with `stream_error` in the D kill's window. It stops every process
it started (they also die with it, through PR_SET_PDEATHSIG on Linux). Logs of the processes go
to `--log-dir` (default: a temporary directory, removed when the soak passes).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import secrets
import shutil
import signal
import sys
import tempfile
import time
from bisect import bisect_right
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

import aiohttp
import orjson

from pd._compat import asyncio_timeout
from pd.bench.soak_cluster import Cluster, poll, router_says_healthy, wait_ready
from pd.bench.soak_migrations import (
    Migration,
    RouterMigrations,
    by_request,
    read_log,
    read_metrics,
    spread,
)

OUTCOMES = (
    "ok", "migrated", "client_disconnect", "error_4xx", "error_5xx", "stream_error", "hung",
)  # fmt: skip
SUCCESS = ("ok", "migrated")
# Pages a worker holds beyond its referenced ones (`kv_pages_total - kv_pages_free`); the newer
# ones are read with a default so the soak also runs against workers that do not report them.
HELD_FIELDS = ("kv_pages_held", "kv_pages_pinned", "kv_pages_reserved")
BUSY_FIELDS = ("running", "waiting", "inflight_transfers", "waiting_for_pages")
SETTLE_SLACK_S = 5.0  # beyond one lease, for the settling check
TAIL_S = 3.0  # load kept on after the last recovery
ERROR_BACKOFF_S = 0.25  # a client's pause after a failed request (no busy loop on an outage)

# Common English words, one token each with their leading space in a byte-level BPE.
WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force"
).split()


# ------------------------------------------------------------------------------ requests


@dataclass
class RequestRecord:
    """One client request and how it went (times are `time.monotonic()`)."""

    client: int
    start: float
    disconnect_after: int | None = None  # chunks read before closing on purpose; None: to the end
    end: float | None = None  # None while alive, and for a request abandoned at the end
    status: int | None = None  # the HTTP status; None when no answer came
    chunks: int = 0  # data events read (not counting [DONE] or an error event)
    first_chunk: float | None = None
    last_chunk: float | None = None
    done: bool = False  # the stream ended with [DONE]
    disconnected: bool = False  # the client closed the connection as planned
    error: str | None = None  # an error event, an error answer, or the exception
    request_id: str = ""  # its X-Request-Id, which the router's migration log lines name
    want_tokens: int | None = None  # the answer's length (ignore_eos); None: not checked
    completion_tokens: int | None = None  # the usage chunk's
    finish_reason: str | None = None
    max_gap_s: float = 0.0  # the longest silence between two data events
    migrations: int = 0  # how often the router migrated its stream (its log, read at the end)


def classify(rec: RequestRecord, deadline_s: float) -> str:
    """The outcome of a finished (or abandoned) request; see the module's docstring."""
    if rec.end is None or rec.end - rec.start > deadline_s:
        return "hung"
    if rec.disconnected:
        return "client_disconnect"
    if rec.status is not None and rec.status >= 500:
        return "error_5xx"
    if rec.status is not None and rec.status >= 400:
        return "error_4xx"
    if rec.status == 200 and rec.done and rec.error is None:
        return "migrated" if rec.migrations else "ok"
    return "stream_error"


def count_outcomes(records: Iterable[RequestRecord], deadline_s: float) -> dict[str, int]:
    counts = dict.fromkeys(OUTCOMES, 0)
    for rec in records:
        counts[classify(rec, deadline_s)] += 1
    return counts


def error_samples(
    records: Iterable[RequestRecord], deadline_s: float, per_outcome: int = 3
) -> dict[str, list[str]]:
    """A few distinct error messages of each failed outcome (evidence for the report)."""
    samples: dict[str, list[str]] = {}
    for rec in records:
        outcome = classify(rec, deadline_s)
        if outcome in (*SUCCESS, "client_disconnect"):
            continue
        if outcome == "hung":
            age = "abandoned" if rec.end is None else f"ended after {rec.end - rec.start:.1f} s"
            message = f"{age}, status {rec.status}, {rec.chunks} chunks, {rec.error or ''}"
        else:
            message = f"status {rec.status}: {rec.error or 'no [DONE]'}"
        mine = samples.setdefault(outcome, [])
        if message not in mine and len(mine) < per_outcome:
            mine.append(message)
    return samples


def make_prompt(rng: random.Random, tokens: int) -> str:
    """About `tokens` tokens of random common words (no two prompts share a prefix page)."""
    return "Repeat these words: " + " ".join(rng.choices(WORDS, k=max(1, tokens - 8)))


# -------------------------------------------------------------------------- worker pages


def load_of(health: Mapping[str, Any]) -> Mapping[str, Any]:
    """A worker's `/health` load (under `load`, or the body itself)."""
    load = health.get("load")
    return load if isinstance(load, Mapping) else health


def pages_leaked(health: Mapping[str, Any]) -> int:
    """Pages not free (referenced) plus pages held, pinned or reserved, from a `/health` body."""
    load = load_of(health)
    not_free = int(load["kv_pages_total"]) - int(load["kv_pages_free"])
    return not_free + sum(int(load.get(name, 0)) for name in HELD_FIELDS)


def settled(health: Mapping[str, Any]) -> bool:
    """No request or transfer left, every page free, the page accounting intact."""
    load = load_of(health)
    return (
        health.get("integrity") == "ok"
        and pages_leaked(health) == 0
        and all(int(load.get(name, 0)) == 0 for name in BUSY_FIELDS)
    )


def worker_end_state(url: str, health: Mapping[str, Any] | None, error: str = "") -> dict:
    """What the report says of one worker once settled (or not): URL, integrity, pages, load."""
    if health is None:
        return {
            "url": url,
            "integrity": f"unreachable: {error}",
            "pages_leaked": None,
            "load": None,
        }
    load = load_of(health)
    return {
        "url": url,
        "integrity": str(health.get("integrity", "missing")),
        "pages_leaked": pages_leaked(health),
        "settled": settled(health),
        "load": {k: load[k] for k in (*BUSY_FIELDS, "kv_pages_total", "kv_pages_free",
                                      *HELD_FIELDS) if k in load},
    }  # fmt: skip


# ------------------------------------------------------------------------------- report


@dataclass
class Kill:
    """One SIGKILL of a worker and its recovery (seconds; None: did not happen in time)."""

    role: str
    worker: str  # its URL
    at_s: float  # from the start of the load
    streams_active: int  # requests reading a stream when it was killed
    in_flight: int  # requests in flight when it was killed
    kill_to_eject_s: float | None = None
    restart_to_ready_s: float | None = None  # the worker's own /health answers 200
    restart_to_healthy_s: float | None = None  # the router re-admitted it
    restart_to_first_success_s: float | None = None  # a request started after the restart: ok
    # ... and one finished by the restarted worker itself (its /metrics): with two decode
    # workers the first success after the restart may be the other one's.
    restart_to_served_s: float | None = None
    running_on_worker: int | None = None  # its own /health's running requests, at the kill
    kill_to_restart_s: float | None = None  # (with 2+ D: once the killed D's streams moved on)
    # Outcomes of the requests that ended in its window (`attribute_windows`).
    outcomes: dict[str, int] = field(default_factory=dict)


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def attribute_windows(
    records: Iterable[RequestRecord], kills: list[Kill], t0: float, deadline_s: float
) -> None:
    """Set each kill's `outcomes`: those of the requests that ended from its kill to the next
    kill (the first kill's window starts with the load, so it holds the warm-up; the last one's
    runs to the end, and holds the requests abandoned at the end)."""
    starts = [t0 + k.at_s for k in kills]
    for k in kills:
        k.outcomes = dict.fromkeys(OUTCOMES, 0)
    if not kills:
        return
    for rec in records:
        end = rec.end if rec.end is not None else float("inf")
        i = max(0, bisect_right(starts, end) - 1)
        kills[i].outcomes[classify(rec, deadline_s)] += 1


def apply_migrations(records: Iterable[RequestRecord], migrations: Iterable[Migration]) -> None:
    """Each record's `migrations`, from the router's log lines that name its request id."""
    mine = by_request(migrations)
    for rec in records:
        rec.migrations = len(mine.get(rec.request_id, ())) if rec.request_id else 0


def migration_report(
    records: list[RequestRecord],
    deadline_s: float,
    migrations: list[Migration],
    router: RouterMigrations | None,
) -> dict[str, Any]:
    """What the report says of migrations (see the module's doc)."""
    migrated = [r for r in records if classify(r, deadline_s) == "migrated"]
    touched = count_outcomes((r for r in records if r.migrations), deadline_s)
    reasons: dict[str, int] = {}
    for m in migrations:
        reasons[m.reason] = reasons.get(m.reason, 0) + 1
    return {
        "migrated": len(migrated),
        "migrations": len(migrations),  # the router's log lines, every request's
        "requests": sum(touched.values()),  # requests of this soak migrated at least once
        "outcomes": {k: v for k, v in touched.items() if v},  # of those requests
        "reasons": reasons,  # from the log
        "never_resumed": sum(1 for m in migrations if m.wait_s is None),
        "wait_s": spread([m.wait_s for m in migrations if m.wait_s is not None]),
        "client_gap_s": spread([r.max_gap_s for r in migrated]),
        "router": router.to_dict() if router is not None else None,
    }


def build_report(
    records: list[RequestRecord],
    deadline_s: float,
    kills: list[Kill],
    workers: dict[str, dict[str, Any]],
    duration_s: float,
    unexpected_exits: list[str],
    config: dict[str, Any] | None = None,
    settle_s: float | None = None,
    *,
    decode_workers: int = 1,
    migrations: list[Migration] | None = None,
    router_migrations: RouterMigrations | None = None,
) -> dict[str, Any]:
    """The soak's JSON report, its verdict (`passed`), the reasons it failed (`failures`) and
    what is worth a look without failing it (`warnings`). `records` have their `migrations`
    set (`apply_migrations`), `kills` their `outcomes` (`attribute_windows`)."""
    outcomes = count_outcomes(records, deadline_s)
    leaked = sum(w["pages_leaked"] or 0 for w in workers.values())
    integrity = {role: w["integrity"] for role, w in workers.items()}
    failures = []
    if outcomes["hung"]:
        failures.append(f"{outcomes['hung']} requests hung (alive past {deadline_s:g} s)")
    if leaked:
        failures.append(f"{leaked} pages leaked")
    failures += [f"{role} integrity: {i}" for role, i in integrity.items() if i != "ok"]
    for k in kills:
        if k.kill_to_eject_s is None:
            failures.append(f"the router never ejected the killed {k.role} worker")
        if k.restart_to_first_success_s is None:
            failures.append(f"no request succeeded after the {k.role} worker restarted")
    warnings = []
    for k in kills:
        if decode_workers < 2 or k.role != "decode":
            continue
        if k.outcomes.get("stream_error"):
            failures.append(
                f"{k.outcomes['stream_error']} streams cut in the decode kill's window "
                f"(with {decode_workers} decode workers they should have migrated)"
            )
        if not k.outcomes.get("migrated"):
            warnings.append("no stream was migrated in the decode kill's window")
    failures += unexpected_exits
    kill_dicts = [
        {k: (_round(v) if isinstance(v, float) else v) for k, v in asdict(kill).items()}
        for kill in kills
    ]
    return {
        "passed": not failures,
        "failures": failures,
        "warnings": warnings,
        "outcomes": outcomes,
        "migrated": outcomes["migrated"],
        "hung": outcomes["hung"],
        "requests": len(records),
        "deadline_s": deadline_s,
        "duration_s": round(duration_s, 3),
        "kills": kill_dicts,
        "pages_leaked": leaked,
        "integrity": integrity,
        "settle_s": _round(settle_s),  # from the load's end until every worker settled
        "workers": workers,
        "migration": migration_report(records, deadline_s, migrations or [], router_migrations),
        "errors": error_samples(records, deadline_s),
        "config": config or {},
    }


def format_summary(report: dict[str, Any]) -> str:
    """The report for a person."""

    def s(x: float | None) -> str:
        return "never" if x is None else f"{x:.2f} s"

    verdict = "PASS" if report["passed"] else "FAIL: " + "; ".join(report["failures"])
    lines = [
        f"pd-bench soak: {verdict}",
        f"  {report['requests']} requests in {report['duration_s']:.1f} s, "
        f"deadline {report['deadline_s']:g} s",
        "  outcomes: " + ", ".join(f"{k} {v}" for k, v in report["outcomes"].items()),
    ]
    for k in report["kills"]:
        on = k.get("running_on_worker")
        lines.append(
            f"  kill {k['role']} at {k['at_s']:.1f} s ({k['streams_active']} streaming, "
            f"{k['in_flight']} in flight{'' if on is None else f', {on} running on it'}): "
            f"ejected after {s(k['kill_to_eject_s'])}, restarted after "
            f"{s(k.get('kill_to_restart_s'))}; after the restart: ready "
            f"{s(k['restart_to_ready_s'])}, re-admitted {s(k['restart_to_healthy_s'])}, first "
            f"success {s(k['restart_to_first_success_s'])}, first served by it "
            f"{s(k.get('restart_to_served_s'))}"
        )
        if k.get("outcomes"):
            lines.append(
                "    its window: " + ", ".join(f"{o} {n}" for o, n in k["outcomes"].items() if n)
            )
    mig = report.get("migration")
    if mig and mig["migrations"]:
        wait, gap = mig["wait_s"], mig["client_gap_s"]
        lines.append(
            f"  migrations: {mig['migrations']} of {mig['requests']} requests, by reason "
            f"{mig['reasons']} (router: {(mig['router'] or {}).get('reasons')}); wait from the "
            f"break to the continuation's first byte p50 {s(wait['p50'])}, p99 {s(wait['p99'])}, "
            f"max {s(wait['max'])}; longest silence a migrated client saw p50 {s(gap['p50'])}, "
            f"p99 {s(gap['p99'])}, max {s(gap['max'])}"
        )
    lines.append(f"  workers settled after the load: {s(report.get('settle_s'))}")
    for role, w in report["workers"].items():
        lines.append(
            f"  {role} {w['url']}: integrity {w['integrity']}, pages leaked {w['pages_leaked']}, "
            f"load {w['load']}"
        )
    for outcome, messages in report["errors"].items():
        for m in messages:
            lines.append(f"  e.g. {outcome}: {m}")
    for w in report.get("warnings", ()):
        lines.append(f"  warning: {w}")
    if report["config"].get("log_dir"):
        lines.append(f"  logs: {report['config']['log_dir']}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------- load


@dataclass
class LoadSpec:
    url: str  # the router
    clients: int
    disconnect_frac: float
    prompt_tokens: int
    max_tokens: int
    seed: int
    client_timeout_s: float


class Load:
    """`clients` closed-loop streaming clients; every request they send is in `records`."""

    def __init__(self, spec: LoadSpec) -> None:
        self.spec = spec
        self.records: list[RequestRecord] = []
        self.run = secrets.token_hex(4)  # in every request id: a reused log dir cannot mix runs
        self._stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._http: aiohttp.ClientSession | None = None

    def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        self._http = aiohttp.ClientSession(connector=connector)
        self._tasks = [asyncio.create_task(self._client(i)) for i in range(self.spec.clients)]

    async def stop(self, grace_s: float) -> None:
        """No new requests; those in flight get `grace_s` to end, then are abandoned (hung)."""
        self._stopping.set()
        if self._tasks:
            _, pending = await asyncio.wait(self._tasks, timeout=grace_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._http is not None:
            await self._http.close()

    def in_flight(self) -> int:
        return sum(1 for r in self.records if r.end is None)

    def streaming(self) -> int:
        return sum(1 for r in self.records if r.end is None and r.chunks > 0)

    def first_ok_after(self, t: float, deadline_s: float) -> float | None:
        """When the first request started at or after `t` ended `ok` or `migrated` (None: none
        yet)."""
        ends = [
            r.end
            for r in self.records
            if r.start >= t and r.end is not None and classify(r, deadline_s) in SUCCESS
        ]
        return min(ends) if ends else None

    async def _client(self, i: int) -> None:
        rng = random.Random(f"{self.spec.seed}:{i}")
        n = 0
        while not self._stopping.is_set():
            disconnect = rng.random() < self.spec.disconnect_frac
            n += 1
            rec = RequestRecord(
                client=i,
                start=time.monotonic(),
                disconnect_after=rng.randint(1, 4) if disconnect else None,
                request_id=f"soak-{self.run}-{i}-{n}",
                want_tokens=self.spec.max_tokens,
            )
            self.records.append(rec)
            body = {
                "messages": [
                    {"role": "user", "content": make_prompt(rng, self.spec.prompt_tokens)}
                ],
                "max_tokens": self.spec.max_tokens,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            assert self._http is not None
            await stream_once(self._http, self.spec.url, body, rec, self.spec.client_timeout_s)
            if rec.error is not None and not rec.disconnected:
                await asyncio.sleep(ERROR_BACKOFF_S)


async def stream_once(
    http: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    rec: RequestRecord,
    timeout_s: float,
) -> None:
    """One streamed chat completion, filling `rec` in; it closes the connection after
    `rec.disconnect_after` chunks when that is set. A cancelled request keeps `end` None."""
    try:
        async with asyncio_timeout(timeout_s):
            await _exchange(http, url, body, rec)
    except TimeoutError:
        rec.error = f"client timeout after {timeout_s:g} s"
    except (aiohttp.ClientError, orjson.JSONDecodeError) as e:
        rec.error = f"{type(e).__name__}: {e}"[:300]
    rec.end = time.monotonic()


async def _exchange(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], rec: RequestRecord
) -> None:
    headers = {"Content-Type": "application/json"}
    if rec.request_id:
        headers["X-Request-Id"] = rec.request_id
    async with http.post(
        f"{url}/v1/chat/completions", data=orjson.dumps(body), headers=headers
    ) as resp:
        rec.status = resp.status
        if resp.status != 200:
            rec.error = (await resp.text())[:300]
            return
        async for line in resp.content:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                rec.done = True
                rec.error = _short_answer(rec)
                return
            event = orjson.loads(data)
            if not isinstance(event, dict):
                continue
            if "error" in event:
                rec.error = orjson.dumps(event["error"]).decode()[:300]
                return
            usage = event.get("usage")
            if isinstance(usage, dict):
                rec.completion_tokens = usage.get("completion_tokens")
            choices = event.get("choices") or []
            if not choices:  # the usage chunk
                continue
            for c in choices:
                if isinstance(c, dict) and c.get("finish_reason") is not None:
                    rec.finish_reason = str(c["finish_reason"])
            now = time.monotonic()
            if rec.last_chunk is not None:
                rec.max_gap_s = max(rec.max_gap_s, now - rec.last_chunk)
            rec.chunks += 1
            rec.first_chunk = rec.first_chunk or now
            rec.last_chunk = now
            if rec.disconnect_after is not None and rec.chunks >= rec.disconnect_after:
                rec.disconnected = True
                resp.close()  # the connection, not only the response: the router sees it go
                return


def _short_answer(rec: RequestRecord) -> str | None:
    """At [DONE]: what is wrong with the answer's length (None: nothing, or not checked)."""
    if rec.want_tokens is None:
        return None
    if rec.completion_tokens != rec.want_tokens or rec.finish_reason != "length":
        return (
            f"[DONE] after completion_tokens {rec.completion_tokens} of {rec.want_tokens}, "
            f"finish_reason {rec.finish_reason}"
        )
    return None


# --------------------------------------------------------------------------------- soak


async def _fault(
    http: aiohttp.ClientSession,
    cluster: Cluster,
    load: Load,
    role: str,
    t0: float,
    deadline_s: float,
    recovery_timeout_s: float,
    *,
    want_running: int = 1,
    restart_after_streams: bool = False,
) -> Kill:
    """SIGKILL `role` while streams run (for a D: on it, `want_running` of them if that comes
    soon), restart it once ejected (and with `restart_after_streams`, once every stream in
    flight at the kill has moved on: `_moved_on`), and time its recovery."""
    router = cluster.services["router"].url
    worker = cluster.services[role].url
    running: list[int | None] = [None]

    async def busy(least: int) -> bool:  # `least` streams on this D; for P a stream, and a
        # request not streaming yet (at P)
        if role == "prefill":
            return 0 < load.streaming() < load.in_flight()
        if load.streaming() == 0:
            return False
        running[0] = await _running(http, worker)
        return (running[0] or 0) >= least

    # A D: its share of the clients running on it if that comes within a few seconds (more
    # streams to migrate), else any stream on it.
    if role == "prefill" or not await poll(partial(busy, want_running), 5.0, 0.02):
        await poll(partial(busy, 1), timeout=10.0, interval=0.02)
    kill = Kill(role, worker, time.monotonic() - t0, load.streaming(), load.in_flight())
    kill.running_on_worker = running[0]
    streams = [(r, r.chunks) for r in load.records if r.end is None and r.chunks > 0]
    t_kill = time.monotonic()
    cluster.kill(role)
    ejected = await poll(
        lambda: _is_false(router_says_healthy(http, router, worker)), timeout=15.0, interval=0.02
    )
    if ejected:
        kill.kill_to_eject_s = time.monotonic() - t_kill
    if restart_after_streams:
        await poll(lambda: _moved_on(streams), timeout=deadline_s, interval=0.05)
    t_restart = time.monotonic()
    kill.kill_to_restart_s = t_restart - t_kill
    cluster.start(role)
    try:
        await wait_ready(http, cluster, role, timeout=recovery_timeout_s)
    except RuntimeError as e:  # reported through the missing recovery and cluster.exited()
        print(f"pd-bench soak: the restarted {role} worker: {e}", file=sys.stderr)
        return kill
    kill.restart_to_ready_s = time.monotonic() - t_restart
    remaining = recovery_timeout_s - (time.monotonic() - t_restart)
    if await poll(
        lambda: _is_true(router_says_healthy(http, router, worker)), timeout=max(1.0, remaining)
    ):
        kill.restart_to_healthy_s = time.monotonic() - t_restart
    remaining = recovery_timeout_s - (time.monotonic() - t_restart)
    if await poll(lambda: _served(http, worker), max(1.0, remaining), 0.1):
        kill.restart_to_served_s = time.monotonic() - t_restart
    remaining = recovery_timeout_s - (time.monotonic() - t_restart)
    if await poll(lambda: load.first_ok_after(t_restart, deadline_s), max(1.0, remaining), 0.1):
        first = load.first_ok_after(t_restart, deadline_s)
        assert first is not None
        kill.restart_to_first_success_s = first - t_restart
    return kill


def _moved_on(streams: list[tuple[RequestRecord, int]]) -> bool:
    """Every stream in flight at the kill (with its chunks then) read a chunk since, or ended:
    the killed D's streams were continued elsewhere (or given up)."""
    return all(r.end is not None or r.chunks > chunks for r, chunks in streams)


async def _running(http: aiohttp.ClientSession, url: str) -> int | None:
    """The running requests a worker's `/health` reports (None: no answer)."""
    try:
        async with http.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=1)) as r:
            return int(load_of(await r.json()).get("running", 0))
    except (aiohttp.ClientError, TimeoutError, ValueError, TypeError):
        return None


async def _served(http: aiohttp.ClientSession, url: str) -> int:
    """Requests a worker finished, not aborted (its `/metrics`: `pd_requests_total`; 0 when it
    cannot be read)."""
    try:
        async with http.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=2)) as r:
            text = await r.text()
    except (aiohttp.ClientError, TimeoutError):
        return 0
    return finished_requests(text)


def finished_requests(metrics_text: str) -> int:
    """`pd_requests_total` of a worker's Prometheus text, less its aborted ones."""
    total = 0
    for line in metrics_text.splitlines():
        if line.startswith("pd_requests_total{") and 'reason="abort"' not in line:
            total += int(float(line.rsplit(" ", 1)[1]))
    return total


async def _is_true(value: Any) -> bool:
    return (await value) is True


async def _is_false(value: Any) -> bool:
    return (await value) is False


async def _settle(
    http: aiohttp.ClientSession, cluster: Cluster, names: list[str], timeout: float
) -> tuple[dict[str, dict[str, Any]], float | None]:
    """Poll the workers' /health until every one settled or `timeout`: their end states, and
    how long settling took (None: not within `timeout`)."""
    last: dict[str, tuple[Mapping[str, Any] | None, str]] = {}

    async def read(role: str) -> bool:
        url = cluster.services[role].url
        try:
            async with http.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                health = await r.json()
            if settled(health):  # then the full walk over the pages (/health's is counters)
                async with http.get(
                    f"{url}/integrity", timeout=aiohttp.ClientTimeout(total=5)
                ) as r:
                    health = {**health, **await r.json()}
            last[role] = (health, "")
            return settled(health)
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            last[role] = (None, f"{type(e).__name__}: {e}")
            return False

    async def every() -> bool:
        results = [await read(name) for name in names]
        return all(results)

    t = time.monotonic()
    ok = await poll(every, timeout=timeout, interval=0.25)
    took = time.monotonic() - t if ok else None
    return {n: worker_end_state(cluster.services[n].url, *last[n]) for n in names}, took


async def _router_migrations(http: aiohttp.ClientSession, router: str) -> RouterMigrations | None:
    """The router's migration counts from its `/metrics` (None: unreadable)."""
    try:
        async with http.get(f"{router}/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r:
            return read_metrics(await r.text())
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        print(f"pd-bench soak: the router's /metrics: {type(e).__name__}: {e}", file=sys.stderr)
        return None


def decode_names(n: int) -> list[str]:
    """The decode workers' service names: `decode` (the one killed), `decode2`, ..."""
    return ["decode"] + [f"decode{i}" for i in range(2, n + 1)]


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads_per_worker(args: argparse.Namespace) -> int:
    """`--threads`, else the cores split among P and the decode workers (at least 1)."""
    if args.threads is not None:
        return int(args.threads)
    return max(1, cores() // (1 + args.decode_workers))


async def _sleep_until(t: float) -> None:
    await asyncio.sleep(max(0.0, t - time.monotonic()))


async def soak(args: argparse.Namespace, cluster: Cluster) -> dict[str, Any]:
    deadline_s = args.prefill_timeout + args.read_timeout
    threads = threads_per_worker(args)
    worker_flags = [
        "--device", "cpu", "--dtype", args.dtype, "--threads", str(threads),
        "--kv-pages", str(args.kv_pages), "--max-model-len", "2048",
        "--lease-ttl-s", str(args.lease_ttl_s), "--kv-transfer-timeout-s", str(args.lease_ttl_s),
    ]  # fmt: skip
    p = cluster.add("prefill", "pd.worker.main", "--role", "prefill", *worker_flags)
    names = ["prefill", *decode_names(args.decode_workers)]
    decodes = [
        cluster.add(n, "pd.worker.main", "--role", "decode", *worker_flags) for n in names[1:]
    ]
    router = cluster.add(
        "router", "pd.router.main", "--prefill", p.url,
        *(flag for d in decodes for flag in ("--decode", d.url)),
        "--local-prefill-max-tokens", "0", "--health-interval", "0.5",
        "--prefill-timeout", str(args.prefill_timeout), "--read-timeout", str(args.read_timeout),
    )  # fmt: skip
    async with aiohttp.ClientSession() as http:
        for name in names:
            cluster.start(name)
        for name in names:
            await wait_ready(http, cluster, name)
        cluster.start("router")
        await wait_ready(http, cluster, "router", timeout=60)

        load = Load(
            LoadSpec(
                url=router.url,
                clients=args.clients,
                disconnect_frac=args.disconnect_frac,
                prompt_tokens=args.prompt_tokens,
                max_tokens=args.max_tokens,
                seed=args.seed,
                client_timeout_s=3 * deadline_s,
            )
        )
        t0 = time.monotonic()
        load.start()
        kills: list[Kill] = []
        try:
            # 1. warm-up: a fifth of the duration, and one request served.
            await _sleep_until(t0 + 0.2 * args.duration)
            await poll(lambda: load.first_ok_after(t0, deadline_s), args.recovery_timeout, 0.1)
            # 2. D, then 3. P.
            share = max(1, args.clients // args.decode_workers)  # of the streams, on the D
            for role, at in (("decode", 0.2), ("prefill", 0.55)):
                await _sleep_until(t0 + at * args.duration)
                kills.append(
                    await _fault(
                        http, cluster, load, role, t0, deadline_s, args.recovery_timeout,
                        want_running=share,
                        restart_after_streams=role == "decode" and args.decode_workers > 1,
                    )
                )  # fmt: skip
                print(f"pd-bench soak: {kills[-1]}", file=sys.stderr)
                await asyncio.sleep(2.0)
            # 4. the rest of the duration.
            await _sleep_until(max(t0 + args.duration, time.monotonic() + TAIL_S))
        finally:
            duration_s = time.monotonic() - t0
            await load.stop(grace_s=deadline_s + 2.0)
        exits = cluster.exited()
        # 5. settling, within one lease.
        workers, settle_s = await _settle(http, cluster, names, args.lease_ttl_s + SETTLE_SLACK_S)
        router_counts = await _router_migrations(http, router.url)
    with open(router.log_path, encoding="utf-8", errors="replace") as f:
        migrations = read_log(f.read())
    apply_migrations(load.records, migrations)
    attribute_windows(load.records, kills, t0, deadline_s)
    config = {
        k: getattr(args, k)
        for k in ("duration", "clients", "disconnect_frac", "decode_workers", "prompt_tokens",
                  "max_tokens", "seed", "kv_pages", "lease_ttl_s", "prefill_timeout",
                  "read_timeout", "dtype")
    }  # fmt: skip
    config.update(threads=threads, cores=cores(), log_dir=cluster.log_dir)
    return build_report(
        load.records, deadline_s, kills, workers, duration_s, exits, config, settle_s,
        decode_workers=args.decode_workers, migrations=migrations, router_migrations=router_counts,
    )  # fmt: skip


# ---------------------------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load in all")
    p.add_argument("--clients", type=int, default=6, help="concurrent streaming clients")
    p.add_argument(
        "--disconnect-frac",
        type=float,
        default=0.2,
        help="share of requests whose client closes the connection after a few chunks",
    )
    p.add_argument(
        "--decode-workers",
        type=int,
        default=1,
        help="decode workers behind the router (the first is the one killed; with 2 or more "
        "its streams migrate to another, and none may end in a stream error)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="cores of each worker (default: the machine's cores split among the workers, at "
        "least 1 each, so with more workers than cores they share)",
    )
    p.add_argument("--prompt-tokens", type=int, default=300, help="prompt length (approximate)")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per answer (ignore_eos)")
    p.add_argument("--seed", type=int, default=0, help="seed of prompts and disconnects")
    p.add_argument("--kv-pages", type=int, default=256, help="KV pages of each worker")
    p.add_argument("--lease-ttl-s", type=float, default=10.0, help="P's lease on pinned pages")
    p.add_argument("--prefill-timeout", type=float, default=20.0, help="the router's flag")
    p.add_argument("--read-timeout", type=float, default=10.0, help="the router's flag")
    p.add_argument(
        "--recovery-timeout",
        type=float,
        default=120.0,
        help="longest wait for a restarted worker to serve a request",
    )
    p.add_argument("--dtype", default="auto", help="compute dtype of the workers")
    p.add_argument("--log-dir", help="where the processes' logs go (default: a temporary one)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _check(args: argparse.Namespace) -> str | None:
    if args.duration <= 0 or args.clients < 1 or (args.threads is not None and args.threads < 1):
        return "--duration must be > 0, --clients and --threads >= 1"
    if args.decode_workers < 1:
        return "--decode-workers must be >= 1"
    if not 0.0 <= args.disconnect_frac <= 1.0:
        return "--disconnect-frac must be in [0, 1]"
    if args.prompt_tokens < 1 or args.max_tokens < 2 or args.kv_pages < 1:
        return "--prompt-tokens and --kv-pages must be >= 1, --max-tokens >= 2"
    if min(args.lease_ttl_s, args.prefill_timeout, args.read_timeout) <= 0:
        return "--lease-ttl-s, --prefill-timeout and --read-timeout must be > 0"
    return None


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally that stops the processes


def run(args: argparse.Namespace) -> int:
    problem = _check(args)
    if problem:
        print(f"pd-bench soak: {problem}", file=sys.stderr)
        return 2
    own_log_dir = args.log_dir is None
    log_dir = tempfile.mkdtemp(prefix="pd-soak-") if own_log_dir else args.log_dir
    os.makedirs(log_dir, exist_ok=True)
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PD_CLUSTER_TOKEN": os.environ.get("PD_CLUSTER_TOKEN") or secrets.token_hex(16),
    }
    cluster = Cluster(env, log_dir)
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        report = asyncio.run(soak(args, cluster))
    except RuntimeError as e:  # the cluster did not start
        print(f"pd-bench soak: {e}\n(logs: {log_dir})", file=sys.stderr)
        return 1
    finally:
        cluster.stop()
        signal.signal(signal.SIGTERM, previous)
    if args.json:
        sys.stdout.write(orjson.dumps(report).decode() + "\n")
    else:
        print(format_summary(report))
    if report["passed"] and own_log_dir:
        shutil.rmtree(log_dir, ignore_errors=True)
    return 0 if report["passed"] else 1
