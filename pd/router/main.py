"""`pd-router`: the OpenAI-compatible front of prefill, decode and co-located workers."""

from __future__ import annotations

import asyncio
import logging
import sys

from aiohttp import web

from pd.cli_args import parse_dataclass
from pd.kube_api import KubeAPI
from pd.router.app import make_app
from pd.router.config import RouterConfig
from pd.router.picker import MISSING
from pd.signing import optional_token

EPILOG = """examples:
  pd-router --prefill http://p1:8100 --decode http://d1:8200 --decode http://d2:8200
  pd-router --worker http://w1:8100 --worker http://w2:8100 --policy sticky-to-room
  pd-router --admin-token T   # workers join with: pd-worker ... --register-with URL --admin-token T
  pd-router --discovery file --discovery-file workers.txt   # lines 'prefill http://p1:8100'
  pd-router --discovery kubernetes --k8s-prefill-selector kubernetes.io/service-name=pd-prefill \
            --k8s-decode-selector kubernetes.io/service-name=pd-decode   # in a pod
"""


def parse_config(argv: list[str] | None = None) -> RouterConfig:
    return parse_dataclass(RouterConfig, argv, prog="pd-router", description=__doc__, epilog=EPILOG)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(argv)
    if cfg.endpoint_picker:
        try:
            import envoy.service.ext_proc.v3.external_processor_pb2_grpc  # noqa: F401
            import grpc  # noqa: F401
            import grpc_health.v1.health  # noqa: F401
        except ImportError as e:
            print(f"pd-router: {MISSING} ({e})", file=sys.stderr)
            return 2
    if cfg.discovery == "kubernetes":
        try:
            KubeAPI.from_flags(cfg.k8s_api, cfg.k8s_namespace)
        except ValueError as e:
            print(f"pd-router: {e}", file=sys.stderr)
            return 2
    logging.basicConfig(
        level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    log = logging.getLogger("pd.router")
    try:
        import uvloop

        loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    pools = ", ".join(
        f"{name}={len(urls)} ({cfg.policy_of(pool)})"
        for name, pool, urls in (
            ("prefill", "prefill", cfg.prefill),
            ("decode", "decode", cfg.decode),
            ("worker", "both", cfg.worker),
        )
        if urls
    )
    log.info("pd-router on http://%s:%d; %s", cfg.host, cfg.port, pools or "no workers yet")
    if optional_token(cfg.cluster_token) is None:
        log.warning(
            "no --cluster-token: continuations of migrated streams go unsigned, and workers "
            "accept them only from loopback (give router and workers the same token)"
        )
    web.run_app(
        make_app(cfg),
        host=cfg.host,
        port=cfg.port,
        loop=loop,
        access_log=logging.getLogger("aiohttp.access") if cfg.access_log else None,
        handler_cancellation=True,  # a client that goes away cancels its upstream requests
        print=None,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
