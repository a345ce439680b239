"""Starts a simulated cluster's workers for the benchmarks: hosts of several simulated workers
each (pd/worker/simulated/host.py), on free ports, and reads back how honest their clock was.

The clock check (issue 23, item 3): every simulated step sleeps until its modeled time (times the
time scale K) is up; a step whose real duration runs past that overshoots. Over a run, a worker's
overshoot is (real step seconds - K x modeled step seconds) / (K x modeled step seconds), from its
`/health` `simulate` counters before and after; results are refused where the worst worker's
exceeds `max_overshoot` (a few percent: then raise K).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pd.ports import free_ports

DEFAULT_MAX_OVERSHOOT = 0.05


@dataclass
class SimWorkers:
    """The workers of a simulated cluster: URLs by role, and the host processes serving them."""

    urls: dict[str, list[str]] = field(default_factory=dict)
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def all_urls(self) -> list[str]:
        return [u for urls in self.urls.values() for u in urls]

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def host_groups(roles: Sequence[str], per_process: int) -> list[list[int]]:
    """Worker indices grouped into hosts of at most `per_process`, each host one role's workers
    where possible (so a host's workers do the same kind of work)."""
    if per_process < 1:
        raise ValueError("workers per process must be >= 1")
    groups: list[list[int]] = []
    for role in dict.fromkeys(roles):
        mine = [i for i, r in enumerate(roles) if r == role]
        groups += [mine[i : i + per_process] for i in range(0, len(mine), per_process)]
    return groups


def start_sim_workers(
    profile: str,
    roles: Sequence[str],
    *,
    time_scale: float,
    per_process: int = 8,
    worker_args: Sequence[str] = (),
    log_dir: str | None = None,
) -> SimWorkers:
    """Start one host per group of workers; returns at once (wait for each URL's /health)."""
    ports = free_ports(len(roles))
    out = SimWorkers()
    env = {**os.environ, "PD_CLUSTER_TOKEN": os.environ.get("PD_CLUSTER_TOKEN", "pd-sim")}
    for n, group in enumerate(host_groups(roles, per_process)):
        cmd = [
            sys.executable, "-m", "pd.worker.simulated.host",
            "--roles", ",".join(roles[i] for i in group),
            "--ports", ",".join(str(ports[i]) for i in group),
            "--simulate", profile, "--time-scale", str(time_scale), *worker_args,
        ]  # fmt: skip
        log = open(os.path.join(log_dir, f"host{n}.log"), "wb") if log_dir else subprocess.DEVNULL
        out.procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    for i, role in enumerate(roles):
        out.urls.setdefault(role, []).append(f"http://127.0.0.1:{ports[i]}")
    return out


async def clock_counters(
    http: aiohttp.ClientSession, urls: Sequence[str]
) -> dict[str, dict[str, Any]]:
    """Each worker's `/health` `simulate` counters."""
    out = {}
    for url in urls:
        async with http.get(f"{url}/health") as r:
            health = await r.json()
        out[url] = health["simulate"]
    return out


def overshoot(
    before: Mapping[str, Mapping[str, Any]], after: Mapping[str, Mapping[str, Any]]
) -> dict[str, Any]:
    """The run's overshoot per worker (a share of its scaled modeled step time) and the worst."""
    per: dict[str, float] = {}
    steps = 0
    for url, a in after.items():
        b = before.get(url, {})
        modeled = (a["modeled_s"] - b.get("modeled_s", 0.0)) * a["time_scale"]
        real = a["real_s"] - b.get("real_s", 0.0)
        steps += a["steps"] - b.get("steps", 0)
        per[url] = round((real - modeled) / modeled, 4) if modeled > 0 else 0.0
    worst = max(per.values(), default=0.0)
    return {"worst": worst, "per_worker": per, "steps": steps}
