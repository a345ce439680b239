"""Assembles a worker from its config: checkpoint, model runner, scheduler, engine, metrics, and
the role: its entry point for the HTTP handler (`Role.admit`) and, on a prefill or decode worker,
its PD side with its transfer manager. The HTTP app only starts and stops what is built here."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from pd.config import WorkerConfig
from pd.kvcache.cache_manager import KVCacheManager
from pd.signing import Guard, optional_token
from pd.sim.profile import parse_profile
from pd.tracing import NO_TRACING, Tracing, setup_tracing
from pd.worker.checkpoint import (
    LoadedCheckpoint,
    default_model_path,
    load_checkpoint,
    load_tokenizer,
)
from pd.worker.disagg import (
    CoLocated,
    Decode,
    DecodeSide,
    KVContract,
    Prefill,
    PrefillSide,
    Role,
    TransferRole,
)
from pd.worker.disagg.contract import KVRunner, make_transfer_manager, runtime_format
from pd.worker.disagg.prefiller import PrefillPeers
from pd.worker.engine import Delta, Engine, KVConnector, RequestHandle, Scheduler
from pd.worker.engine.engine import StepExecutor
from pd.worker.metrics import WorkerMetrics
from pd.worker.model import (
    Accelerator,
    ModelRunner,
    RunnerConfig,
    one_row,
    resolve_device,
    resolve_dtype,
    size_kv_pages,
)
from pd.worker.model.config import ModelConfig
from pd.worker.model.quant import holds_int4
from pd.worker.model.smooth_quant import ActivationMaxima, holds_smooth
from pd.worker.model.torch_thread import DEFAULT_THREADS, TorchThread
from pd.worker.model.tuning.answer_judge import prompt_ids
from pd.worker.model.tuning.calibration import activation_maxima
from pd.worker.model.tuning.deterministic import check_row_invariant
from pd.worker.model.tuning.kernel_choice import Choice, resolve_kernels
from pd.worker.model.tuning.search_input import SearchInput
from pd.worker.simulated.runner import SimulatedRunner
from pd.worker.text import Tokenizer
from pd.worker.text.stack_threads import GRAMMAR_STACK_BYTES

log = logging.getLogger(__name__)

MAX_DEFAULT_CONTEXT = 8192
# A simulated worker's context when --max-model-len is 0: the presets' models take 128k, but a
# request without max_tokens runs to the context's end, and the body limit grows with it; 32k
# holds the long prompts of the serving workloads and traces.
SIMULATED_CONTEXT = 32768


@dataclass
class Worker:
    config: WorkerConfig
    tokenizer: Tokenizer
    engine: Engine
    metrics: WorkerMetrics
    model_name: str  # the served name
    role: Role = field(kw_only=True)  # what the HTTP handler hands each request to
    prefill: PrefillSide | None = None  # role prefill
    decode: DecodeSide | None = None  # role decode
    draining: bool = False
    accepted_names: frozenset[str] = field(default_factory=frozenset)
    # A new one each start: the router forgets what it thought this worker had cached when it
    # sees another.
    instance_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    attention_backend: str = ""  # the runner's (FlashInferAttentionBackend, TorchAttentionBackend)
    vocab_size: int = 0  # the model's logits rows (0: the tokenizer's): what token masks cover
    # The choices of each stream opened with X-PD-Token-Ids: a drain migrates them.
    migratable: set[tuple[RequestHandle, ...]] = field(default_factory=set)
    # --simulate: the `simulate` object of /health (profile, time scale, the clock's figures).
    simulation: Callable[[], dict[str, Any]] | None = None
    startup_s: float = 0.0  # --simulate --startup-s: real seconds from serving to ready
    tracing: Tracing = NO_TRACING  # --otlp-endpoint: spans of each request (api/spans.py)
    on_activate: Callable[[], None] | None = None  # --park: what POST /activate starts (main.py)
    quantization: str = "none"  # the linear layers' format, --quantization auto resolved
    # How it computes (contract.runtime_format): a P and a D pair only when theirs are equal
    runtime_format: dict[str, str] = field(default_factory=dict)
    # What --dtype/--quantization auto chose and the figures that chose it (/health `kernels`)
    kernels: dict[str, Any] = field(default_factory=dict)
    # The background compile of the one-row decode step: its state (None: not run)
    one_row_compile: Callable[[], dict[str, Any]] | None = None
    # What checks the signed internal fields (kv_transfer_params, pd_continuation) it is sent
    guard: Guard = field(default_factory=lambda: Guard(None))

    @property
    def transfer(self) -> TransferRole | None:
        """The PD role's side, started and stopped with the HTTP app (None for role both)."""
        return self.prefill or self.decode

    @property
    def bootstrap_port(self) -> int | None:
        return self.transfer.bootstrap_port if self.transfer is not None else None

    def check_integrity(self) -> None:
        self.engine.scheduler.check_integrity()

    def begin_drain(self) -> int:
        """Refuse new requests (503, not ready) and migrate the router's streams (each ends with
        `: pd-migrate`; the router continues it elsewhere); the others finish. Returns how many
        streams migrate."""
        self.draining = True
        return self.migrate_streams()

    async def drained(self, timeout_s: float) -> bool:
        """Wait until nothing is in flight (P's pinned pages pulled or released too): True, or
        False after `timeout_s`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.engine.handles or not self.engine.idle:
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    def migrate_streams(self) -> int:
        """Drain by migration (docs/migration.md §2): abort the requests of every stream opened
        with X-PD-Token-Ids (their pages freed, a decode request's pull too) and have each end
        with `: pd-migrate` after the events already queued. Returns how many streams."""
        streams = list(self.migratable)
        for choices in streams:
            for handle in choices:
                self.engine.abort(handle, "the worker drains: the router migrates the request")
                handle.queue.put_nowait(Delta("", [], [], migrate=True))
        return len(streams)


class _Runner(StepExecutor, KVRunner, Protocol):
    """What a worker reads of its runner: ModelRunner, or pd.sim's SimulatedRunner."""

    attention_backend: str


@dataclass
class _Model:
    """What the rest of a worker is built around: a runner and its tokenizer, sized."""

    runner: _Runner
    tokenizer: Tokenizer
    name: str  # the model's own name (served unless --served-model-name)
    num_pages: int
    max_model_len: int
    tp: int
    executor: Executor | None  # the thread steps run on (None: the engine's own)
    summary: str  # how it runs, for the start-up log
    simulated: SimulatedRunner | None = None  # the runner again, when it is pd.sim's
    quantization: str = "none"
    kernels: dict[str, Any] = field(default_factory=dict)
    one_row_compile: Callable[[], dict[str, Any]] | None = None  # its state, for /health


def build_worker(cfg: WorkerConfig, ckpt: LoadedCheckpoint | None = None) -> Worker:
    """Build a worker; `ckpt` lets tests share one loaded checkpoint between workers. With
    `--simulate` there is no checkpoint: pd.sim's runner on the profile (docs/simulation.md)."""
    model = _simulated_model(cfg) if cfg.simulate is not None else _loaded_model(cfg, ckpt)
    runner, num_pages, max_model_len, tp = (
        model.runner,
        model.num_pages,
        model.max_model_len,
        model.tp,
    )
    c = KVContract.of(runner)  # what shapes the KV: pages of other models never match
    salt = f"{c.model_fingerprint}:{c.dtype}:{c.kv_layout}:tp{tp}"
    cache = KVCacheManager(num_pages, cfg.page_size, prefix_cache=cfg.prefix_cache, salt=salt)
    scheduler = Scheduler(
        cache,
        cfg.chunk_size,
        cfg.max_running_requests,
        cfg.resolved_pull_slots,
        aging_s=cfg.priority_aging_s,
    )
    prefill = decode = None
    connector = KVConnector(CoLocated.name)
    if cfg.role == "prefill":
        connector = prefill = PrefillSide(
            make_transfer_manager(cfg), runner, scheduler, tp, optional_token(cfg.cluster_token)
        )
    metrics = WorkerMetrics()
    engine = Engine(
        runner,
        scheduler,
        model.tokenizer,
        max_model_len=max_model_len,
        max_waiting=cfg.max_waiting_requests,
        connector=connector,
        metrics=metrics,
        executor=model.executor,
        overlap=cfg.overlap,
    )
    metrics.read_load_from(engine.load)
    bg = getattr(runner, "background_compile", None)
    if bg is not None:  # its final compile waits for an idle moment of this engine
        bg.idle = lambda: engine.idle and not engine.handles
    metrics.read_cache_stats_from(lambda: (cache.query_tokens, cache.hit_tokens))
    simulation = None
    startup_s = 0.0
    if model.simulated is not None:
        simulation = model.simulated.describe
        metrics.read_simulation_from(model.simulated.stats)
        modeled = model.simulated.profile.startup_s if cfg.startup_s == -1 else cfg.startup_s
        startup_s = modeled * cfg.time_scale
    role: Role = CoLocated(engine)
    if prefill is not None:
        role = Prefill(engine, prefill)
    elif cfg.role == "decode":
        decode = DecodeSide(
            make_transfer_manager(cfg),
            runner,
            engine,
            cfg.kv_quarantine_s,
            cfg.page_wait_timeout_s,
        )
        peers = PrefillPeers.from_flags(
            cfg.prefill_peer,
            cfg.prefill_peer_selector,
            cfg.k8s_api,
            cfg.k8s_namespace,
            cfg.k8s_port_name,
        )
        role = Decode(decode, optional_token(cfg.cluster_token), peers)
        metrics.read_peers_lost_from(lambda: decode.manager.peers_lost)
    name = cfg.served_model_name or model.name
    metrics.serve_model_server_names(name)
    log.info(
        "model %s: %s, %d KV pages of %d tokens, context %d",
        name,
        model.summary,
        num_pages,
        cfg.page_size,
        max_model_len,
    )
    return Worker(
        cfg,
        model.tokenizer,
        engine,
        metrics,
        name,
        role=role,
        prefill=prefill,
        decode=decode,
        accepted_names=frozenset({name, "default"}),
        attention_backend=runner.attention_backend,
        vocab_size=runner.config.vocab_size,
        simulation=simulation,
        startup_s=startup_s,
        quantization=model.quantization,
        runtime_format=runtime_format(runner),
        kernels=model.kernels,
        one_row_compile=model.one_row_compile,
        guard=Guard(optional_token(cfg.cluster_token)),
        tracing=setup_tracing("pd-worker", cfg.role, cfg.otlp_endpoint, cfg.otlp_sample_ratio),
    )


def _loaded_model(cfg: WorkerConfig, ckpt: LoadedCheckpoint | None) -> _Model:
    device = resolve_device(cfg.device)
    # Every torch op of this worker runs on one thread, loading included (see torch_thread.py).
    threads = cfg.threads or DEFAULT_THREADS
    torch_thread = TorchThread(threads, GRAMMAR_STACK_BYTES)  # it fills grammar masks
    if ckpt is None:
        # int4 in groups of 32 packs a GGUF's Q4_1 blocks as they are (no float round trip);
        # auto may choose int4 (alone or in a split), and the dense formats dequantize them.
        keep = (cfg.quantization == "auto" or holds_int4(cfg.quantization)) and cfg.group_size == 32
        path = cfg.model or default_model_path()
        ckpt = torch_thread.run(load_checkpoint, path, torch.float32, keep_q4_1=keep)
    mcfg = ckpt.config
    choice = _choose_kernels(cfg, device, threads, ckpt, torch_thread)
    dtype = resolve_dtype(choice.dtype, device)
    rc = _runner_config(cfg, ckpt, choice, device)
    max_model_len, num_pages = rc.max_model_len, rc.num_pages
    maxima = _calibration(choice.quantization, device, ckpt, torch_thread)
    runner = torch_thread.run(ModelRunner, mcfg, ckpt.weights, rc, maxima)
    # Compiles while the worker serves (one_row.py): started now, installed between steps.
    runner.start_background_compile(torch_thread.executor)
    bg = runner.background_compile
    summary = (
        f"{mcfg.num_layers} layers, tp={cfg.tp}, {str(dtype).removeprefix('torch.')} on {device}, "
        f"linear layers {choice.quantization}, LM head {runner.lm_head_quantization}"
    )
    return _Model(
        runner,
        ckpt.tokenizer,
        mcfg.name,
        num_pages,
        max_model_len,
        cfg.tp,
        torch_thread.executor,
        summary,
        quantization=choice.quantization,
        kernels=_kernels_health(choice, runner.lm_head_quantization),
        one_row_compile=bg.as_dict if bg is not None else None,
    )


def _choose_kernels(
    cfg: WorkerConfig,
    device: str,
    threads: int,
    ckpt: LoadedCheckpoint,
    torch_thread: TorchThread,
) -> Choice:
    """The dtype and formats the flags ask for, `auto` resolved (tuning/kernel_choice.py)."""
    tok = ckpt.tokenizer
    inp = SearchInput(
        dtype=cfg.dtype,
        quantization=cfg.quantization,
        lm_head_quantization=cfg.lm_head_quantization,
        device=device,
        chunk_size=cfg.chunk_size,
        max_running=cfg.max_running_requests,
        threads=threads,
        tp=cfg.tp,
        group_size=cfg.group_size,
        digest=ckpt.digest,
        compile=cfg.compile,
    )
    choice = torch_thread.run(
        resolve_kernels,
        inp,
        config=ckpt.config,
        weights=ckpt.weights,
        encode=tok.encode,
        judge_prompts=lambda: prompt_ids(tok.encode, tok.apply_chat_template),
    )
    log.info("%s", choice.summary())
    if cfg.deterministic:
        _check_deterministic(cfg, device, choice, ckpt.config, torch_thread)
    return choice


def _runner_config(
    cfg: WorkerConfig, ckpt: LoadedCheckpoint, choice: Choice, device: str
) -> RunnerConfig:
    """The runner's config: the flags, the kernel choice and the KV pages that fit."""
    mcfg = ckpt.config
    dtype = resolve_dtype(choice.dtype, device)
    one_row_why = None
    if not cfg.compile:  # --compile compiles every decode step at start-up
        one_row_why = one_row.wanted(
            cfg.background_compile, device=device, quantization=choice.quantization
        )
    return RunnerConfig(
        tp=cfg.tp,
        dtype=dtype,
        device=device,
        num_pages=size_kv_pages(
            mcfg, cfg.tp, cfg.page_size, dtype, device, cfg.kv_pages, cfg.kv_memory_fraction
        ),
        page_size=cfg.page_size,
        max_model_len=cfg.max_model_len or min(mcfg.max_position_embeddings, MAX_DEFAULT_CONTEXT),
        seed=cfg.seed,
        quantization=choice.quantization,
        lm_head_quantization=choice.head,
        group_size=cfg.group_size,
        attention_backend=cfg.attention_backend,
        deterministic=cfg.deterministic,
        checkpoint_digest=ckpt.digest,
        accelerator=_accelerator(cfg, one_row_why),
    )


def _check_deterministic(
    cfg: WorkerConfig, device: str, choice: Choice, mcfg: ModelConfig, torch_thread: TorchThread
) -> None:
    """--deterministic starts only where its formats compute a row the same in any batch."""
    if device != "cpu":
        raise ValueError(
            f"--deterministic runs on CPU (its row-invariance is measured on torch's CPU "
            f"kernels), not {device}"
        )
    took = torch_thread.run(
        check_row_invariant,
        dtype=choice.dtype,
        quantization=choice.quantization,
        lm_head_quantization=choice.head,
        config=mcfg,
        tp=cfg.tp,
        group_size=cfg.group_size,
        chunk_size=cfg.chunk_size,
        max_running=cfg.max_running_requests,
    )
    log.info("--deterministic: the formats compute every row the same in any batch (%.1f s)", took)


def _accelerator(cfg: WorkerConfig, one_row_why: str | None) -> Accelerator:
    """The runner's one decode accelerator, as the flags ask. (--compile needs the torch
    attention backend and CUDA graphs FlashInfer's: the two never ran together.)"""
    if cfg.compile and cfg.cuda_graph_max_batch:
        raise ValueError(
            "--compile and --cuda-graph-max-batch are two decode accelerators: give one"
        )
    if cfg.compile:
        return Accelerator("compile")
    if cfg.cuda_graph_max_batch:
        # No batch grows past --max-running-requests: larger buckets would never replay.
        return Accelerator(
            "cuda-graphs", max_batch=min(cfg.cuda_graph_max_batch, cfg.max_running_requests)
        )
    return Accelerator("one-row", why=one_row_why) if one_row_why else Accelerator()


def _calibration(
    quantization: str, device: str, ckpt: LoadedCheckpoint, torch_thread: TorchThread
) -> ActivationMaxima | None:
    """smooth-int8's activation maxima (smooth_quant.py), for a quantization that holds it."""
    if not holds_smooth(quantization) or device != "cpu":
        return None  # off the CPU, the runner refuses the format, and says why
    t = time.perf_counter()
    maxima = torch_thread.run(activation_maxima, ckpt.config, ckpt.weights, ckpt.tokenizer.encode)
    log.info("smooth-int8 calibration: %.1f s", time.perf_counter() - t)
    return maxima


def _kernels_health(choice: Choice, head_runs: str) -> dict:
    """/health's `kernels`: the choice and its figures, with the LM head's format as it runs
    (`lm_head.runs`: the rule's when the choice says auto)."""
    kernels = choice.as_dict()
    kernels["lm_head"]["runs"] = head_runs
    return kernels


def _simulated_model(cfg: WorkerConfig) -> _Model:
    """A simulated device: no weights, no KV tensors; only a tokenizer (the default model's, or
    --model's) for the text. KV pages from the profile's memory unless --kv-pages gives them."""
    assert cfg.simulate is not None
    profile = parse_profile(cfg.simulate)  # a bad profile: ValueError, said at start
    if cfg.tp not in (1, profile.tp):
        raise ValueError(
            f"--tp {cfg.tp} with --simulate: the profile sets TP ({profile.name}: tp{profile.tp})"
        )
    tokenizer = load_tokenizer(cfg.model or default_model_path())
    num_pages = cfg.kv_pages or profile.kv_pages(cfg.page_size)
    max_model_len = cfg.max_model_len or SIMULATED_CONTEXT
    runner = SimulatedRunner(
        profile,
        tokenizer,
        page_size=cfg.page_size,
        num_pages=num_pages,
        max_model_len=max_model_len,
        time_scale=cfg.time_scale,
    )
    summary = (
        f"SIMULATED {profile.name} (time scale {cfg.time_scale:g}; no weights, no KV bytes; "
        f"{profile.model.num_layers} layers, text from a {tokenizer.vocab_size}-token tokenizer)"
    )
    name = profile.model.name
    return _Model(
        runner, tokenizer, name, num_pages, max_model_len, profile.tp, None, summary, runner
    )
