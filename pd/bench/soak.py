"""`pd-bench soak`: a fault soak of router + prefill + decode on the real default model.

It starts a prefill worker (P), a decode worker (D) and a pd-router in front of them (decode-local
prefill off: every request goes through P, then D), each worker with `--threads` cores, and keeps
`--clients` streaming chat completions in flight in a closed loop (prompts of about
`--prompt-tokens` tokens, answers of `--max-tokens` with `ignore_eos`). A share
`--disconnect-frac` of the requests (drawn per request from `--seed`) closes its connection after
reading a few SSE chunks, as a client that goes away would. Over `--duration` seconds:

1. warm-up: load only, until a fifth of the duration has passed and a request has succeeded;
2. D is SIGKILLed while streams are running, and restarted on the same port (the router's
   configured URL stays valid) once the router has ejected it; the soak waits for the router to
   re-admit it and for a request started after the restart to succeed;
3. the same for P, from 55% of the duration on (and not before D has recovered);
4. the load goes on to the end of the duration (at least a few seconds after P recovered), stops,
   and the requests still in flight are given the deadline to end;
5. settling: within one lease (`--lease-ttl-s` plus a few seconds) both workers' `/health` must
   report no request, no transfer, and every KV page free (none referenced, held, pinned or
   reserved), with their page accounting's `integrity` "ok" (`/integrity`: every page walked).

Every request ends with one outcome: `ok`, `client_disconnect` (intended), `error_4xx`,
`error_5xx`, `stream_error` (an error event inside the stream, a stream cut before `[DONE]`, or
a connection that broke) or `hung`: alive past its deadline, the router's `--prefill-timeout` plus
`--read-timeout` (the client's own timeout is three deadlines, so a hang is seen, not masked).
Errors while a worker is down are expected; hangs and leaked pages are not. For each kill it
reports the time from the kill to the router ejecting the worker (polled on `GET /workers`) and
from the restart to the first successful request started after it.

It exits 0 only when no request hung, no page leaked, both workers' integrity is ok, every
killed worker recovered and no process exited on its own. It stops every process it started
(they also die with it, through PR_SET_PDEATHSIG on Linux). Logs of the processes go to
`--log-dir` (default: a temporary directory, removed when the soak passes).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
import orjson

from pd._compat import asyncio_timeout

OUTCOMES = ("ok", "client_disconnect", "error_4xx", "error_5xx", "stream_error", "hung")
ROLES = ("prefill", "decode")
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
        return "ok"
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
        if outcome in ("ok", "client_disconnect"):
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


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def build_report(
    records: list[RequestRecord],
    deadline_s: float,
    kills: list[Kill],
    workers: dict[str, dict[str, Any]],
    duration_s: float,
    unexpected_exits: list[str],
    config: dict[str, Any] | None = None,
    settle_s: float | None = None,
) -> dict[str, Any]:
    """The soak's JSON report, its verdict (`passed`) and the reasons it failed (`failures`)."""
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
    failures += unexpected_exits
    kill_dicts = [
        {k: (_round(v) if isinstance(v, float) else v) for k, v in asdict(kill).items()}
        for kill in kills
    ]
    return {
        "passed": not failures,
        "failures": failures,
        "outcomes": outcomes,
        "hung": outcomes["hung"],
        "requests": len(records),
        "deadline_s": deadline_s,
        "duration_s": round(duration_s, 3),
        "kills": kill_dicts,
        "pages_leaked": leaked,
        "integrity": integrity,
        "settle_s": _round(settle_s),  # from the load's end until both workers settled
        "workers": workers,
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
        lines.append(
            f"  kill {k['role']} at {k['at_s']:.1f} s ({k['streams_active']} streaming, "
            f"{k['in_flight']} in flight): ejected after {s(k['kill_to_eject_s'])}; after the "
            f"restart: ready {s(k['restart_to_ready_s'])}, re-admitted "
            f"{s(k['restart_to_healthy_s'])}, first success {s(k['restart_to_first_success_s'])}"
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
    if report["config"].get("log_dir"):
        lines.append(f"  logs: {report['config']['log_dir']}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn that has the child SIGKILLed when the soak dies (Linux), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, not in the child
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1

    def preexec() -> None:
        prctl(pr_set_pdeathsig, signal.SIGKILL)

    return preexec


@dataclass
class Service:
    """One process of the cluster: how to start it and where it answers."""

    name: str  # "prefill", "decode" or "router"
    argv: list[str]
    url: str
    log_path: str
    proc: subprocess.Popen[bytes] | None = None


class Cluster:
    """Starts, kills and restarts the soak's processes; `stop()` ends every one still running."""

    def __init__(self, env: dict[str, str], log_dir: str) -> None:
        self.env = env
        self.log_dir = log_dir
        self.services: dict[str, Service] = {}
        self._preexec = _die_with_parent()

    def add(self, name: str, module: str, *args: str) -> Service:
        port = _free_port()
        argv = [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(port), *args]
        log_path = os.path.join(self.log_dir, f"{name}.log")
        svc = Service(name, argv, f"http://127.0.0.1:{port}", log_path)
        self.services[name] = svc
        return svc

    def start(self, name: str) -> None:
        svc = self.services[name]
        assert svc.proc is None, f"{name} is running"
        with open(svc.log_path, "ab") as log:
            log.write(f"\n===== pd-bench soak: start {name} at {time.time():.3f}\n".encode())
            log.flush()
            svc.proc = subprocess.Popen(
                svc.argv,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=self._preexec,
            )

    def kill(self, name: str) -> None:
        svc = self.services[name]
        assert svc.proc is not None, f"{name} is not running"
        svc.proc.kill()
        svc.proc.wait()
        svc.proc = None

    def exited(self) -> list[str]:
        """The processes that exited without being killed by the soak."""
        return [
            f"{svc.name} exited on its own with code {svc.proc.returncode} (log {svc.log_path})"
            for svc in self.services.values()
            if svc.proc is not None and svc.proc.poll() is not None
        ]

    def log_tail(self, name: str, n: int = 2000) -> str:
        try:
            with open(self.services[name].log_path, "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        running = [s.proc for s in self.services.values() if s.proc is not None]
        for proc in running:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 10
        for proc in running:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for svc in self.services.values():
            svc.proc = None


async def _wait_ready(
    http: aiohttp.ClientSession, cluster: Cluster, name: str, timeout: float = 300.0
) -> None:
    """Until the service's `/health` answers 200; raises if it exits or takes too long."""
    svc = cluster.services[name]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if svc.proc is None or svc.proc.poll() is not None:
            raise RuntimeError(f"{name} exited while starting:\n{cluster.log_tail(name)}")
        try:
            async with http.get(f"{svc.url}/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                if r.status == 200:
                    return
        except (aiohttp.ClientError, TimeoutError):
            pass
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{name} was not ready within {timeout:g} s:\n{cluster.log_tail(name)}")


async def _router_says_healthy(
    http: aiohttp.ClientSession, router: str, worker: str
) -> bool | None:
    """The router's view of one worker (`GET /workers`); None when it cannot be read."""
    try:
        async with http.get(f"{router}/workers", timeout=aiohttp.ClientTimeout(total=2)) as r:
            body = await r.json()
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None
    for w in body.get("workers", []):
        if w.get("url") == worker:
            return bool(w.get("healthy"))
    return None


async def _poll(predicate: Callable[[], Any], timeout: float, interval: float = 0.05) -> bool:
    """Until `await predicate()` (or `predicate()`) is true; False when `timeout` passed first."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(interval)


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
        """When the first request started at or after `t` ended `ok` (None: none yet)."""
        ends = [
            r.end
            for r in self.records
            if r.start >= t and r.end is not None and classify(r, deadline_s) == "ok"
        ]
        return min(ends) if ends else None

    async def _client(self, i: int) -> None:
        rng = random.Random(f"{self.spec.seed}:{i}")
        while not self._stopping.is_set():
            disconnect = rng.random() < self.spec.disconnect_frac
            rec = RequestRecord(
                client=i,
                start=time.monotonic(),
                disconnect_after=rng.randint(1, 4) if disconnect else None,
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
    async with http.post(
        f"{url}/v1/chat/completions",
        data=orjson.dumps(body),
        headers={"Content-Type": "application/json"},
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
                return
            event = orjson.loads(data)
            if isinstance(event, dict) and "error" in event:
                rec.error = orjson.dumps(event["error"]).decode()[:300]
                return
            now = time.monotonic()
            rec.chunks += 1
            rec.first_chunk = rec.first_chunk or now
            rec.last_chunk = now
            if rec.disconnect_after is not None and rec.chunks >= rec.disconnect_after:
                rec.disconnected = True
                resp.close()  # the connection, not only the response: the router sees it go
                return


# --------------------------------------------------------------------------------- soak


async def _fault(
    http: aiohttp.ClientSession,
    cluster: Cluster,
    load: Load,
    role: str,
    t0: float,
    deadline_s: float,
    recovery_timeout_s: float,
) -> Kill:
    """SIGKILL `role` while streams run, restart it once ejected, and time its recovery."""
    router = cluster.services["router"].url
    worker = cluster.services[role].url

    def busy() -> bool:  # a stream at D, and for P also a request not streaming yet (at P)
        return load.streaming() > 0 and (role != "prefill" or load.in_flight() > load.streaming())

    await _poll(busy, timeout=10.0, interval=0.02)
    kill = Kill(role, worker, time.monotonic() - t0, load.streaming(), load.in_flight())
    t_kill = time.monotonic()
    cluster.kill(role)
    ejected = await _poll(
        lambda: _is_false(_router_says_healthy(http, router, worker)), timeout=15.0, interval=0.02
    )
    if ejected:
        kill.kill_to_eject_s = time.monotonic() - t_kill
    t_restart = time.monotonic()
    cluster.start(role)
    try:
        await _wait_ready(http, cluster, role, timeout=recovery_timeout_s)
    except RuntimeError as e:  # reported through the missing recovery and cluster.exited()
        print(f"pd-bench soak: the restarted {role} worker: {e}", file=sys.stderr)
        return kill
    kill.restart_to_ready_s = time.monotonic() - t_restart
    remaining = recovery_timeout_s - (time.monotonic() - t_restart)
    if await _poll(
        lambda: _is_true(_router_says_healthy(http, router, worker)), timeout=max(1.0, remaining)
    ):
        kill.restart_to_healthy_s = time.monotonic() - t_restart
    remaining = recovery_timeout_s - (time.monotonic() - t_restart)
    if await _poll(lambda: load.first_ok_after(t_restart, deadline_s), max(1.0, remaining), 0.1):
        first = load.first_ok_after(t_restart, deadline_s)
        assert first is not None
        kill.restart_to_first_success_s = first - t_restart
    return kill


async def _is_true(value: Any) -> bool:
    return (await value) is True


async def _is_false(value: Any) -> bool:
    return (await value) is False


async def _settle(
    http: aiohttp.ClientSession, cluster: Cluster, timeout: float
) -> tuple[dict[str, dict[str, Any]], float | None]:
    """Poll both workers' /health until both settled or `timeout`: their end states, and how
    long settling took (None: not within `timeout`)."""
    last: dict[str, tuple[Mapping[str, Any] | None, str]] = {}

    async def read(role: str) -> bool:
        url = cluster.services[role].url
        try:
            async with http.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                health = await r.json()
            if settled(health):  # then the full walk over the pages (/health's is counters)
                async with http.get(f"{url}/integrity", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    health = {**health, **await r.json()}
            last[role] = (health, "")
            return settled(health)
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            last[role] = (None, f"{type(e).__name__}: {e}")
            return False

    async def both() -> bool:
        results = [await read(role) for role in ROLES]
        return all(results)

    t = time.monotonic()
    ok = await _poll(both, timeout=timeout, interval=0.25)
    took = time.monotonic() - t if ok else None
    return {role: worker_end_state(cluster.services[role].url, *last[role]) for role in ROLES}, took


async def _sleep_until(t: float) -> None:
    await asyncio.sleep(max(0.0, t - time.monotonic()))


async def soak(args: argparse.Namespace, cluster: Cluster) -> dict[str, Any]:
    deadline_s = args.prefill_timeout + args.read_timeout
    worker_flags = [
        "--device", "cpu", "--dtype", args.dtype, "--threads", str(args.threads),
        "--kv-pages", str(args.kv_pages), "--max-model-len", "2048",
        "--lease-ttl-s", str(args.lease_ttl_s), "--kv-transfer-timeout-s", str(args.lease_ttl_s),
    ]  # fmt: skip
    p = cluster.add("prefill", "pd.worker.main", "--role", "prefill", *worker_flags)
    d = cluster.add("decode", "pd.worker.main", "--role", "decode", *worker_flags)
    router = cluster.add(
        "router", "pd.router.main", "--prefill", p.url, "--decode", d.url,
        "--local-prefill-max-tokens", "0", "--health-interval", "0.5",
        "--prefill-timeout", str(args.prefill_timeout), "--read-timeout", str(args.read_timeout),
    )  # fmt: skip
    async with aiohttp.ClientSession() as http:
        for role in ROLES:
            cluster.start(role)
        for role in ROLES:
            await _wait_ready(http, cluster, role)
        cluster.start("router")
        await _wait_ready(http, cluster, "router", timeout=60)

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
            await _poll(lambda: load.first_ok_after(t0, deadline_s), args.recovery_timeout, 0.1)
            # 2. D, then 3. P.
            for role, at in (("decode", 0.2), ("prefill", 0.55)):
                await _sleep_until(t0 + at * args.duration)
                kills.append(
                    await _fault(http, cluster, load, role, t0, deadline_s, args.recovery_timeout)
                )
                print(f"pd-bench soak: {kills[-1]}", file=sys.stderr)
                await asyncio.sleep(2.0)
            # 4. the rest of the duration.
            await _sleep_until(max(t0 + args.duration, time.monotonic() + TAIL_S))
        finally:
            duration_s = time.monotonic() - t0
            await load.stop(grace_s=deadline_s + 2.0)
        exits = cluster.exited()
        # 5. settling, within one lease.
        workers, settle_s = await _settle(http, cluster, args.lease_ttl_s + SETTLE_SLACK_S)
    config = {
        k: getattr(args, k)
        for k in ("duration", "clients", "disconnect_frac", "threads", "prompt_tokens",
                  "max_tokens", "seed", "kv_pages", "lease_ttl_s", "prefill_timeout",
                  "read_timeout", "dtype")
    }  # fmt: skip
    config["log_dir"] = cluster.log_dir
    return build_report(
        load.records, deadline_s, kills, workers, duration_s, exits, config, settle_s
    )


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
    p.add_argument("--threads", type=int, default=1, help="cores of each worker")
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
    if args.duration <= 0 or args.clients < 1 or args.threads < 1:
        return "--duration must be > 0, --clients and --threads >= 1"
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
