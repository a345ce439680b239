"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket (as nano-vllm does).

A pure decode step of n sequences runs as the graph of the smallest bucket b >= n (buckets 1,
2, 4, 8, then every 16 up to `--cuda-graph-max-batch`): the runner pads the step with b - n
sequences of one token on a scratch page (a page of the pool the allocator never hands out),
the step's inputs are copied into buffers that stay at the same addresses, the attention
backend plans into its own fixed buffers (`AttentionBackend.plan_graph`), and the graph
replays every layer and the LM head in one launch; the first n rows of its logits go to the
sampler. Prefill and mixed steps, and batches above the largest bucket, run eager.

What a graph runs is the eager code (`LlamaModel.layers`, after the step's rotary angles and
K/V rows are computed from the buffers), so a graph computes what eager computes for the
same padded batch. Rows of padded sequences attend to their own page only and write their K/V
to the scratch page.

`capture=False` runs the same buffers and plans without capturing (each "replay" calls the
step eagerly): how the padding, the buffers and the plans are tested on a machine without
CUDA. The capture itself is tested on CUDA (tests/worker/model/test_decode_graphs.py, run by
scripts/gpu_check.sh). One TP rank only: the ranks of a single controller run on several
devices, and a capture across devices is not built.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence

import torch

from pd.kvcache.paged_metadata import PagedMetadata, SeqSpec, build_paged_metadata
from pd.worker.model.attention.torch_backend import DecodeInputs
from pd.worker.model.llama import LlamaModel

log = logging.getLogger(__name__)


def graph_buckets(max_batch: int) -> list[int]:
    """The batch sizes that get a graph: 1, 2, 4, 8, then every 16, and max_batch itself."""
    if max_batch < 1:
        raise ValueError(f"--cuda-graph-max-batch must be >= 1, got {max_batch}")
    small = [b for b in (1, 2, 4, 8) if b < max_batch]
    return sorted({*small, *range(16, max_batch, 16), max_batch})


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaModel,
        max_batch: int,
        max_model_len: int,
        scratch_page: int,
        capture: bool | None = None,
    ) -> None:
        if model.tp != 1:
            raise ValueError("CUDA graphs run one TP rank only (--tp 1)")
        rank = model.ranks[0]
        if not 0 <= scratch_page < rank.kv.num_pages:
            raise ValueError(f"scratch page {scratch_page} is not a page of the pool")
        self.model = model
        self.buckets = graph_buckets(max_batch)
        self.page_size = rank.kv.page_size
        self.max_pages = -(-max_model_len // self.page_size)  # pages of the longest sequence
        self.pad_spec: SeqSpec = ([scratch_page], 0, 1)
        self.capture = rank.device.type == "cuda" if capture is None else capture
        if self.capture and rank.device.type != "cuda":
            raise ValueError("CUDA graphs need --device cuda")
        dev = rank.device
        # The step's inputs, at fixed addresses; a bucket b reads rows [:b].
        self._input_ids = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self._positions = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self._write_pages = torch.full((max_batch,), scratch_page, dtype=torch.long, device=dev)
        self._write_offsets = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self._logits_rows = torch.arange(max_batch, dtype=torch.long, device=dev)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Every bucket's logits land in rows [:b] of one buffer (one per bucket would keep
        # buckets x [b, V] fp32 alive in the graphs' pool).
        self._logits = torch.empty(max_batch, model.config.vocab_size, device=dev)
        self._decode: dict[int, DecodeInputs | None] = {}  # what the graph reads, per bucket
        self.capture_s = self._capture_all() if self.capture else 0.0

    def bucket(self, num_seqs: int) -> int | None:
        """The bucket of a decode step of `num_seqs` sequences; None above the largest."""
        i = bisect.bisect_left(self.buckets, num_seqs)
        return self.buckets[i] if i < len(self.buckets) else None

    def padded(
        self, specs: Sequence[SeqSpec], input_ids: list[int]
    ) -> tuple[list[SeqSpec], list[int]]:
        """A decode step's sequences and input ids, padded to their bucket."""
        b = self.bucket(len(specs))
        assert b is not None, f"{len(specs)} sequences are above the largest bucket"
        pad = b - len(specs)
        return [*specs, *[self.pad_spec] * pad], [*input_ids, *[0] * pad]

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, meta: PagedMetadata) -> torch.Tensor:
        """Logits [b, V] of a decode step padded to a bucket b (`padded`): the first rows are
        the real sequences'. The tensor is the graph's own: read it before the next step."""
        b = meta.batch_size
        assert b in self.buckets and meta.is_decode_only, (b, meta.is_decode_only)
        decode = self._prepare(input_ids, meta)
        if not self.capture:
            return self._step(b, decode)
        self._graphs[b].replay()
        return self._logits[:b]

    def _prepare(self, input_ids: torch.Tensor, meta: PagedMetadata) -> DecodeInputs | None:
        """Copy a step's inputs into the buffers and plan its attention."""
        b = meta.batch_size
        self._input_ids[:b].copy_(input_ids)
        self._positions[:b].copy_(meta.positions)
        self._write_pages[:b].copy_(meta.write_page_ids)
        self._write_offsets[:b].copy_(meta.write_offsets)
        rank, cfg = self.model.ranks[0], self.model.config
        rank.attn.plan(
            meta, rank.num_heads, rank.num_kv_heads, cfg.head_dim, self.page_size, rank.kv.dtype
        )
        decode = rank.attn.plan_graph(self.max_pages, self.model.sm_scale)
        # The graph keeps reading the tensors it was captured with: a plan must hand back the
        # same ones every time.
        if b in self._decode and not _same(self._decode[b], decode):
            raise RuntimeError(f"{type(rank.attn).__name__}.plan_graph moved its buffers")
        self._decode[b] = decode
        return decode

    def _step(self, b: int, decode: DecodeInputs | None) -> torch.Tensor:
        """One decode step of bucket b from the buffers (what a graph captures)."""
        rank = self.model.ranks[0]
        angles = [rank.rotary.angles(self._positions[:b])]
        rows = [rank.kv.rows_of(self._write_pages[:b], self._write_offsets[:b])]
        logits = self.model.layers(
            self._input_ids[:b],
            angles,
            rows,
            None if decode is None else [decode],
            self._logits_rows[:b],
        )
        return self._logits[:b].copy_(logits)

    def _capture_all(self) -> float:
        """Capture every bucket, largest first, sharing one memory pool."""
        start = time.monotonic()
        pool = None
        with torch.inference_mode():
            for b in reversed(self.buckets):
                meta = build_paged_metadata([self.pad_spec] * b, self.page_size, self._device)
                decode = self._prepare(torch.zeros(b, dtype=torch.long, device=self._device), meta)
                self._step(b, decode)  # warm-up: kernels loaded and chosen outside the capture
                torch.cuda.synchronize(self._device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._step(b, decode)
                pool = graph.pool()
                self._graphs[b] = graph
        torch.cuda.synchronize(self._device)
        took = time.monotonic() - start
        log.info("captured %d CUDA graphs of decode steps in %.1f s", len(self.buckets), took)
        return took

    @property
    def _device(self) -> torch.device:
        return self.model.ranks[0].device


def _same(a: DecodeInputs | None, b: DecodeInputs | None) -> bool:
    if a is None or b is None:
        return a is b
    return all(x.data_ptr() == y.data_ptr() and x.shape == y.shape for x, y in zip(a, b))
