"""Import NIXL whichever way it is installed: `nixl` (meta package), `nixl_cu12` or `nixl_cu13`."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Protocol

from pd.transfer.errors import BackendUnavailable

if TYPE_CHECKING:
    import numpy as np

_CANDIDATES = ("nixl", "nixl_cu12", "nixl_cu13")
_cached: ModuleType | None = None


class NixlXferHandle(Protocol):
    """A posted transfer (`nixl_xfer_handle`)."""

    def release(self) -> None:
        """Release the handle, cancelling the transfer if still in flight; raises when NIXL
        could not cancel it (it then keeps the handle in its own leak list)."""


class NixlAgent(Protocol):
    """The part of `nixl_agent` (NIXL's Python API) the nixl backend uses. Descriptor lists are
    opaque here: what `register_memory`/`get_xfer_descs` return is only handed back to NIXL."""

    def register_memory(self, reg_list: list[tuple[int, int, int, str]], mem_type: str) -> object:
        """Register (addr, len, device id, name) regions; returns the registration list."""

    def deregister_memory(self, dereg_list: object) -> None: ...

    def get_agent_metadata(self) -> bytes: ...

    def add_remote_agent(self, metadata: bytes) -> str | bytes:
        """Load a peer's metadata; returns its agent name (bytes on older NIXL)."""

    def remove_remote_agent(self, agent: str) -> None: ...

    def get_xfer_descs(self, descs: np.ndarray, mem_type: str) -> object:
        """A transfer descriptor list from an (N, 3) array of (addr, len, device id)."""

    def initialize_xfer(
        self, operation: str, local_descs: object, remote_descs: object, remote_agent: str
    ) -> NixlXferHandle: ...

    def transfer(self, handle: NixlXferHandle) -> str:
        """Post the transfer; one of "DONE", "PROC", "ERR"."""

    def check_xfer_state(self, handle: NixlXferHandle) -> str:
        """One of "DONE", "PROC", "ERR"."""


class _AgentConfig(Protocol):
    """The C++ agent config (`nixlBind.nixlAgentConfig`) as the Python wrapper passes it."""

    pthrDelay: int  # microseconds the progress thread sleeps between passes


def import_nixl() -> ModuleType:
    """The NIXL Python module (exposing `nixl_agent`, `nixl_agent_config`), or BackendUnavailable."""
    global _cached
    if _cached is not None:
        return _cached
    errors = []
    for name in _CANDIDATES:
        try:
            mod = importlib.import_module(name)
        except ImportError as e:
            errors.append(f"{name}: {e}")
            continue
        if not hasattr(mod, "nixl_agent"):  # e.g. the meta package without a wheel behind it
            try:
                mod = importlib.import_module(f"{name}._api")
            except ImportError as e:
                errors.append(f"{name}: no nixl_agent ({e})")
                continue
        _cached = mod
        return mod
    raise BackendUnavailable(
        "no NIXL package importable (pip install nixl-cu12 or nixl-cu13); tried "
        + "; ".join(errors)
    )


def nixl_available() -> bool:
    try:
        import_nixl()
    except BackendUnavailable:
        return False
    return True


def make_agent(nixl: ModuleType, name: str, config: object, progress_delay_us: int) -> NixlAgent:
    """`nixl.nixl_agent(name, config)`, with the progress thread sleeping `progress_delay_us`
    between its passes. NIXL's Python wrapper hard-codes 0 (a busy loop: a whole core per idle
    agent); the C++ config has the knob, so it is set on the config as the agent is built."""
    api = importlib.import_module(nixl.nixl_agent.__module__)
    bind = api.nixlBind
    real = bind.nixlAgent

    def build(agent_name: str, agent_config: _AgentConfig) -> object:
        agent_config.pthrDelay = progress_delay_us
        return real(agent_name, agent_config)

    bind.nixlAgent = build
    try:
        return nixl.nixl_agent(name, config)
    finally:
        bind.nixlAgent = real
