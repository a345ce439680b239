"""Pick a backend by name and build a manager."""

from __future__ import annotations

from collections.abc import Callable

from pd.transfer.auth import resolve_token
from pd.transfer.backend import Backend
from pd.transfer.config import TransferConfig
from pd.transfer.fake_backend import FakeBackend
from pd.transfer.manager import TransferManager
from pd.transfer.sim_backend import SimBackend

BACKENDS = ("nixl", "fake", "sim")


def make_backend(
    name: str,
    agent_name: str,
    *,
    nixl_progress_thread: bool = True,
    nixl_progress_delay_us: int = 100,
    sim_link: tuple[float, float, float] = (50e9, 0.0, 1.0),
) -> Backend:
    """`sim_link`: the sim backend's (bandwidth, latency_s, time_scale)."""
    if name == "nixl":
        # Only when asked for: NIXL is an optional package (pip install pd[nixl]).
        from pd.transfer.nixl_backend import NixlBackend

        return NixlBackend(
            agent_name,
            progress_thread=nixl_progress_thread,
            progress_delay_us=nixl_progress_delay_us,
        )
    if name == "fake":
        return FakeBackend(agent_name)
    if name == "sim":
        bandwidth, latency_s, time_scale = sim_link
        return SimBackend(
            agent_name, bandwidth=bandwidth, latency_s=latency_s, time_scale=time_scale
        )
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
        sim_link=(config.sim_bandwidth, config.sim_latency_s, config.time_scale),
    )
    return TransferManager(config, backend, wire_tap=wire_tap)
