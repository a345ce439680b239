"""`nixl` backend: NIXL agent with UCX; DRAM on CPU, VRAM on CUDA. The decode side pulls (READ).

Descriptor lists are built per request (`initialize_xfer`) from the plan, so no prepared list of
any peer is kept between requests. UCX's progress thread, where it needs one, is NIXL's business.

NOTE: between processes on one host UCX may pick a shared-memory/CMA transport whose post completes
the copy synchronously inside `transfer()`, i.e. on the event loop thread, like a memcpy would.
"""

from __future__ import annotations

import itertools
import logging

from pd.transfer.backend import Backend, BackendCounts, MemRegion, XferState
from pd.transfer.errors import TransferError
from pd.transfer.nixl_compat import NixlXferHandle, import_nixl, make_agent
from pd.transfer.plan import ReadBatch

log = logging.getLogger(__name__)


class NixlBackend(Backend):
    name = "nixl"

    def __init__(
        self,
        agent_name: str,
        *,
        progress_thread: bool = True,
        progress_delay_us: int = 100,
        ucx_backend: str = "UCX",
    ) -> None:
        nixl = import_nixl()
        self.agent_name = agent_name
        conf = nixl.nixl_agent_config(enable_prog_thread=progress_thread, backends=[ucx_backend])
        self._agent = make_agent(nixl, agent_name, conf, progress_delay_us)
        self._reg: list[object] = []  # registration descriptor lists, for deregistration
        self._peers: set[str] = set()
        self._xfers: dict[int, tuple[str, list[NixlXferHandle]]] = {}  # id -> (agent, handles)
        # Released ids whose reads NIXL could not cancel -> the peer agent they read from.
        self._uncancelled: dict[int, str] = {}
        self._ids = itertools.count(1)

    def register(self, regions: list[MemRegion]) -> None:
        for kind in sorted({r.kind for r in regions}):
            descs = [(r.addr, r.nbytes, r.device_id, "") for r in regions if r.kind == kind]
            self._reg.append(self._agent.register_memory(descs, kind))

    def metadata(self) -> bytes:
        return self._agent.get_agent_metadata()

    def add_peer(self, metadata: bytes) -> str:
        name = self._agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else name
        self._peers.add(name)
        return name

    def remove_peer(self, agent: str) -> None:
        for xid in [x for x, (a, _) in self._xfers.items() if a == agent]:
            self.release(xid)
        if agent in self._peers:
            self._peers.discard(agent)
            try:
                self._agent.remove_remote_agent(agent)
            except Exception as e:  # the peer may be gone; its metadata is dropped regardless
                log.warning("nixl: removing agent %s: %s", agent, e)

    def start_read(self, agent: str, batches: list[ReadBatch]) -> int:
        if agent not in self._peers:
            raise TransferError(f"unknown peer agent {agent!r}")
        handles: list[NixlXferHandle] = []
        xid = next(self._ids)
        self._xfers[xid] = (agent, handles)  # registered first so release() frees partial posts
        try:
            for b in batches:
                local = self._agent.get_xfer_descs(b.local, b.local_kind)
                remote = self._agent.get_xfer_descs(b.remote, b.remote_kind)
                h = self._agent.initialize_xfer("READ", local, remote, agent)
                handles.append(h)
                if self._agent.transfer(h) == "ERR":
                    raise TransferError("nixl: posting the read failed")
        except Exception as e:
            self.release(xid)
            raise TransferError(f"nixl: read from {agent!r} failed to start: {e}") from e
        return xid

    def check(self, xfer: int) -> XferState:
        entry = self._xfers.get(xfer)
        if entry is None:
            return XferState.ERR
        state = XferState.DONE
        for h in entry[1]:
            try:
                s = self._agent.check_xfer_state(h)
            except Exception as e:  # e.g. nixlRemoteDisconnectError
                log.info("nixl: transfer %d: %s", xfer, e)
                return XferState.ERR
            if s == "ERR":
                return XferState.ERR
            if s == "PROC":
                state = XferState.PROC
        return state

    def release(self, xfer: int) -> bool:
        entry = self._xfers.pop(xfer, None)
        if entry is None:  # released before (e.g. with its dead peer): report how that went
            return xfer not in self._uncancelled
        safe = True
        for h in entry[1]:
            try:
                h.release()
            except Exception as e:  # NIXL keeps an uncancellable handle in its own leak list
                log.warning("nixl: releasing transfer %d: %s", xfer, e)
                safe = False
        if not safe:
            self._uncancelled[xfer] = entry[0]  # ids are never reused (a counter)
        return safe

    def settled(self, xfer: int) -> bool:
        # Confirmed once the peer it reads from is removed: its UCX endpoints are closed then,
        # so nothing more can land. (A live peer's read usually just completes: the owner's
        # quarantine bounds the wait for that case.)
        agent = self._uncancelled.get(xfer)
        if agent is None or agent not in self._peers:
            self._uncancelled.pop(xfer, None)
            return True
        return False

    def counts(self) -> BackendCounts:
        return BackendCounts(len(self._peers), sum(len(h) for _, h in self._xfers.values()), 0)

    def close(self) -> None:
        for xid in list(self._xfers):
            self.release(xid)
        for agent in list(self._peers):
            self.remove_peer(agent)
        for reg in self._reg:
            try:
                self._agent.deregister_memory(reg)
            except Exception as e:
                log.warning("nixl: deregistering memory: %s", e)
        self._reg.clear()
