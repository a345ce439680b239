"""A compiled decode step: decode steps run through `torch.compile` (inductor) on CPU
(`--compile`, off by default: the warm-up takes minutes).

What is compiled is `LlamaModel.hidden` (every layer and the final norm) for pure decode steps;
the LM head (`LlamaModel.logits`: a dynamic int8 head is an object dynamo does not trace) and
the step's planning stay eager, and prefill or mixed steps run eager. Attention comes in as tensors
(`TorchAttentionBackend.decode_inputs`: the padded page table and the mask), so the compiled
code reads no Python list, and its shapes follow the batch and the longest context. Dynamo
compiles a graph for the first shape it sees, and one with those sizes symbolic when they change
(plus the specializations of size 1 it keeps), so `compile_decode` runs a few decode steps of
each kind at start-up, on scratch pages it zeroes afterwards: no request pays a compile.

The K/V write goes through the pool seen as rows (`KVPool._rows`, a view made once, outside
the graph), which inductor mutates in place: a view taken inside the graph was functionalized
and the pool copied back whole on every step (docs/BENCHMARKS.md, "The compiled step in the
worker"). An opaque custom op did it in place too, but its Python body, called from the graph
once a layer, cost more than the write itself (docs/EXPERIMENTS.md §11).

Compiled, a worker decodes faster than eager at every stream count, most at one stream, bf16 and
int4 alike (docs/BENCHMARKS.md, "The compiled step in the worker": `pd-bench engine`, rounds
against eager). But the warm-up takes minutes on a cold inductor cache (seconds on a warm one:
the same section), so `--compile` is off by default.
"""

from __future__ import annotations

import inspect
import logging
import re
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pd.kvcache.paged_metadata import build_paged_metadata
from pd.worker.model.attention import AttentionBackend
from pd.worker.model.attention.torch_backend import DecodeInputs, TorchAttentionBackend
from pd.worker.model.inductor_cache import use_pd_inductor_cache
from pd.worker.model.llama import LlamaModel

log = logging.getLogger(__name__)

# (decode batch, pages per sequence) of the warm-up steps, sizes marked dynamic from the first:
# one graph for a single sequence (its context symbolic), one for batches (both symbolic). Steps
# run on at least 2 pages (`decode_inputs(min_pages=2)`): dynamo gives a size of 1 a graph of
# its own.
WARMUP_SHAPES = ((1, 2), (1, 3), (2, 2), (3, 3))


# The arguments of `LlamaModel.hidden`, which dynamo's guards name as they are.
_STEP_ARGS = frozenset(list(inspect.signature(LlamaModel.hidden).parameters)[1:])


def _guard_on_inputs(entries: list[Any]) -> list[bool]:
    """Which of dynamo's guards a compiled step checks on each call: those on its arguments
    (their shapes, dtypes and the sizes marked dynamic) and on global state (grad mode, the
    symbolic shapes); not those on the model (`self`: ~300 weights, the pool, the config) or on
    the modules it calls, which do not change once the worker runs (and each model compiles
    its own copy of the code: `_own_code`). Checking those cost a measurable share of a
    one-row step (docs/BENCHMARKS.md, "The compiled step in the worker")."""
    return [
        e.name == "" or re.split(r"[\[.]", e.name, maxsplit=1)[0] in _STEP_ARGS for e in entries
    ]


def _guard_on_inputs_not_threads(entries: list[Any]) -> list[bool]:
    """`_guard_on_inputs` without the global state guard (torch's thread count, among what
    does not change once a worker runs): the one-row compile runs on a thread of one torch
    thread (one_row.py; with the serving thread's count, its second OpenMP team slowed the
    serving thread's steps: docs/EXPERIMENTS.md §9), and the graph's loops take `cpp.threads`
    baked in."""
    keep = _guard_on_inputs(entries)
    return [k and e.guard_type != "GLOBAL_STATE" for k, e in zip(keep, entries)]


def _own_code(method: Any) -> Any:
    """`method` bound to a copy of its function with a code object of its own. Dynamo keeps a
    function's compiled graphs on its code object, and the guards `_guard_on_inputs` keeps say
    nothing of the model: without a copy, a second model in the process (another pool size,
    other layers) would run the first one's graph."""
    func = method.__func__
    copy = types.FunctionType(
        func.__code__.replace(),
        func.__globals__,
        func.__name__,
        func.__defaults__,
        func.__closure__,
    )
    return types.MethodType(copy, method.__self__)


