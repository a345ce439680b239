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
from pd.worker.model.assemble import build_model
from pd.worker.model.attention.flashinfer_backend import FlashInferAttentionBackend
from pd.worker.model.compiled_decode import check_compilable, compile_decode
from pd.worker.model.config import ModelConfig
from pd.worker.model.decode_graphs import DecodeGraphs
from pd.worker.model.one_row import BackgroundCompile
from pd.worker.model.prompt_logprobs import prompt_logprobs
from pd.worker.model.quant import (
    Weight,
)
from pd.worker.model.runner_config import RunnerConfig
from pd.worker.model.sampler import SampleOutput, Sampler
from pd.worker.model.smooth_quant import ActivationMaxima

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


class ModelRunner:
    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, Weight],
        rc: RunnerConfig,
        act_maxima: ActivationMaxima | None = None,  # smooth-int8's calibration (smooth_quant.py)
    ) -> None:
        rc = rc.checked(config, act_maxima)
        self.rc = rc
        self.config = config
        self.quantization, self.lm_head_quantization = rc.quantization, rc.lm_head_quantization
        self.checkpoint_digest = rc.checkpoint_digest  # LoadedCheckpoint.digest: see KVContract
        self.dtype, self.page_size, self.max_model_len = rc.dtype, rc.page_size, rc.max_model_len
        self.num_pages = rc.num_pages
        self.device = rc.devices()[0]
        self.model = build_model(config, weights, rc, act_maxima)
        self.sampler = Sampler(rc.seed)
        self.attention_backend = type(self.model.ranks[0].attn).__name__  # reported in /health
        if rc.deterministic:  # a P and a D pair only when theirs are equal (contract.runtime_format)
            self.attention_backend += "/uniform"
        # The one decode accelerator: compiled steps live in the model (model.compiled_decode),
        # a background compile or CUDA graphs here.
        self.compiled = rc.accelerator.kind == "compile"
        self.accelerated: BackgroundCompile | DecodeGraphs | None = self._accelerate()

    def _accelerate(self) -> BackgroundCompile | DecodeGraphs | None:
        accel, rc = self.rc.accelerator, self.rc
        if accel.kind == "compile":
            compile_decode(self.model, rc.page_size, rc.num_pages)
        elif accel.kind == "one-row":  # started by `start_background_compile`, once built
            check_compilable(self.model)
            scratch = rc.scratch_pages()
            return BackgroundCompile(
                self.model, rc.page_size, scratch, torch.get_num_threads(), accel.why
            )
        elif accel.kind == "cuda-graphs":
            if not isinstance(self.model.ranks[0].attn, FlashInferAttentionBackend):
                raise ValueError(
                    "--cuda-graph-max-batch needs the FlashInfer attention backend (bf16 or fp16, "
                    "flashinfer installed): the torch backend would pad every row of a graph to "
                    "the whole context"
                )
            return DecodeGraphs(
                self.model, accel.max_batch, rc.max_model_len, scratch_page=rc.num_pages
            )
        return None

    @property
    def background_compile(self) -> BackgroundCompile | None:
        return self.accelerated if isinstance(self.accelerated, BackgroundCompile) else None

    @property
    def graphs(self) -> DecodeGraphs | None:
        return self.accelerated if isinstance(self.accelerated, DecodeGraphs) else None

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
