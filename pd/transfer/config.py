"""Configuration of one transfer manager (the worker maps its own flags onto it)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TransferConfig:
    backend: str = "nixl"  # "nixl", "fake" (in-process copies) or "sim" (timed, no bytes)
    serve: bool = True  # run the bootstrap server (prefill side; harmless on decode)
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)  # new per process start
    bootstrap_host: str = "127.0.0.1"  # address to bind
    bootstrap_port: int = 0  # 0: ephemeral, see TransferManager.bootstrap_port
    advertise_host: str | None = None  # host put into params (default: bootstrap_host)
    cluster_token: str | None = None  # None: from the environment (PD_CLUSTER_TOKEN)
    handshake_timeout_s: float = 5.0
    transfer_timeout_s: float = 30.0  # from pull start to Success
    heartbeat_interval_s: float = 1.0
    heartbeat_misses: int = 3  # a peer silent for interval * misses is dead
    session_timeout_s: float = 60.0  # P forgets a silent decode session
    peer_idle_timeout_s: float = 30.0  # D closes a link without transfers (capped by P's session/2)
    default_lease_ttl_s: float = 30.0
    poll_interval_s: float = 0.0005
    max_desc_bytes: int = 0  # cap on a coalesced descriptor (0: none)
    # NIXL's UCX progress thread. Needed where the read target must progress (UCX over TCP);
    # not for RDMA or same-host shared memory/CMA.
    nixl_progress_thread: bool = True
    # Sleep of that thread between passes. NIXL's Python wrapper sets 0 (a busy loop: a core per
    # idle agent); 100 us leaves an idle agent a small share of a core (docs/EXPERIMENTS.md §23).
    nixl_progress_delay_us: int = 100
    # The pairing contract, opaque to this layer (the worker's: checkpoint digest, KV format).
    # P sends it in its Welcome; D refuses a P whose contract differs from its own in any key
    # (ContractMismatch, naming both sides' values). None: D checks nothing (P sends none).
    contract: Mapping[str, str] | None = None
    # What each side runs that need not match (quantization, kernels): P sends it in its Welcome,
    # D logs it at the first handshake with that P. Never compared.
    runtime: Mapping[str, str] = field(default_factory=dict)
    # The `sim` backend's link (sim_backend.py): bytes/s of each local rank's link and the
    # latency of one read, every modeled duration stretched by `time_scale`.
    sim_bandwidth: float = 50e9
    sim_latency_s: float = 0.0
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        for name in ("contract", "runtime"):
            value = getattr(self, name)
            if value is None:
                continue
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
                raise ValueError(f"{name} must map strings to strings: {dict(value)!r}")
            object.__setattr__(self, name, dict(value))  # a copy of its own
        if self.backend not in ("nixl", "fake", "sim"):
            raise ValueError(f"unknown transfer backend {self.backend!r} (nixl, fake or sim)")
        if self.sim_bandwidth <= 0 or self.sim_latency_s < 0 or self.time_scale <= 0:
            raise ValueError("sim_bandwidth and time_scale must be > 0, sim_latency_s >= 0")
        if not 0 <= self.bootstrap_port < 65536:
            raise ValueError(f"bootstrap_port out of range: {self.bootstrap_port}")
        for name in (
            "handshake_timeout_s",
            "transfer_timeout_s",
            "heartbeat_interval_s",
            "session_timeout_s",
            "peer_idle_timeout_s",
            "default_lease_ttl_s",
            "poll_interval_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.nixl_progress_delay_us < 0:
            raise ValueError("nixl_progress_delay_us must be >= 0")
        if self.heartbeat_misses < 1:
            raise ValueError("heartbeat_misses must be >= 1")
