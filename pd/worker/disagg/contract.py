"""Joins a worker to `pd.transfer`: one transfer manager, the KV pool it serves, and what both
sides of a pair must agree on (`KVContract`) before any byte moves.

The contract is the checkpoint as stored (its digest, LoadedCheckpoint.digest, with the model's
shape) and the KV format (page size, layout, dtype: the bytes of a page). It is checked twice on
D: against the fields of P's kv_transfer_params (a 400 before anything is dialed), and at the
handshake (P's Welcome carries it: a mismatch fails the pull, naming both sides).

How each side computes (`runtime_format`: the compute dtype, the format of the linear layers and
of the LM head, the attention path) must match too: P's first token and K/V and D's next tokens
are one answer, and two formats are two models (int4 against int8 weights, or one kernel's
rounding against another's). It is compared at the handshake beside the contract (as its
`runtime.*` keys), shown in /health, and the router pairs a P with a D only when theirs are
equal. The model's name and the checkpoint are reported with it in D's log.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from typing import Any, Protocol, cast, runtime_checkable

import torch

from pd.config import WorkerConfig
from pd.sim.profile import parse_profile
from pd.transfer import (
    PoolDesc,
    TransferConfig,
    TransferManager,
    create_manager,
    kv_pool_from_tensors,
)
from pd.worker.model.config import ModelConfig
from pd.worker.model.runner import ModelRunner

KV_POOL = "kv"
# Page-major buffer [pages, layers, K/V, kv heads, page size, head dim]: see pd/kvcache/kv_pool.py;
# K's head dims in rotary pairs side by side (`Rotary` in pd/worker/model/llama.py). Workers whose
# K lies otherwise (rotate-half, before 2026-12) refuse these pages, and these workers theirs.
KV_LAYOUT = "page-major-HND-rope-pairs"


class KVRunner(Protocol):
    """What the roles read of a runner: ModelRunner, or pd.sim's SimulatedRunner."""

    config: ModelConfig
    dtype: torch.dtype
    page_size: int


@dataclass(frozen=True)
class KVContract:
    """What P and D must share for D to decode from P's pages (checked on D, from the params
    and at the handshake)."""

    # The checkpoint as stored (its digest: other weights of the same shape differ) and the
    # model's shape; not its name (a served name may differ), nor its runtime quantization.
    model_fingerprint: str
    page_size: int
    kv_layout: str
    dtype: str  # of the KV pages (the compute dtype): part of the pages' bytes

    @classmethod
    def of(cls, runner: KVRunner) -> KVContract:
        shape = asdict(runner.config)
        shape.pop("name")
        # "" for weights that came from no file (a runner built in a test): the shape alone.
        digest = getattr(runner, "checkpoint_digest", "")
        fingerprint = hashlib.sha256(repr((sorted(shape.items()), digest)).encode()).hexdigest()
        dtype = str(runner.dtype).removeprefix("torch.")
        return cls(fingerprint[:16], runner.page_size, KV_LAYOUT, dtype)

    def wire(self) -> dict[str, str]:
        """The contract as the transfer layer carries it (TransferConfig.contract)."""
        return {k: str(v) for k, v in asdict(self).items()}


def runtime_format(runner: KVRunner) -> dict[str, str]:
    """How this worker computes its checkpoint: P and D must be equal in every key (module
    docstring); /health shows it."""
    r: Any = runner  # stand-ins in tests have only some of these
    quantization = str(getattr(r, "quantization", "none"))
    return {
        "compute_dtype": str(runner.dtype).removeprefix("torch."),
        "linear": quantization,
        "lm_head": str(getattr(r, "lm_head_quantization", quantization)),
        "attention": str(getattr(r, "attention_backend", "unknown")),
    }


def runtime_report(runner: KVRunner) -> dict[str, str]:
    """The runtime format with the model's name and checkpoint: what D logs of P and itself."""
    r: Any = runner
    return {
        "model": str(runner.config.name),
        "checkpoint": getattr(r, "checkpoint_digest", "") or "unknown",
        **runtime_format(runner),
    }


