"""Connectors that start and stop worker processes on this host: `local` (`pd-worker`) and
`simulated` (a host of one `--simulate` worker, ready only after its profile's start-up time).

A new worker registers itself with the router (`--register-with`) as soon as it serves; the
router sends it nothing until its `/ready` says so (a simulated one answers `starting` until its
weights would be loaded). So the planner counts it as starting until the router's list and its
own `/health` show it ready, and starts no other for its role meanwhile.

A worker is removed in the order that loses nothing: the router forgets it first (no new request
goes to it), then SIGTERM drains it (a decode worker's streams end with `: pd-migrate` and the
router continues them on another decode worker; a prefill worker finishes its prefills and waits
until its pinned pages are pulled or released), and the process exits on its own. Only workers
this connector started are removed: it never stops what it does not own.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from pd.planner.connector import Connector
from pd.planner.decide import ROLES, Decision
from pd.planner.signals import Observation
from pd.ports import free_port
from pd.registration import RegistrationError, deregister_from_router
from pd.signing import TOKEN_ENV

log = logging.getLogger("pd.planner")

FAILED_STARTS_MAX = 3  # in a row, per role: then it stops trying (a broken command line)
SPARE_NICE = 19  # a spare started again while the load runs, until its activation
STOP_TIMEOUT_S = 900.0  # a drain's limit before SIGKILL (the worker's own --drain-timeout-s is 600)


@dataclass
class Managed:
    role: str
    url: str
    proc: subprocess.Popen[bytes]
    state: str = "starting"  # -> "ready" -> "leaving"
    parkable: bool = False  # started with --park: a drain can park it again (POST /park)


class ProcessConnector(Connector):
    def __init__(
        self,
        router_url: str,
        *,
        admin_token: str | None = None,
        cluster_token: str | None = None,
        worker_args: Sequence[str] = (),
        host: str = "127.0.0.1",
        log_dir: str | None = None,
    ) -> None:
        self.router_url = router_url
        self.admin_token = admin_token
        self.env = dict(os.environ)
        if cluster_token:
            self.env[TOKEN_ENV] = cluster_token
        self.worker_args = list(worker_args)
        self.host = host
        self.log_dir = Path(log_dir) if log_dir else None
        self.workers: dict[str, Managed] = {}
        self.failed_starts = dict.fromkeys(ROLES, 0)
        self._stops: set[asyncio.Task[None]] = set()
        self.started = 0

    def command(self, role: str, port: int) -> list[str]:
        raise NotImplementedError

    def _common(self, role: str, port: int) -> list[str]:
        args = ["--role", role, "--host", self.host, "--port", str(port)]
        args += ["--register-with", self.router_url]
        if self.admin_token:
            args += ["--admin-token", self.admin_token]
        return args + self.worker_args

    def pending(self) -> dict[str, dict[str, int]]:
        out = {r: {"starting": 0, "leaving": 0} for r in ROLES}
        for m in self.workers.values():
            if m.state in ("starting", "leaving"):
                out[m.role][m.state] += 1
        return out

    async def apply(self, decision: Decision, obs: Observation) -> list[str]:
        actions: list[str] = []
        self._reap(actions)
        for role, want in (("prefill", decision.prefill), ("decode", decision.decode)):
            ready = {w.url: w for w in obs.of(role)}
            for m in self.workers.values():
                if m.state == "starting" and m.url in ready:
                    m.state = "ready"
                    self.failed_starts[role] = 0
                    actions.append(f"{role} worker {m.url} is ready")
            starting = [
                m for m in self.workers.values() if m.role == role and m.state == "starting"
            ]
            if want > len(ready) + len(starting):
                if self.failed_starts[role] >= FAILED_STARTS_MAX:
                    continue
                for _ in range(want - len(ready) - len(starting)):
                    actions.append(await self._start(role))
            elif want < len(ready) and not starting:
                # The least busy of ours first: the fewest streams to move, prefills to finish.
                ours = [m for m in self.workers.values() if m.role == role and m.state == "ready"]
                ours.sort(key=lambda m: ready[m.url].running if m.url in ready else 0)
                for m in ours[: len(ready) - want]:
                    m.state = "leaving"
                    task = asyncio.create_task(self._stop(m))
                    self._stops.add(task)
                    task.add_done_callback(self._stops.discard)
                    actions.append(f"draining {role} worker {m.url}")
        return actions

    async def _start(self, role: str) -> str:
        m = self._spawn(role, self.command)
        self.workers[m.url] = m
        self.started += 1
        return f"starting {role} worker {m.url}"

    def _spawn(self, role: str, command: Callable[[str, int], list[str]], nice: int = 0) -> Managed:
        port = free_port(self.host)
        url = f"http://{self.host}:{port}"
        cmd = command(role, port)
        if nice and shutil.which("nice"):  # it execs the command: the same process id
            cmd = ["nice", "-n", str(nice), *cmd]
        if self.log_dir is None:
            proc = subprocess.Popen(
                cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=self.env
            )
        else:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            with open(self.log_dir / f"{role}-{port}.log", "wb") as out:  # the child keeps it
                proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        log.info("starting %s worker %s: %s", role, url, " ".join(cmd))
        return Managed(role, url, proc, parkable="--park" in cmd)

    def _reap(self, actions: list[str]) -> None:
        """Forget processes that exited: a start that failed counts against its role."""
        for url, m in list(self.workers.items()):
            code = m.proc.poll()
            if code is None:
                continue
            del self.workers[url]
            if m.state == "starting":
                self.failed_starts[m.role] += 1
                actions.append(f"{m.role} worker {url} exited while starting (status {code})")
            elif m.state == "ready":
                actions.append(f"{m.role} worker {url} exited (status {code})")

    async def _stop(self, m: Managed) -> None:
        """Drain `m` and let it exit: the router forgets it first."""
        await self._leave_router(m)
        await self._terminate(m)

    async def _leave_router(self, m: Managed) -> None:
        async with aiohttp.ClientSession() as http:
            try:
                await deregister_from_router(self.router_url, m.url, self.admin_token, http)
            except RegistrationError as e:  # the drain still ends its streams well
                log.warning("router did not forget %s: %s", m.url, e)

    async def _terminate(self, m: Managed) -> None:
        """SIGTERM: `m` drains and exits (SIGKILL after `STOP_TIMEOUT_S`)."""
        m.proc.send_signal(signal.SIGTERM)
        try:
            code = await asyncio.wait_for(asyncio.to_thread(m.proc.wait), STOP_TIMEOUT_S)
        except TimeoutError:
            log.error("%s worker %s did not drain in %.0f s: killed", m.role, m.url, STOP_TIMEOUT_S)
            m.proc.kill()
            code = await asyncio.to_thread(m.proc.wait)
        log.info("%s worker %s drained and stopped (status %s)", m.role, m.url, code)
        self.workers.pop(m.url, None)
        self.stopped(m.role)

    def stopped(self, role: str) -> None:
        """A worker of `role` this connector started has drained and exited."""

    async def close(self) -> None:
        """Stop every worker this connector started (drained, as on a scale-down)."""
        for m in list(self.workers.values()):
            if m.state != "leaving":
                m.state = "leaving"
                task = asyncio.create_task(self._stop(m))
                self._stops.add(task)
        if self._stops:
            await asyncio.gather(*self._stops, return_exceptions=True)


class LocalConnector(ProcessConnector):
    """`pd-worker` processes on this host (give them `--threads` in `worker_args`: workers on one
    machine split its cores)."""

    name = "local"

    def command(self, role: str, port: int) -> list[str]:
        return [sys.executable, "-m", "pd.worker.main", *self._common(role, port)]


class SimulatedConnector(ProcessConnector):
    """One `--simulate` worker a process (docs/simulation.md), ready after `startup_s` modeled
    seconds (-1: its profile's, the weights' bytes over the load rate it states), times
    `time_scale`.

    With `spares`, that many workers a role are started at `start()` parked (`--park`): each
    serves but neither registers nor counts its start-up until `POST /activate`. A scale-up
    activates one (no process starts while the load is on: on a machine of a few cores, a
    process start's seconds of CPU would slow every simulated step and the fit would read
    that), and a spare is started again for each worker that drained. Parked processes are the
    spare nodes of a GPU pool, not GPUs in use: `workers` holds the activated ones only."""

    name = "simulated"

    def __init__(
        self,
        router_url: str,
        profile: str,
        *,
        time_scale: float = 1.0,
        startup_s: float = -1,
        admin_token: str | None = None,
        cluster_token: str | None = None,
        worker_args: Sequence[str] = (),
        host: str = "127.0.0.1",
        log_dir: str | None = None,
        spares: int = 0,
    ) -> None:
        super().__init__(
            router_url,
            admin_token=admin_token,
            cluster_token=cluster_token,
            worker_args=worker_args,
            host=host,
            log_dir=log_dir,
        )
        self.profile = profile
        self.time_scale = time_scale
        self.startup_s = startup_s
        self.spares = spares
        self.parked: dict[str, list[Managed]] = {r: [] for r in ROLES}
        self._spares_started = False

    def command(self, role: str, port: int) -> list[str]:
        args = self._common(role, port)
        args += ["--simulate", self.profile, "--time-scale", str(self.time_scale)]
        args += ["--startup-s", str(self.startup_s)]
        return [sys.executable, "-m", "pd.worker.simulated.host", "--roles", role, *args]

    def _parked_command(self, role: str, port: int) -> list[str]:
        return [*self.command(role, port), "--park"]

    async def start(self) -> None:
        """Start the spares and wait until each serves (once: a second call does nothing)."""
        if self._spares_started:
            return
        self._spares_started = True
        for role in ROLES:
            for _ in range(self.spares):
                self.parked[role].append(self._spawn(role, self._parked_command))
        async with aiohttp.ClientSession() as http:
            for m in [m for ms in self.parked.values() for m in ms]:
                await _serving(http, m)

    async def _start(self, role: str) -> str:
        async with aiohttp.ClientSession() as http:
            while self.parked[role]:
                m = self.parked[role].pop(0)
                try:
                    async with http.post(f"{m.url}/activate") as r:
                        r.raise_for_status()
                except (aiohttp.ClientError, TimeoutError) as e:
                    log.warning("spare %s worker %s did not activate: %s", role, m.url, e)
                    m.proc.kill()
                    continue
                _renice(m.proc.pid, 0)  # a spare started again while the load ran: nice no more
                m.state = "starting"
                self.workers[m.url] = m
                self.started += 1
                return f"activating spare {role} worker {m.url}"
        return await super()._start(role)

    async def _stop(self, m: Managed) -> None:
        """A worker that was a spare drains back into the pool (`POST /park`: no process starts
        while the load runs) where the pool lacks spares; else, or where that fails, it drains
        and exits."""
        if not (m.parkable and len(self.parked[m.role]) < self.spares):
            return await super()._stop(m)
        await self._leave_router(m)
        try:
            async with aiohttp.ClientSession() as http:
                async with http.post(
                    f"{m.url}/park", timeout=aiohttp.ClientTimeout(total=STOP_TIMEOUT_S)
                ) as r:
                    r.raise_for_status()
                    parked = await r.json()
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            log.warning("%s worker %s did not park (%s): stopped instead", m.role, m.url, e)
            return await self._terminate(m)
        log.info("%s worker %s drained and parked: %s", m.role, m.url, parked)
        self.workers.pop(m.url, None)
        if len(self.parked[m.role]) < self.spares:
            self.parked[m.role].append(m)
        else:  # the pool filled meanwhile
            await self._terminate(m)

    def stopped(self, role: str) -> None:
        """A spare started again while the load runs starts at the lowest CPU priority where
        it can be raised again at its activation: its process start (seconds of CPU) is not
        the simulated GPUs' work, and on a few cores it would slow every simulated step."""
        if self.spares and len(self.parked[role]) < self.spares:
            nice = SPARE_NICE if _can_renice() else 0
            self.parked[role].append(self._spawn(role, self._parked_command, nice))

    async def close(self) -> None:
        self.spares = 0  # the workers drained now are not replaced
        await super().close()
        spares = [m for ms in self.parked.values() for m in ms]
        for m in spares:
            m.proc.terminate()
        for m in spares:
            await asyncio.to_thread(m.proc.wait)
        self.parked = {r: [] for r in ROLES}


def _can_renice() -> bool:
    """Whether this process may raise a process's CPU priority back to nice 0 (root, or an
    RLIMIT_NICE that allows it)."""
    if sys.platform != "linux":
        return False
    if os.geteuid() == 0:
        return True
    return resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20


def _renice(pid: int, nice: int) -> None:
    """Set every thread of `pid` to `nice` (Linux's nice is a thread's; new threads inherit
    it); where it cannot, nothing."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError:
            pass


async def _serving(http: aiohttp.ClientSession, m: Managed, timeout_s: float = 120.0) -> None:
    """Wait until `m` answers /health (it may be parked: not ready)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        if m.proc.poll() is not None:
            raise RuntimeError(f"spare {m.role} worker {m.url} exited ({m.proc.returncode})")
        try:
            async with http.get(f"{m.url}/health") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        if asyncio.get_running_loop().time() > deadline:
            raise RuntimeError(f"spare {m.role} worker {m.url} did not serve in {timeout_s} s")
        await asyncio.sleep(0.2)
