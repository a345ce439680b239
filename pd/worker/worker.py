"""Assembles a worker from its config: checkpoint, model runner, scheduler, engine, metrics."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from pd.config import WorkerConfig
from pd.kvcache.allocator import PageAllocator
from pd.worker.decode_side import DecodeSide
from pd.worker.default_model import default_model_path
from pd.worker.engine import Engine
from pd.worker.loader import LoadedCheckpoint, load_checkpoint
from pd.worker.metrics import WorkerMetrics
from pd.worker.model_runner import ModelRunner, resolve_device, resolve_dtype, size_kv_pages
from pd.worker.prefill_side import PrefillSide
from pd.worker.scheduler import Scheduler

log = logging.getLogger(__name__)

MAX_DEFAULT_CONTEXT = 8192


@dataclass
class Worker:
    config: WorkerConfig
    tokenizer: object
    engine: Engine
    metrics: WorkerMetrics
    model_name: str  # the served name
    draining: bool = False
    accepted_names: frozenset[str] = field(default_factory=frozenset)
    # Prefill and decode roles, set while the app runs (see server._transfer_ctx):
    prefill_side: PrefillSide | None = None
    decode_side: DecodeSide | None = None
    bootstrap_port: int | None = None

    def check_integrity(self) -> None:
        self.engine.scheduler.check_integrity()


def build_worker(cfg: WorkerConfig, ckpt: LoadedCheckpoint | None = None) -> Worker:
    """Build a worker; `ckpt` lets tests share one loaded checkpoint between workers."""
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if ckpt is None:
        ckpt = load_checkpoint(cfg.model or default_model_path(), dtype=torch.float32)
    mcfg = ckpt.config
    max_model_len = cfg.max_model_len or min(mcfg.max_position_embeddings, MAX_DEFAULT_CONTEXT)
    num_pages = size_kv_pages(
        mcfg, cfg.tp, cfg.page_size, dtype, device, cfg.kv_pages, cfg.kv_memory_fraction
    )
    runner = ModelRunner(
        mcfg,
        ckpt.weights,
        tp=cfg.tp,
        dtype=dtype,
        device=device,
        num_pages=num_pages,
        page_size=cfg.page_size,
        max_model_len=max_model_len,
        seed=cfg.seed,
    )
    scheduler = Scheduler(
        PageAllocator(num_pages), cfg.page_size, cfg.chunk_size, cfg.max_running_requests
    )
    engine = Engine(
        runner,
        scheduler,
        ckpt.tokenizer,
        role=cfg.role,
        max_model_len=max_model_len,
        max_waiting=cfg.max_waiting_requests,
    )
    metrics = WorkerMetrics(engine.load)
    engine.metrics = metrics
    name = cfg.served_model_name or mcfg.name
    log.info(
        "model %s: %d layers, tp=%d, %s on %s, %d KV pages of %d tokens, context %d",
        name,
        mcfg.num_layers,
        cfg.tp,
        str(dtype).removeprefix("torch."),
        device,
        num_pages,
        cfg.page_size,
        max_model_len,
    )
    return Worker(
        cfg, ckpt.tokenizer, engine, metrics, name, accepted_names=frozenset({name, "default"})
    )
