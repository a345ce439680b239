"""The planner at work: every `interval_s` (the planner's seconds), read the cluster
(observe.py), decide (decide.py), and hand the decision to the connector; serve `/metrics` and
`/health` meanwhile. One log line per decision that changes something, with its reasons, and one
per action the connector took."""

from __future__ import annotations

import asyncio
import logging
import shlex
from typing import Any

import aiohttp
from aiohttp import web

from pd.kube_api import KubeAPI
from pd.planner.config import PlannerConfig
from pd.planner.connector import Connector
from pd.planner.decide import Planner
from pd.planner.kubernetes import KubernetesConnector
from pd.planner.metrics import PlannerMetrics
from pd.planner.observe import ClusterReader
from pd.planner.processes import LocalConnector, SimulatedConnector
from pd.planner.virtual import VirtualConnector

log = logging.getLogger("pd.planner")


def make_connector(cfg: PlannerConfig) -> Connector:
    assert cfg.router is not None
    if cfg.connector == "virtual":
        assert cfg.decision_file is not None
        return VirtualConnector(cfg.decision_file, cfg.ack_timeout_s)
    if cfg.connector == "kubernetes":
        return KubernetesConnector(
            KubeAPI.from_flags(cfg.k8s_api, cfg.k8s_namespace),
            {"prefill": cfg.k8s_prefill_deployment, "decode": cfg.k8s_decode_deployment},
            cfg.router,
            cfg.admin_token,
        )
    args = shlex.split(cfg.worker_args)
    if cfg.connector == "simulated":
        assert cfg.simulate is not None
        return SimulatedConnector(
            cfg.router,
            cfg.simulate,
            time_scale=cfg.time_scale,
            startup_s=cfg.startup_s,
            admin_token=cfg.admin_token,
            cluster_token=cfg.cluster_token,
            worker_args=args,
            log_dir=cfg.log_dir,
            spares=cfg.spares,
        )
    return LocalConnector(
        cfg.router,
        admin_token=cfg.admin_token,
        cluster_token=cfg.cluster_token,
        worker_args=args,
        log_dir=cfg.log_dir,
    )


class PlannerService:
    def __init__(self, cfg: PlannerConfig, connector: Connector | None = None) -> None:
        assert cfg.router is not None
        self.cfg = cfg
        self.planner = Planner(cfg.slo, cfg.bounds, cfg.knobs)
        self.reader = ClusterReader(
            cfg.router, cfg.time_scale, cfg.window_s, admin_token=cfg.admin_token
        )
        self.connector = connector or make_connector(cfg)
        self.metrics = PlannerMetrics(self.planner, self.connector)
        self.actions: list[str] = []  # what the connector did, oldest first (the latest kept)

    async def tick(self, http: aiohttp.ClientSession) -> None:
        """One observation, one decision, the connector's turn."""
        try:
            obs = await self.reader.observe(http)
        except Exception:  # the next tick tries again
            self.metrics.failed_polls += 1
            log.exception("reading the cluster failed")
            return
        self.metrics.observations += 1
        decision = self.planner.observe(obs)
        done = await self.connector.apply(decision, obs)
        for line in done:
            log.info("%s: %s", self.connector.name, line)
        self.actions += done
        del self.actions[:-1000]

    async def run(self, stop: asyncio.Event) -> None:
        await self.connector.start()
        period = self.cfg.interval_s * self.cfg.time_scale
        async with aiohttp.ClientSession() as http:
            try:
                while not stop.is_set():
                    await self.tick(http)
                    try:
                        await asyncio.wait_for(stop.wait(), period)
                    except TimeoutError:
                        pass
            finally:
                await self.connector.close()

    def app(self) -> web.Application:
        app = web.Application()

        async def metrics(_: web.Request) -> web.Response:
            return web.Response(body=self.metrics.render(), content_type="text/plain")

        async def health(_: web.Request) -> web.Response:
            last = self.planner.decisions[-1] if self.planner.decisions else None
            body: dict[str, Any] = {
                "status": "ok",
                "connector": self.connector.name,
                "observations": self.metrics.observations,
                "targets": {r: s.target for r, s in self.planner.roles.items()},
                "pending": self.connector.pending(),
                "last_decision": last.line() if last else None,
                "actions": self.actions[-20:],
            }
            return web.json_response(body)

        app.router.add_get("/metrics", metrics)
        app.router.add_get("/health", health)
        return app
