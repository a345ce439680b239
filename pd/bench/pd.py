"""`pd-bench pd`: one workload on a co-located worker and on a prefill/decode pair, side by side.

A preset of `pd-bench serve`: it starts one `--role both` worker with `--threads` cores and a
pd-router in front of a prefill and a decode worker with half of them each (both setups stay up;
only the one being measured is loaded), runs the workload (default `mixed`: short chats plus
periodic long prompts) at each rate on both, phases alternated per rate, prints or writes the
serve benchmark's figures (targets `colocated` and `pd`), and stops everything it started.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from typing import IO

import aiohttp

from pd.bench import serve
from pd.bench.serve.cli import BenchInputError, check_args, emit, measure, parse_rates
from pd.bench.serve.runner import Target
from pd.ports import free_port


def add_arguments(p: argparse.ArgumentParser) -> None:
    serve.add_arguments(p, targets=False)
    p.set_defaults(workload="mixed", rates="0.5,1,2", num_requests=32)
    w = p.add_argument_group("setups")
    w.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="cores to share out")
    w.add_argument("--dtype", default="auto", help="compute dtype of the workers")


# Each spawned process's stderr, an unnamed temporary file (gone when closed): what a process
# that exits during the set-up said is shown (a missing model, a refused flag), not lost.
_STDERR: dict[int, IO[bytes]] = {}


def _spawn(module: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PD_CLUSTER_TOKEN": os.environ.get("PD_CLUSTER_TOKEN", "pd-bench")}
    err = tempfile.TemporaryFile()
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args], env=env, stdout=subprocess.DEVNULL, stderr=err
    )
    _STDERR[proc.pid] = err
    return proc


def _exited(proc: subprocess.Popen) -> str:
    """What a process that exited said last on stderr (when _spawn started it)."""
    err = _STDERR.get(proc.pid)
    tail = ""
    if err is not None:
        err.seek(0)
        tail = err.read()[-2000:].decode(errors="replace").strip()
    args = " ".join(map(str, proc.args)) if isinstance(proc.args, list) else str(proc.args)
    return f"{args} exited with {proc.returncode}" + (f":\n{tail}" if tail else "")


async def _wait_healthy(url: str, procs: list[subprocess.Popen], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            gone = [p for p in procs if p.poll() is not None]
            if gone:
                raise RuntimeError(f"a process of the setup exited: {_exited(gone[0])}")
            try:
                async with http.get(f"{url}/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} did not become healthy")


def start_setup(kind: str, args: argparse.Namespace) -> tuple[str, list[subprocess.Popen]]:
    """Start the co-located worker ("both") or P + D + router ("pd"); returns the client URL."""
    common = ["--dtype", args.dtype, "--max-model-len", "4096"]
    if kind == "both":
        port = free_port()
        procs = [
            _spawn(
                "pd.worker.main",
                "--role",
                "both",
                "--port",
                str(port),
                "--threads",
                str(args.threads),
                *common,
            )
        ]
        return f"http://127.0.0.1:{port}", procs
    half = str(max(1, args.threads // 2))
    p_port, d_port, r_port = free_port(), free_port(), free_port()
    procs = [
        _spawn(
            "pd.worker.main", "--role", "prefill", "--port", str(p_port), "--threads", half, *common
        ),
        _spawn(
            "pd.worker.main", "--role", "decode", "--port", str(d_port), "--threads", half, *common
        ),
    ]
    asyncio.run(_wait_healthy(f"http://127.0.0.1:{p_port}", procs))
    asyncio.run(_wait_healthy(f"http://127.0.0.1:{d_port}", procs))
    procs.append(
        _spawn(
            "pd.router.main",
            "--port",
            str(r_port),
            "--prefill",
            f"http://127.0.0.1:{p_port}",
            "--decode",
            f"http://127.0.0.1:{d_port}",
            "--health-interval",
            "0.5",
            "--local-prefill-max-tokens",  # every request through P then D: the transfer path
            "0",
        )
    )
    return f"http://127.0.0.1:{r_port}", procs


def run(args: argparse.Namespace) -> int:
    try:  # before anything starts
        check_args(args)
        parse_rates(args.rates)
    except BenchInputError as e:
        print(f"pd-bench pd: {e}", file=sys.stderr)
        return 2
    setups = [start_setup(kind, args) for kind in ("both", "pd")]
    try:
        for url, procs in setups:
            asyncio.run(_wait_healthy(url, procs))
        targets = [Target("colocated", setups[0][0]), Target("pd", setups[1][0])]
        try:
            out, records = asyncio.run(measure(targets, args))
        except BenchInputError as e:
            print(f"pd-bench pd: {e}", file=sys.stderr)
            return 2
        emit(out, records, args)
    finally:
        for _, procs in setups:
            for p in procs:
                p.terminate()
        for _, procs in setups:
            for p in procs:
                p.wait(timeout=60)
    return 0
