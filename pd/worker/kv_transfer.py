"""Joins a worker to `pd.transfer`: one transfer manager, the KV pool it serves, and what both
sides of a pair must agree on before any byte moves."""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass

from pd.config import WorkerConfig
from pd.transfer import TransferConfig, TransferManager, create_manager, kv_pool_from_tensors
from pd.worker.model_runner import ModelRunner

KV_POOL = "kv"
# Page-major buffer [pages, layers, K/V, kv heads, page size, head dim]: see pd/kvcache/kv_pool.py.
KV_LAYOUT = "page-major-HND"


@dataclass(frozen=True)
class KVContract:
    """What P and D must share for D to decode from P's pages (checked on D, from the params)."""

    model_fingerprint: str  # the model's shape (not its name: a served name may differ)
    page_size: int
    kv_layout: str
    dtype: str

    @classmethod
    def of(cls, runner: ModelRunner) -> KVContract:
        shape = asdict(runner.config)
        shape.pop("name")
        digest = hashlib.sha256(repr(sorted(shape.items())).encode()).hexdigest()[:16]
        return cls(digest, runner.page_size, KV_LAYOUT, str(runner.dtype).removeprefix("torch."))


async def start_transfer(cfg: WorkerConfig, runner: ModelRunner) -> TransferManager:
    """Start the manager of a prefill or decode worker and register its KV pool."""
    manager = create_manager(
        TransferConfig(
            backend="nixl",
            serve=cfg.role == "prefill",
            bootstrap_host=cfg.host,
            bootstrap_port=cfg.bootstrap_port,
            cluster_token=cfg.cluster_token,
            default_lease_ttl_s=cfg.lease_ttl_s,
            transfer_timeout_s=cfg.kv_transfer_timeout_s,
            # The reading side (D) progresses UCX from its poller; P's reads need the thread.
            nixl_progress_thread=cfg.role == "prefill",
        )
    )
    await manager.start()
    buffers = [pool.buffer for pool in runner.kv_pools]
    manager.register_pool(kv_pool_from_tensors(KV_POOL, buffers, runner.config.num_kv_heads))
    return manager
