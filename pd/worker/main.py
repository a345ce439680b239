"""`pd-worker`: one process per node serving a model (role prefill, decode, or both)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
import socket
import sys
from collections.abc import Coroutine
from typing import Any

from aiohttp import web

from pd.cli_args import add_dataclass_arguments, dataclass_from_args
from pd.config import WorkerConfig
from pd.registration import RegistrationError, deregister_from_router, register_with_router
from pd.sim.profile import list_presets, parse_profile

log = logging.getLogger("pd.worker")
SWITCH_INTERVAL_S = 0.0005  # the GIL hand-over the event loop waits for at most (default 5 ms)


def parse_args(argv: list[str] | None = None) -> WorkerConfig:
    parser = argparse.ArgumentParser(
        prog="pd-worker", description="Serve an LLM with a paged KV cache and continuous batching."
    )
    add_dataclass_arguments(parser, WorkerConfig)
    args = parser.parse_args(argv)
    try:
        cfg = dataclass_from_args(WorkerConfig, args)
    except ValueError as e:
        parser.error(str(e))
    if cfg.simulate is not None and cfg.simulate != "list":
        try:  # a bad profile, or a model the profile's GPUs cannot hold, is refused here
            profile = parse_profile(cfg.simulate)
            if not cfg.kv_pages:
                profile.kv_pages(cfg.page_size)
        except (OSError, ValueError) as e:
            parser.error(f"--simulate {cfg.simulate}: {e}")
    return cfg


async def serve(cfg: WorkerConfig, stop: asyncio.Event | None = None) -> None:
    """Serve until SIGTERM/SIGINT, or until `stop` is set when given (then the caller owns the
    signals: several workers in one process, pd/worker/simulated/host.py), then drain."""
    # Here, not at the top: they import torch and the model, which `pd-worker --help` and a
    # refused flag never need.
    from pd.worker.api.server import make_app
    from pd.worker.build import build_worker

    # The loop shares the GIL with the text thread's Python work (large prompts, answers): at
    # Python's 5 ms switch interval a /health under such work waited one interval per hand-over,
    # many of them (docs/EXPERIMENTS.md §16 and §23).
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    loop = asyncio.get_running_loop()
    worker = await loop.run_in_executor(None, build_worker, cfg)
    # NOTE: what start-up built lives as long as the process: out of the collector's sight, a
    # first full collection does not stall the first requests (a simulated worker's start-up
    # objects took long enough to show as a step's overshoot and a slow first pull:
    # docs/EXPERIMENTS.md §23).
    gc.collect()
    gc.freeze()
    log.info("%s", worker.guard.describe())
    runner = web.AppRunner(make_app(worker), handler_cancellation=True, access_log=None)
    await runner.setup()
    sock = socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((cfg.host, cfg.port))
    site = web.SockSite(runner, sock)
    await site.start()
    port = sock.getsockname()[1]
    # A line that scripts and tests wait for.
    bootstrap = f" bootstrap_port={worker.bootstrap_port}" if worker.bootstrap_port else ""
    print(
        f"pd-worker ready: role={cfg.role} model={worker.model_name} "
        f"url=http://{cfg.host}:{port}{bootstrap}",
        flush=True,
    )

    my_url = cfg.advertise_url or f"http://{cfg.host}:{port}"
    registering: set[asyncio.Task[None]] = set()
    if cfg.register_with and cfg.park:  # a spare node: it joins when activated

        def join() -> None:
            task = asyncio.create_task(_register(cfg, my_url))
            registering.add(task)
            task.add_done_callback(registering.discard)

        worker.on_activate = join
    elif cfg.register_with:
        await _register(cfg, my_url)

    if stop is None:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    # Drain: refuse new requests (503), migrate the router's streams, let the others finish
    # (docs/migration.md §2), then exit.
    migrated = worker.begin_drain()
    if cfg.register_with:
        await _register(cfg, my_url, leave=True)
    log.info(
        "draining: %d requests in flight, %d streams migrated", len(worker.engine.handles), migrated
    )
    await worker.drained(cfg.drain_timeout_s)
    await asyncio.sleep(0.05)  # let the last responses flush
    await runner.cleanup()


async def _register(cfg: WorkerConfig, my_url: str, leave: bool = False) -> None:
    """Join (or leave) the router given by --register-with; a refusal is logged, not fatal."""
    import aiohttp

    assert cfg.register_with is not None

    async with aiohttp.ClientSession() as session:
        try:
            if leave:
                await deregister_from_router(cfg.register_with, my_url, cfg.admin_token, session)
            else:
                await register_with_router(
                    cfg.register_with, my_url, cfg.role, cfg.admin_token, session
                )
                log.info("registered %s with router %s", my_url, cfg.register_with)
        except RegistrationError as e:
            log.error("%s", e)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    if cfg.simulate == "list":
        print(list_presets())
        return 0
    return run_until_stopped(serve(cfg), "pd-worker")


def run_until_stopped(main_coro: Coroutine[Any, Any, None], prog: str) -> int:
    """Log, install uvloop where it is, and run a serving coroutine to its end; a bad model path
    or config found while building is one line on stderr and exit status 1."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    try:
        asyncio.run(main_coro)
    except (FileNotFoundError, ValueError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
