"""`pd-planner`: scales a pd cluster's prefill and decode workers apart, online, to hold the SLOs
at the least cost (docs/planner.md)."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys

from aiohttp import web

from pd.cli_args import parse_dataclass
from pd.planner.config import PlannerConfig
from pd.planner.service import PlannerService

EPILOG = """examples:
  pd-planner --router http://127.0.0.1:8000 --slo-ttft-ms 2000 --slo-itl-ms 100 \\
      --connector virtual --decision-file /tmp/pd-plan.json
  pd-planner --router http://127.0.0.1:8000 --admin-token T --slo-ttft-ms 3000 --slo-itl-ms 150 \\
      --connector local --worker-args '--threads 1' --max-decode 2
  pd-planner --router http://127.0.0.1:8000 --admin-token T --slo-ttft-ms 1000 --slo-itl-ms 50 \\
      --connector simulated --simulate llama-3.1-70b:h100:tp4 --time-scale 2
  pd-planner --router http://pd-router:8000 --slo-ttft-ms 2000 --slo-itl-ms 100 \
      --connector kubernetes   # in a pod: deploy/kubernetes/overlays/planner
"""


def parse_config(argv: list[str] | None = None) -> PlannerConfig:
    return parse_dataclass(
        PlannerConfig, argv, prog="pd-planner", description=__doc__, epilog=EPILOG
    )


async def serve(cfg: PlannerConfig) -> None:
    service = PlannerService(cfg)
    runner = web.AppRunner(service.app(), access_log=None)
    await runner.setup()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((cfg.host, cfg.port))
    site = web.SockSite(runner, sock)
    await site.start()
    port = sock.getsockname()[1]
    print(f"pd-planner ready: connector={cfg.connector} url=http://{cfg.host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await service.run(stop)
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(argv)
    logging.basicConfig(
        level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        asyncio.run(serve(cfg))
    except ValueError as e:  # the connector's set-up (e.g. kubernetes outside a pod)
        print(f"pd-planner: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
