"""Turns one step's batch (a `StepBatch`) into sampled tokens: the only part of the worker that
touches tensors.

It builds the model's TP ranks (weight shards, one KV pool and one attention backend per rank),
prepares each step's inputs and paged metadata, runs the forward pass and samples.
`execute` is called from the engine's executor thread, never from the event loop.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from typing import Protocol

import numpy as np
import torch

from pd.kvcache.kv_pool import KVPool
from pd.kvcache.paged_metadata import SeqSpec, build_paged_metadata
from pd.protocol import GenerationOptions
from pd.worker.model.attention import select_attention_backend
from pd.worker.model.attention.flashinfer_backend import FlashInferAttentionBackend
from pd.worker.model.communicator import make_communicator
from pd.worker.model.compiled_decode import check_compilable, compile_decode
from pd.worker.model.config import ModelConfig
from pd.worker.model.decode_graphs import DecodeGraphs
from pd.worker.model.llama import LlamaModel, RankState, Rotary, check_tp, shard_layer
from pd.worker.model.one_row import SCRATCH_PAGES, BackgroundCompile
from pd.worker.model.prompt_logprobs import prompt_logprobs
from pd.worker.model.quant import (
    GroupQuant,
    Weight,
    check_group_size,
    check_quantization,
    head_quantization,
    holds_int4,
    make_linear,
)
from pd.worker.model.sampler import SampleOutput, Sampler
from pd.worker.model.smooth_quant import ActivationMaxima, holds_smooth

log = logging.getLogger(__name__)


class StepRequest(Protocol):
    """What the runner reads of one request in a step (the engine's `Sequence` is one)."""

    @property
    def prompt_ids(self) -> list[int]: ...
    @property
    def output_ids(self) -> list[int]: ...
    @property
    def page_ids(self) -> list[int]: ...
    @property
    def params(self) -> GenerationOptions: ...
    @property
    def rules(self) -> TokenMask | None: ...  # what its next token may be (None: anything)
    def token_slice(self, start: int, end: int) -> list[int]: ...


class TokenMask(Protocol):
    """A request's allowed next tokens (the engine's `TokenRules`), written into a bitmask row."""

    def fill_mask(self, row: np.ndarray, output_ids: Sequence[int]) -> None: ...


class StepBatch(Protocol):
    """One step's work (the scheduler's `ScheduledBatch` is one): parallel columns per request."""

    @property
    def seqs(self) -> Sequence[StepRequest]: ...
    @property
    def num_cached(self) -> list[int]: ...  # tokens already in the request's pages
    @property
    def num_new(self) -> list[int]: ...  # tokens computed this step
    @property
    def sample(self) -> list[bool]: ...  # whether this step samples the request's next token
    @property
    def riders(self) -> Sequence[tuple[int, StepRequest]]: ...  # (sampled row, a fork child)


def lm_head_weight(
    config: ModelConfig, weights: Mapping[str, Weight], dtype: torch.dtype
) -> torch.Tensor:
    """The LM head's weights [V, hidden] as the runner builds its head from them: dense, in the
    compute dtype (the embedding's when tied)."""
    w = weights["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]
    return (w.dequantize() if isinstance(w, GroupQuant) else w).to(dtype)


class ModelRunner:
    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, Weight],
        *,
        tp: int,
        dtype: torch.dtype,
        device: str,
        num_pages: int,
        page_size: int,
        max_model_len: int,
        seed: int = 0,
        quantization: str = "none",
        group_size: int = 32,
        attention_backend: str = "auto",
        compile: bool = False,
        cuda_graph_max_batch: int = 0,
        checkpoint_digest: str = "",
        one_row_compile: str | None = None,  # why a background compile (one_row.py), or None
        lm_head_quantization: str = "auto",  # auto: the layers' rule (quant.head_quantization)
        act_maxima: ActivationMaxima | None = None,  # smooth-int8's calibration (smooth_quant.py)
        deterministic: bool = False,  # every row's attention as a decode row's (--deterministic)
    ) -> None:
        check_tp(config, tp)
        check_quantization(quantization)
        if lm_head_quantization == "auto":
            lm_head_quantization = head_quantization(quantization, dtype)
        check_quantization(lm_head_quantization)
        if holds_int4(quantization) or holds_int4(lm_head_quantization):
            check_group_size(config, tp, group_size)
        if holds_smooth(quantization) and act_maxima is None and device == "cpu":
            raise ValueError(
                f"--quantization {quantization} needs the calibration's activation maxima "
                "(tuning/calibration.py's activation_maxima)"
            )
        if compile and quantization not in ("none", "int8", "int4"):
            raise ValueError(
                f"--compile runs --quantization none, int8 or int4, not {quantization}: "
                "torch.compile has not been tried on the oneDNN/FBGEMM kernels"
            )
        self.quantization = quantization
        self.lm_head_quantization = lm_head_quantization
        self.checkpoint_digest = checkpoint_digest  # LoadedCheckpoint.digest: see KVContract
        if device == "cuda" and torch.cuda.device_count() < tp:
            raise ValueError(
                f"--tp {tp} needs {tp} CUDA devices, found {torch.cuda.device_count()}"
            )
        self.config = config
        self.dtype = dtype
        self.page_size = page_size
        self.max_model_len = max_model_len
        devices = [
            torch.device("cuda", r) if device == "cuda" else torch.device("cpu") for r in range(tp)
        ]
        self.device = devices[0]
        if cuda_graph_max_batch and (device != "cuda" or tp != 1):
            raise ValueError("--cuda-graph-max-batch needs --device cuda and --tp 1")
        # A CUDA-graph step pads its batch with sequences on a page of their own, one past the
        # pages the allocator hands out (`num_pages`).
        # A background compile warms up on pages of its own, past those too.
        pool_pages = num_pages + (1 if cuda_graph_max_batch else 0)
        scratch = range(pool_pages, pool_pages + (SCRATCH_PAGES if one_row_compile else 0))
        pool_pages = scratch.stop
        ranks = []
        for r, dev in enumerate(devices):
            layers = []
            for i in range(config.num_layers):
                act_max = None if act_maxima is None else act_maxima.at(i)
                args = (dtype, dev, quantization, group_size, act_max)
                layers.append(shard_layer(weights, config, i, r, tp, *args))
            ranks.append(
                RankState(
                    device=dev,
                    layers=layers,
                    kv=KVPool(
                        pool_pages,
                        config.num_layers,
                        config.num_kv_heads // tp,
                        page_size,
                        config.head_dim,
                        dtype,
                        dev,
                    ),
                    attn=select_attention_backend(dev, dtype, attention_backend, deterministic),
                    rotary=Rotary(config, max_model_len, dev),
                    num_heads=config.num_heads // tp,
                    num_kv_heads=config.num_kv_heads // tp,
                )
            )

        def dense(name: str) -> torch.Tensor:
            w = weights[name]
            w = w.dequantize() if isinstance(w, GroupQuant) else w
            return w.to(device=self.device, dtype=dtype)

        embed = dense("model.embed_tokens.weight")
        head = embed if config.tie_word_embeddings else lm_head_weight(config, weights, dtype)
        # The LM head is the largest matrix a step reads: by default in the layers' kernel (int8
        # under int4 layers), or its own (--lm-head-quantization, measured by auto); the
        # embedding's lookup reads a row per token: it stays dense.
        lm_head = make_linear(head, None, lm_head_quantization, group_size, dtype, self.device)
        norms = [
            (
                dense(f"model.layers.{i}.input_layernorm.weight"),
                dense(f"model.layers.{i}.post_attention_layernorm.weight"),
            )
            for i in range(config.num_layers)
        ]
        final_norm = dense("model.norm.weight")
        self.model = LlamaModel(
            config, ranks, embed, norms, final_norm, lm_head, make_communicator(devices)
        )
        self.sampler = Sampler(seed)
        self.num_pages = num_pages
        self.attention_backend = type(ranks[0].attn).__name__  # reported in /health
        if deterministic:  # a P and a D pair only when theirs are equal (contract.runtime_format)
            self.attention_backend += "/uniform"
        self.compiled = compile
        if compile:
            compile_decode(self.model, page_size, num_pages)
        # Started by `start_background_compile`, once the worker is built.
        self.background_compile: BackgroundCompile | None = None
        if one_row_compile:
            check_compilable(self.model)
            self.background_compile = BackgroundCompile(
                self.model, page_size, scratch, torch.get_num_threads(), one_row_compile
            )
        self.graphs: DecodeGraphs | None = None
        if cuda_graph_max_batch:
            if not isinstance(ranks[0].attn, FlashInferAttentionBackend):
                raise ValueError(
                    "--cuda-graph-max-batch needs the FlashInfer attention backend (bf16 or fp16, "
                    "flashinfer installed): the torch backend would pad every row of a graph to "
                    "the whole context"
                )
            self.graphs = DecodeGraphs(
                self.model, cuda_graph_max_batch, max_model_len, scratch_page=num_pages
            )

    def start_background_compile(self, executor: Executor) -> None:
        """Start the one-row compile, if any; `executor`: the thread steps run on."""
        if self.background_compile is not None:
            self.background_compile.start(executor)

    @property
    def kv_pools(self) -> list[KVPool]:
        return [r.kv for r in self.model.ranks]

    def _fits_graph(self, batch: StepBatch) -> bool:
        """A pure decode step, every sequence sampled, within the largest graph."""
        assert self.graphs is not None
        return (
            all(n == 1 for n in batch.num_new)
            and all(batch.sample)
            and self.graphs.bucket(len(batch.seqs)) is not None
        )

    def execute(self, batch: StepBatch) -> SampleOutput:
        """Run one step; returns a token for every seq with `sample` set, in batch order."""
        input_ids: list[int] = []
        logits_rows: list[int] = []
        # Requests that want their prompt's logprobs: (index, first position, first row, rows)
        # for the positions of this chunk that predict a prompt token.
        prompt_rows: list[tuple[int, int, int, int]] = []
        for i, (seq, cached, n, sample) in enumerate(
            zip(batch.seqs, batch.num_cached, batch.num_new, batch.sample)
        ):
            if seq.params.prompt_logprobs is not None:
                end = min(cached + n, len(seq.prompt_ids) - 1)
                if end > cached:
                    prompt_rows.append((i, cached, len(input_ids), end - cached))
            input_ids.extend(seq.token_slice(cached, cached + n))
            if sample:
                logits_rows.append(len(input_ids) - 1)
        num_sampled = len(logits_rows)
        for _, _, row, count in prompt_rows:  # after the sampled rows: logits[:num_sampled]
            logits_rows.extend(range(row, row + count))
        specs: list[SeqSpec] = [
            (s.page_ids, c, n) for s, c, n in zip(batch.seqs, batch.num_cached, batch.num_new)
        ]
        graphs = self.graphs
        if graphs is not None and not prompt_rows and self._fits_graph(batch):
            specs, input_ids = graphs.padded(specs, input_ids)
            meta = build_paged_metadata(specs, self.page_size, self.device)
            ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
            logits = graphs.run(ids, meta)[: len(batch.seqs)]  # [S, V]
        else:
            meta = build_paged_metadata(specs, self.page_size, self.device)
            ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
            rows = torch.tensor(logits_rows, dtype=torch.long, device=self.device)
            logits = self.model.forward(ids, meta, rows, eager=bool(prompt_rows))  # [S, V]
        sampled = [s for s, flag in zip(batch.seqs, batch.sample) if flag]
        prompt = self._prompt_logprobs(batch, prompt_rows, logits[num_sampled:])
        logits = logits[:num_sampled]
        if batch.riders:  # n > 1: each child samples its first token from its parent's row
            logits = torch.cat([logits, logits[[r for r, _ in batch.riders]]])
            sampled += [child for _, child in batch.riders]
        if not sampled:
            # NOTE: the engine takes our return as "the KV writes are done" and may free or hand
            # these pages to a pull; with no sample to wait for, wait for the device here.
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return SampleOutput(token_ids=[], prompt_logprobs=prompt)
        out = self.sampler.sample(
            logits,
            [s.params for s in sampled],
            [s.prompt_ids for s in sampled],
            [s.output_ids for s in sampled],
            self._masks(sampled),
        )
        out.prompt_logprobs = prompt
        return out

    @staticmethod
    def _prompt_logprobs(
        batch: StepBatch, prompt_rows: list[tuple[int, int, int, int]], logits: torch.Tensor
    ) -> list:
        """The prompt logprobs of the rows `execute` added past the sampled ones ([P, V])."""
        out = []
        at = 0
        for i, first, _, count in prompt_rows:
            seq = batch.seqs[i]
            k = seq.params.prompt_logprobs
            assert k is not None
            targets = seq.prompt_ids[first + 1 : first + 1 + count]  # the next prompt tokens
            out.append((i, first, prompt_logprobs(logits[at : at + count], targets, k)))
            at += count
        return out

    def _masks(self, sampled: list[StepRequest]) -> torch.Tensor | None:
        """The allowed-token bitmasks of the sampled rows, when any has rules (filled here, on
        the forward thread, while nothing else touches them: each request's previous token was
        accepted before this step was scheduled)."""
        if all(s.rules is None for s in sampled):
            return None
        words = (self.config.vocab_size + 31) // 32
        masks = np.full((len(sampled), words), -1, dtype=np.int32)  # all allowed
        for j, s in enumerate(sampled):
            if s.rules is not None:
                s.rules.fill_mask(masks[j], s.output_ids)
        return torch.from_numpy(masks)
