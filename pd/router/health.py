"""Active health checks: poll every worker's `/health`, eject the failing, re-admit the recovered.

A worker is admitted on its first good check, ejected after `health_failures` consecutive bad
ones (at once when a request cannot even connect to it, or when its connection broke during a
request and a check right after fails: `recheck`), and re-admitted after
`health_successes` consecutive good ones. Each good check also refreshes the load it reports,
and a new `instance` in it (the worker restarted) clears what the router expected it to cache.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import orjson

from pd.protocol import WorkerLoad
from pd.router.config import RouterConfig
from pd.router.metrics import RouterMetrics
from pd.router.pairing import report_format
from pd.router.registry import Registry
from pd.router.worker import Worker

log = logging.getLogger("pd.router")


async def probe(
    session: aiohttp.ClientSession,
    w: Worker,
    timeout: aiohttp.ClientTimeout,
    headers: dict[str, str] | None = None,
) -> str | None:
    """GET the worker's /health; None when good (load and model refreshed), else the reason."""
    try:
        async with session.get(w.url + "/health", timeout=timeout, headers=headers) as resp:
            if resp.status != 200:
                return f"/health answered {resp.status}"
            data = orjson.loads(await resp.read())
    except (aiohttp.ClientError, TimeoutError) as e:
        return f"/health failed: {type(e).__name__} {e}".strip()
    except orjson.JSONDecodeError:
        return "/health is not JSON"
    if not isinstance(data, dict) or data.get("status") not in ("ok", "draining"):
        return f"/health status is {data.get('status') if isinstance(data, dict) else data!r}"
    # Alive; new requests only while ready (a draining worker is alive and not ready).
    w.ready = data.get("ready") is not False and data["status"] == "ok"
    why = data.get("not_ready_reason")
    w.not_ready = None if w.ready else (why if isinstance(why, str) else str(data["status"]))
    role = data.get("role")
    if role is not None and role != w.role:
        return f"worker reports role {role!r} but sits in the {w.role} pool"
    if isinstance(data.get("model"), str):
        w.model = data["model"]
    fmt = data.get("runtime_format")
    if isinstance(fmt, dict) and all(isinstance(v, str) for v in fmt.values()):
        w.runtime_format = {str(k): v for k, v in fmt.items()}
    if isinstance(data.get("instance"), str):
        w.instance = data["instance"]
    load = data.get("load")
    if isinstance(load, dict):
        try:
            w.load = WorkerLoad.from_dict(load)
        except TypeError:
            w.load = None
    return None


class HealthChecker:
    def __init__(
        self,
        cfg: RouterConfig,
        registry: Registry,
        metrics: RouterMetrics,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.cfg = cfg
        self.registry = registry
        self.metrics = metrics
        self.headers = headers
        self.timeout = aiohttp.ClientTimeout(
            total=cfg.health_timeout, sock_connect=min(cfg.health_timeout, cfg.connect_timeout)
        )
        self.session: aiohttp.ClientSession | None = None
        self._rechecks: dict[Worker, asyncio.Future[str | None]] = {}  # (`recheck`)
        for pool in registry.pools.values():
            pool.on_eject = self._count_ejection

    def _count_ejection(self, w: Worker) -> None:
        self.metrics.ejections[w.role] += 1

    async def check(self, w: Worker) -> bool:
        return await self._check(w) is None

    async def recheck(self, w: Worker) -> str | None:
        """Check `w` now, out of the loop's turn (a request's connection to it broke), recorded
        as the loop's checks are: None when good, else why not. Whoever asks while a check of
        `w` runs shares it (a worker that crashes breaks all its connections at once)."""
        task = self._rechecks.get(w)
        if task is None:
            task = asyncio.ensure_future(self._check(w))
            self._rechecks[w] = task

            def done(t: asyncio.Future[str | None]) -> None:
                if self._rechecks.get(w) is t:
                    del self._rechecks[w]

            task.add_done_callback(done)
        return await asyncio.shield(task)  # a request that goes away leaves it to the others

    async def _check(self, w: Worker) -> str | None:
        assert self.session is not None, "HealthChecker.session is set in the app's cleanup_ctx"
        before, fmt, ready = w.instance, w.runtime_format, w.ready
        reason = await probe(self.session, w, self.timeout, self.headers)
        if w.ready != ready:
            self.registry.pools[w.role].readiness_changed(w)
        if before is not None and w.instance != before:
            self.registry.pools[w.role].restarted(w)
        if w.runtime_format != fmt and w.role != "both":
            other = self.registry.decode if w.role == "prefill" else self.registry.prefill
            report_format(w, list(other.workers.values()))
        self.record(w, reason)
        return reason

    def record(self, w: Worker, reason: str | None) -> None:
        pool = self.registry.pools[w.role]
        first = not w.checked
        w.checked = True
        if reason is None:
            w.fails, w.oks, w.last_error = 0, w.oks + 1, None
            if not w.healthy and (first or w.oks >= self.cfg.health_successes):
                pool.set_healthy(w, True)
            return
        w.oks, w.fails, w.last_error = 0, w.fails + 1, reason
        self.metrics.health_failures[w.role] += 1
        if first:
            log.warning("%s worker %s not admitted: %s", w.role, w.url, reason)
        if w.healthy and w.fails >= self.cfg.health_failures:
            pool.set_healthy(w, False, reason)

    def eject(self, w: Worker, reason: str) -> None:
        """Eject at once (a request could not connect); the checks re-admit it later."""
        w.oks, w.last_error = 0, reason
        self.registry.pools[w.role].set_healthy(w, False, reason)

    async def check_all(self) -> None:
        workers = list(self.registry)
        if workers:
            await asyncio.gather(*(self.check(w) for w in workers))

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_interval)
            try:
                await self.check_all()
            except Exception:  # a bug here must not end the checks
                log.exception("health check round failed")
