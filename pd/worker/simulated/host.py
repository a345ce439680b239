"""Several simulated workers in one process (issue 23, item 3): each a whole pd worker (its HTTP
app, scheduler, KV cache manager, role, transfer manager) on one shared event loop, so that 32 of
them fit on a small machine. A process of real workers would hold one each.

    python -m pd.worker.simulated.host --roles prefill,decode,decode --port 9100 --simulate llama-3.1-8b:h100 ...

Every other flag is a `pd-worker` flag given to each worker; worker i listens on the i-th of
`--ports` when given, else on `--port + i` (a free port each with `--port 0`), and prints its own
`pd-worker ready` line.
SIGTERM or SIGINT drains them all, as it drains one worker.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import sys

from pd.config import ROLES, WorkerConfig
from pd.worker.main import parse_args, run_until_stopped, serve

log = logging.getLogger("pd.worker.simulated.host")


def worker_configs(
    roles: list[str], worker_argv: list[str], ports: list[int] | None = None
) -> list[WorkerConfig]:
    """One config per role, from the shared pd-worker flags; ports as given, else counted up
    from --port."""
    base = parse_args(worker_argv)
    if base.simulate is None:
        raise ValueError("pd.worker.simulated.host serves simulated workers only: give --simulate PROFILE")
    bad = [r for r in roles if r not in ROLES]
    if bad or not roles:
        raise ValueError(f"--roles takes a comma-separated list of {', '.join(ROLES)}")
    if ports is not None and len(ports) != len(roles):
        raise ValueError(f"--ports gives {len(ports)} ports for {len(roles)} roles")
    if ports is None:
        ports = [base.port + i if base.port else 0 for i in range(len(roles))]
    return [dataclasses.replace(base, role=r, port=p) for r, p in zip(roles, ports)]


async def serve_all(cfgs: list[WorkerConfig]) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks = [asyncio.create_task(serve(cfg, stop)) for cfg in cfgs]
    try:
        # One worker that fails to start stops the others: a host is whole or absent.
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in done:
            exc = t.exception()
            if exc is not None:
                raise exc
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pd.worker.simulated.host", description=__doc__)
    parser.add_argument("--roles", required=True, help="e.g. prefill,decode,decode")
    parser.add_argument("--ports", help="one port per role, comma-separated")
    args, rest = parser.parse_known_args(argv)
    try:
        ports = [int(p) for p in args.ports.split(",")] if args.ports else None
        cfgs = worker_configs(args.roles.split(","), rest, ports)
    except ValueError as e:
        print(f"pd.worker.simulated.host: {e}", file=sys.stderr)
        return 2
    return run_until_stopped(serve_all(cfgs), "pd.worker.simulated.host")


if __name__ == "__main__":
    sys.exit(main())
