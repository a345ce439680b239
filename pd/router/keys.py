"""Typed keys of the router's state on its `web.Application`."""

from __future__ import annotations

from aiohttp import web

from pd.router.admission import Admission
from pd.router.config import RouterConfig
from pd.router.health import HealthChecker
from pd.router.metrics import RouterMetrics
from pd.router.picker import Picker
from pd.router.proxy import Proxy
from pd.router.registry import Registry

CONFIG = web.AppKey("config", RouterConfig)
REGISTRY = web.AppKey("registry", Registry)
METRICS = web.AppKey("metrics", RouterMetrics)
HEALTH = web.AppKey("health", HealthChecker)
PROXY = web.AppKey("proxy", Proxy)
ADMISSION = web.AppKey("admission", Admission)
PICKER = web.AppKey("picker", Picker)  # --endpoint-picker only
