"""Pick a backend by name and build a manager."""

from __future__ import annotations

from collections.abc import Callable

from pd.transfer.auth import resolve_token
from pd.transfer.backend import Backend
from pd.transfer.config import TransferConfig
from pd.transfer.manager import TransferManager

BACKENDS = ("nixl", "fake")


def make_backend(
    name: str,
    agent_name: str,
    *,
    nixl_progress_thread: bool = True,
    nixl_progress_delay_us: int = 100,
) -> Backend:
    if name == "nixl":
        from pd.transfer.nixl_backend import NixlBackend

        return NixlBackend(
            agent_name,
            progress_thread=nixl_progress_thread,
            progress_delay_us=nixl_progress_delay_us,
        )
    if name == "fake":
        from pd.transfer.fake_backend import FakeBackend

        return FakeBackend(agent_name)
    raise ValueError(f"unknown transfer backend {name!r}; choose from {BACKENDS}")


def create_manager(
    config: TransferConfig, *, wire_tap: Callable[[bytes], None] | None = None
) -> TransferManager:
    """A manager with the backend named in the config (call `await manager.start()` next)."""
    resolve_token(config.cluster_token)  # fail before creating an agent
    backend = make_backend(
        config.backend,
        f"pd-{config.engine_id}",
        nixl_progress_thread=config.nixl_progress_thread,
        nixl_progress_delay_us=config.nixl_progress_delay_us,
    )
    return TransferManager(config, backend, wire_tap=wire_tap)