def handshake_contract(contract: KVContract, runtime: dict[str, str]) -> dict[str, str]:
    """What D compares with P's at the handshake: the contract and the runtime format."""
    return {**contract.wire(), **{f"runtime.{k}": v for k, v in runtime.items()}}


@runtime_checkable
class DescribesKVPool(Protocol):
    """A runner whose KV pool holds no memory (pd.sim's SimulatedRunner): it describes the pool
    the transfer layer registers itself, with real page sizes at addresses that hold nothing."""

    def kv_pool_desc(self, name: str) -> PoolDesc: ...


def kv_pool_of(runner: KVRunner) -> PoolDesc:
    """The KV pool a worker's transfer manager serves: the runner's own description, or one
    built from its page-major buffers, one per TP rank (ModelRunner)."""
    if isinstance(runner, DescribesKVPool):
        return runner.kv_pool_desc(KV_POOL)
    buffers = [pool.buffer for pool in cast(ModelRunner, runner).kv_pools]
    return kv_pool_from_tensors(KV_POOL, buffers, runner.config.num_kv_heads)


def make_transfer_manager(cfg: WorkerConfig) -> TransferManager:
    """The transfer manager of a prefill or decode worker (started by its role); a simulated
    worker's (`--simulate`) moves no bytes: its reads take the time the profile's link gives."""
    if cfg.simulate is not None:
        return create_manager(_transfer_config(cfg, "sim", _sim_link(cfg)))
    return create_manager(_transfer_config(cfg, "nixl", {}))


def _sim_link(cfg: WorkerConfig) -> dict[str, Any]:
    assert cfg.simulate is not None
    link = parse_profile(cfg.simulate).link
    return {
        # No link in the profile: reads take no time.
        "sim_bandwidth": link.bandwidth if link is not None else float("inf"),
        "sim_latency_s": link.latency_s if link is not None else 0.0,
        "time_scale": cfg.time_scale,
    }


def _transfer_config(cfg: WorkerConfig, backend: str, extra: dict[str, Any]) -> TransferConfig:
    return TransferConfig(
        backend=backend,
        serve=cfg.role == "prefill",
        bootstrap_host=cfg.host,
        bootstrap_port=cfg.bootstrap_port,
        advertise_host=cfg.kv_advertise_host,
        cluster_token=cfg.cluster_token,
        default_lease_ttl_s=cfg.lease_ttl_s,
        transfer_timeout_s=cfg.kv_transfer_timeout_s,
        # The reading side (D) progresses UCX from its poller; P's reads need the thread.
        nixl_progress_thread=cfg.role == "prefill",
        **extra,
    )


class TransferRole:
    """What the prefill and decode sides share: one transfer manager serving the KV pool,
    started and closed with the HTTP app."""

    def __init__(self, manager: TransferManager, runner: KVRunner) -> None:
        self.manager = manager
        self.contract = KVContract.of(runner)
        self.runtime = runtime_format(runner)
        self.report = runtime_report(runner)
        self.pool = kv_pool_of(runner)
        # NOTE: the runner owns the memory the pool describes: it must outlive the registration.
        self._memory = runner
        # Bytes of one page over every TP rank (what a pull of one page moves).
        self.page_bytes = self.pool.slot_bytes * self.pool.tp_size

    @property
    def bootstrap_port(self) -> int:
        return self.manager.bootstrap_port

    async def start(self) -> None:
        # P sends both in its Welcome; D refuses a P whose contract or runtime format is not its
        # own, and logs the report.
        self.manager.set_contract(handshake_contract(self.contract, self.runtime), self.report)
        await self.manager.start()
        self.manager.register_pool(self.pool)

    async def stop(self) -> None:
        await self.manager.close()  # aborts what is left: pinned and reserved pages are released
