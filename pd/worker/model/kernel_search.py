"""The measuring half of `--dtype auto` / `--quantization auto` (the rule is autotune.py): each
candidate timed on the model's own linear layers at the role's batch sizes, and the model's
perplexity on the shipped text for the candidates the rule asks about.

Timing: one layer of each of the model's linear shapes on one TP rank (q/k/v, o, gate/up, down,
built by `quant.make_linear` from random weights of that shape: a kernel's time does not depend
on the values), a warm-up call and then `reps` rounds; a step's time is the median round's sum
over the shapes times the layer count and TP ranks (one process drives every rank in turn), plus
the LM head at the step's sampled rows (one at a prefill chunk). Activations are in the
candidate's compute dtype, so the layers' conversions are in the time; the rest of a step
(attention, norms) is not. A candidate already `DROP_FACTOR`x slower than the fastest at the
smallest batch is not timed at the larger ones (it scores infinity). Only the layers are
built; the perplexity builds the whole model (a `ModelRunner`) in that configuration.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from pd.worker.model import quant
from pd.worker.model.autotune import Candidate
from pd.worker.model.config import ModelConfig
from pd.worker.model.device import DTYPES
from pd.worker.model.kernels import DYNAMIC_INT8, ONEDNN_BF16, onednn_bf16_refusal
from pd.worker.model.perplexity import pages_for, perplexity
from pd.worker.model.runner import ModelRunner

log = logging.getLogger(__name__)

DROP_FACTOR = 4.0


@dataclass(frozen=True)
class LinearShape:
    name: str
    out: int
    inp: int
    count: int  # layers of this shape in one forward pass, over every rank


def linear_shapes(config: ModelConfig, tp: int) -> list[LinearShape]:
    """One rank's linear layers (their counts over every rank); the LM head is replicated."""
    d, hidden, n = config.head_dim, config.hidden_size, config.num_layers * tp
    hq, hkv, inter = (
        config.num_heads // tp,
        config.num_kv_heads // tp,
        config.intermediate_size // tp,
    )
    return [
        LinearShape("qkv", (hq + 2 * hkv) * d, hidden, n),
        LinearShape("o", hidden, hq * d, n),
        LinearShape("gate_up", 2 * inter, hidden, n),
        LinearShape("down", hidden, inter, n),
        LinearShape("lm_head", config.vocab_size, hidden, 1),
    ]


def formats_here(config: ModelConfig, tp: int, group_size: int) -> list[str]:
    """The weight formats this machine's torch runs for this model (a refusal drops one)."""
    out = ["none", "int8"]
    try:
        quant.check_group_size(config, tp, group_size)
        out.append("int4")
    except ValueError:
        pass
    out += [
        q
        for q, engine in DYNAMIC_INT8.items()
        if engine in torch.backends.quantized.supported_engines
    ]
    if not onednn_bf16_refusal():
        out.append(ONEDNN_BF16)
    return out


def _median_s(layer: quant.Linear, x: torch.Tensor, reps: int) -> float:
    layer(x)  # warm-up: the first call packs and allocates
    samples = []
    for _ in range(reps):
        t = time.perf_counter()
        layer(x)
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def _resident_bytes(layer: quant.Linear) -> int:
    return int(getattr(layer, "resident_bytes", layer.nbytes))


def time_candidate(
    c: Candidate,
    shapes: Sequence[LinearShape],
    rows: Sequence[int],
    prefill_rows: int,
    group_size: int,
    reps: int = 3,
) -> tuple[dict[int, float], int]:
    """(ms of a step's linear layers per batch in `rows`, the bytes its weights hold); a batch
    of `prefill_rows` samples one row at the LM head."""
    dtype, cpu = DTYPES[c.dtype], torch.device("cpu")
    gen = torch.Generator().manual_seed(0)
    layers = []
    for s in shapes:
        q = quant.head_quantization(c.quantization) if s.name == "lm_head" else c.quantization
        w = torch.randn(s.out, s.inp, generator=gen) * s.inp**-0.5
        layers.append((s, quant.make_linear(w, None, q, group_size, dtype, cpu)))
    out: dict[int, float] = {}
    for r in rows:
        ms = 0.0
        for s, layer in layers:
            n = 1 if s.name == "lm_head" and r == prefill_rows else r
            x = torch.randn(n, s.inp, generator=gen).to(dtype)
            ms += _median_s(layer, x, reps) * 1e3 * s.count
        out[r] = ms
    return out, sum(_resident_bytes(layer) * s.count for s, layer in layers)


def time_candidates(
    cands: Sequence[Candidate],
    config: ModelConfig,
    tp: int,
    rows: Sequence[int],
    prefill_rows: int,
    group_size: int,
) -> tuple[dict[Candidate, dict[int, float]], dict[Candidate, int]]:
    """(ms per candidate per batch, bytes of each candidate's weights): every candidate at the
    smallest batch first, then the ones within `DROP_FACTOR` of the fastest there at the
    others."""
    shapes, rows = linear_shapes(config, tp), sorted(rows)
    first = {c: time_candidate(c, shapes, rows[:1], prefill_rows, group_size) for c in cands}
    best = min(t[rows[0]] for t, _ in first.values())
    out, nbytes = {}, {}
    for c, (t, size) in first.items():
        nbytes[c] = size
        if t[rows[0]] > DROP_FACTOR * best:
            out[c] = t
            continue
        out[c] = {**t, **time_candidate(c, shapes, rows[1:], prefill_rows, group_size)[0]}
    return out, nbytes


class PerplexityJudge:
    """A candidate's perplexity on the shipped text over the fp32 dense model's, each model
    built once (`ModelRunner`) and dropped after."""

    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, quant.Weight],
        ids: list[int],
        tp: int,
        group_size: int,
    ) -> None:
        self.config, self.weights, self.ids, self.tp, self.group_size = (
            config,
            weights,
            ids,
            tp,
            group_size,
        )
        self._base: float | None = None

    def perplexity(self, c: Candidate) -> float:
        t = time.perf_counter()
        runner = ModelRunner(
            self.config,
            self.weights,
            tp=self.tp,
            dtype=DTYPES[c.dtype],
            device="cpu",
            num_pages=pages_for(len(self.ids), 16) + 1,
            page_size=16,
            max_model_len=len(self.ids) + 16,
            quantization=c.quantization,
            group_size=self.group_size,
        )
        p = perplexity(runner, self.ids)
        log.info("perplexity of %s: %.3f (%.1f s)", c.name, p, time.perf_counter() - t)
        return p

    def ratio(self, c: Candidate) -> float:
        if self._base is None:
            self._base = self.perplexity(Candidate("float32", "none"))
        return self.perplexity(c) / self._base