def compile_decode(model: LlamaModel, page_size: int, num_pages: int) -> float:
    """Compile `model`'s decode steps and warm them up; returns the seconds it took."""
    check_compilable(model)
    need = max(b * p for b, p in WARMUP_SHAPES)
    if num_pages < need:
        raise ValueError(
            f"the compiled decode step warms up on {need} KV pages; the pool has {num_pages}"
        )
    start = time.monotonic()
    compiled, marked = _compiled_layers(model)
    # The C++ wrapper calls the graph's kernels without a Python line per kernel: a faster step
    # than with the Python wrapper, whose gain over eager it mostly ate (docs/EXPERIMENTS.md §5
    # and §23).
    model.compiled_decode = marked
    with torch._inductor.config.patch(cpp_wrapper=True):
        for batch, pages in WARMUP_SHAPES:
            seqs = [
                (list(range(s * pages, (s + 1) * pages)), pages * page_size - 1, 1)
                for s in range(batch)
            ]
            meta = build_paged_metadata(seqs, page_size, model.ranks[0].device)
            ids = torch.ones(batch, dtype=torch.long)
            model.forward(ids, meta, torch.arange(batch))
    model.compiled_decode = compiled
    for rank in model.ranks:
        rank.kv.buffer[:need].zero_()  # the warm-up's K/V: pages are zeros until written
    took = time.monotonic() - start
    log.info("compiled the decode step in %.1f s", took)
    return took


def compile_one_row(
    model: LlamaModel, page_size: int, scratch: range, threads: int
) -> Callable[..., torch.Tensor]:
    """Compile `model`'s one-row decode step on the calling thread while another serves the
    model (one_row.py): the warm-up steps write only the pool's `scratch` pages (none the
    allocator hands out; zeroed after) and plan on attention backends of their own, and the
    graph's parallel loops take the serving thread's `threads`. Returns the compiled step, for
    the caller to install (`LlamaModel.compiled_one_row`); `layers_inputs` makes its inputs."""
    check_compilable(model)
    if len(scratch) < 3:
        raise ValueError(f"the one-row warm-up writes 3 scratch pages, not {len(scratch)}")
    compiled, marked = _compiled_layers(model, _guard_on_inputs_not_threads)
    attns: list[AttentionBackend] = [TorchAttentionBackend() for _ in model.ranks]
    options = {"cpp_wrapper": True, "cpp.threads": threads}
    with torch.inference_mode(), torch._inductor.config.patch(options):
        for pages in (2, 3):  # the second marks the context dynamic
            marked(*layers_inputs(model, attns, scratch[:pages], page_size))
    for rank in model.ranks:
        rank.kv.buffer[scratch.start : scratch.stop].zero_()
    return compiled


def layers_inputs(
    model: LlamaModel, attns: list[AttentionBackend], pages: Sequence[int], page_size: int
) -> tuple:
    """`LlamaModel.hidden`'s arguments for one row decoding the last slot of `pages`, planned on
    `attns` (not the ranks' own backends, which the serving thread plans on)."""
    device = model.ranks[0].device
    # Made as `ModelRunner.execute` makes them: the ids and the metadata outside inference
    # mode, what `forward` plans inside it. A tensor of another kind (an inference tensor or
    # not) fails a compiled graph's guards: served calls would run eagerly.
    with torch.inference_mode(False):
        seqs = [(list(pages), len(pages) * page_size - 1, 1)]
        meta = build_paged_metadata(seqs, page_size, device)
        ids = torch.ones(1, dtype=torch.long, device=device)
        rows = torch.zeros(1, dtype=torch.long, device=device)
    with torch.inference_mode():
        angles, kv_rows = model.plan(meta, attns)
        decode = [attn.decode_inputs(min_pages=2) for attn in attns]
    return ids, angles, kv_rows, decode, rows


def check_compilable(model: LlamaModel) -> None:
    if any(r.device.type != "cpu" for r in model.ranks) or not all(
        isinstance(r.attn, TorchAttentionBackend) for r in model.ranks
    ):
        raise ValueError(
            "--compile runs on CPU with the torch attention backend (on CUDA, decode steps replay "
            "CUDA graphs: --cuda-graph-max-batch)"
        )


def _compiled_layers(
    model: LlamaModel, guards: Callable[[list[Any]], list[bool]] = _guard_on_inputs
) -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]:
    """`model.hidden` through torch.compile, bare and with each call's sizes marked dynamic
    (the warm-up's: the compiled graphs then take any context, and batch when > 1)."""
    use_pd_inductor_cache()  # inductor's default folder mixes what it compiled under ISA caps
    compiled = torch.compile(
        _own_code(model.hidden), fullgraph=True, options={"guard_filter_fn": guards}
    )

    def marked(
        input_ids: torch.Tensor,
        angles: list[torch.Tensor],
        kv_rows: list[torch.Tensor],
        decode: list[DecodeInputs],
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """The compiled layers, with this step's sizes marked dynamic (batch when > 1)."""
        batch = input_ids.shape[0] > 1
        for pages, mask in decode:
            torch._dynamo.mark_dynamic(pages, 0)
            torch._dynamo.mark_dynamic(mask, 3)
            if batch:
                torch._dynamo.mark_dynamic(mask, 1)
        if batch:
            for t in (input_ids, logits_indices, *angles):
                torch._dynamo.mark_dynamic(t, 0)
            for rows in kv_rows:
                torch._dynamo.mark_dynamic(rows, 1)
        return compiled(input_ids, angles, kv_rows, decode, logits_indices)

    return compiled, marked
