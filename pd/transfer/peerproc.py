"""A prefill-side transfer process with deterministic pools, for tests and `pd-bench transfer`.

`python -m pd.transfer.peerproc '<json spec>'` starts a manager serving pools whose bytes are a
function of a seed (`pool_tensors`), so a decode process can rebuild the expected bytes and compare
exactly. Commands come as JSON lines on stdin, events go out as JSON lines on stdout,
prefixed with EVENT_PREFIX:

    -> {"op": "send", "slots": {"kv": [..]}, "lease_ttl_s": 5}   <- {"event": "sender", "params": {..}}
    <- {"event": "released", "transfer_id": .., "reason": "done"|"abort"|"lease_expired"}
    -> {"op": "quit"}
First line out: {"event": "ready", "port": .., "engine_id": ..}.
"""

from __future__ import annotations

import asyncio
import os
import queue
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Any

import orjson
import torch

from pd.transfer.base import KVSender
from pd.transfer.config import TransferConfig
from pd.transfer.factory import create_manager
from pd.transfer.messages import b64
from pd.transfer.pools import PoolDesc, kv_pool_from_tensors, whole_pool_from_tensors


@dataclass(frozen=True)
class PoolSpec:
    """A pool of seeded bytes: KV `[slots, layers, 2, heads/tp, page, head_dim]` or whole `[slots, n]`."""

    name: str
    num_slots: int
    tp: int = 1
    kind: str = "kv"  # "kv" (split by heads) or "whole" (per-rank-whole)
    layers: int = 2
    heads: int = 4
    page_size: int = 16
    head_dim: int = 8
    slot_elems: int = 64  # "whole" pools
    seed: int = 0
    random: bool = True  # False: zeros (fast to set up when the content does not matter)

    def to_dict(self) -> dict[str, Any]:
        return self.__dict__.copy()


def global_tensor(spec: PoolSpec, rank: int = 0) -> torch.Tensor:
    """The pool's content as one tensor over all heads (KV) or one rank's content (whole)."""
    g = torch.Generator().manual_seed(spec.seed * 1000 + (rank if spec.kind == "whole" else 0))
    shape: tuple[int, ...]
    if spec.kind == "kv":
        shape = (spec.num_slots, spec.layers, 2, spec.heads, spec.page_size, spec.head_dim)
    else:
        shape = (spec.num_slots, spec.slot_elems)
    if not spec.random:
        return torch.zeros(shape, dtype=torch.int16)
    return torch.randint(-(2**15), 2**15 - 1, shape, dtype=torch.int16, generator=g)


def pool_tensors(spec: PoolSpec, *, fill: bool) -> list[torch.Tensor]:
    """One tensor per rank: seeded content when `fill`, zeros otherwise."""
    out = []
    for r in range(spec.tp):
        if spec.kind == "kv":
            hr = spec.heads // spec.tp
            t = (
                global_tensor(spec)[:, :, :, r * hr : (r + 1) * hr].contiguous()
                if fill
                else torch.zeros(
                    spec.num_slots,
                    spec.layers,
                    2,
                    hr,
                    spec.page_size,
                    spec.head_dim,
                    dtype=torch.int16,
                )
            )
        else:
            t = (
                global_tensor(spec, r)
                if fill
                else torch.zeros(spec.num_slots, spec.slot_elems, dtype=torch.int16)
            )
        out.append(t)
    return out


def pool_desc(spec: PoolSpec, tensors: list[torch.Tensor]) -> PoolDesc:
    if spec.kind == "kv":
        return kv_pool_from_tensors(spec.name, tensors, spec.heads)
    return whole_pool_from_tensors(spec.name, tensors)


EVENT_PREFIX = "@pd-event "  # other libraries (NIXL) log to stdout too


def parse_event(line: bytes | str) -> dict[str, Any] | None:
    text = line.decode() if isinstance(line, bytes) else line
    return orjson.loads(text[len(EVENT_PREFIX) :]) if text.startswith(EVENT_PREFIX) else None


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(EVENT_PREFIX + orjson.dumps(obj).decode() + "\n")
    sys.stdout.flush()


async def _main(spec: dict[str, Any]) -> None:
    cfg = TransferConfig(**spec.get("config", {}))
    mgr = create_manager(cfg)
    await mgr.start()
    keep = []
    for p in spec["pools"]:
        ps = PoolSpec(**p)
        tensors = pool_tensors(ps, fill=True)
        keep.append(tensors)
        mgr.register_pool(pool_desc(ps, tensors))
    _emit(
        {
            "event": "ready",
            "port": mgr.bootstrap_port,
            "engine_id": mgr.engine_id,
            "pid": os.getpid(),
            "agent_metadata": b64(mgr.backend.metadata()),  # for bare-NIXL comparisons
            "pools": [p.to_dict() for p in mgr.pools.values()],
        }
    )

    def released(sender: KVSender, reason: str) -> None:
        _emit({"event": "released", "transfer_id": sender.transfer_id, "reason": reason})

    while True:
        line = await asyncio.to_thread(sys.stdin.readline)
        if not line:
            break
        cmd = orjson.loads(line)
        if cmd["op"] == "send":
            s = mgr.create_sender(
                cmd["slots"],
                released,
                lease_ttl_s=cmd.get("lease_ttl_s"),
                transfer_id=cmd.get("transfer_id"),
            )
            _emit({"event": "sender", "params": s.params().to_dict()})
        elif cmd["op"] == "quit":
            break
    await mgr.close()
    os._exit(0)  # the stdin reader thread may still block


class PeerProcess:
    """Client side: starts `python -m pd.transfer.peerproc` and talks to it. `close()` SIGKILLs it."""

    def __init__(
        self, spec: dict[str, Any], env: dict[str, str] | None = None, start_timeout_s: float = 60.0
    ) -> None:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        pythonpath = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pd.transfer.peerproc", orjson.dumps(spec).decode()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": pythonpath, **(env or {})},
        )
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        try:
            self.ready = self.next_event(start_timeout_s)
        except BaseException:
            self.close()
            raise
        assert self.ready["event"] == "ready", self.ready
        self.port, self.engine_id, self.pid = (
            self.ready["port"],
            self.ready["engine_id"],
            self.ready["pid"],
        )

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if (event := parse_event(line)) is not None:
                self.events.put(event)

    def next_event(self, timeout_s: float = 10.0) -> dict[str, Any]:
        try:
            return self.events.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"no event from the peer process within {timeout_s}s") from None

    async def aevent(self, timeout_s: float = 10.0) -> dict[str, Any]:
        return await asyncio.to_thread(self.next_event, timeout_s)

    async def send(self, slots: dict[str, list[int]], lease_ttl_s: float = 10.0) -> dict[str, Any]:
        """Create a sender over `slots`; returns its transfer params (a dict)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(
            orjson.dumps({"op": "send", "slots": slots, "lease_ttl_s": lease_ttl_s}) + b"\n"
        )
        self.proc.stdin.flush()
        ev = await self.aevent()
        assert ev["event"] == "sender", ev
        return ev["params"]

    def kill(self, sig: int = 9) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


if __name__ == "__main__":
    asyncio.run(_main(orjson.loads(sys.argv[1])))
