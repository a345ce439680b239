"""The measuring half of `--dtype auto` / `--quantization auto` (the rule is autotune.py): each
candidate timed on the model's own linear layers at the search's batch sizes, and the model's
perplexity on the shipped text for the candidates the rule asks about.

Timing: the model's linear layers on one TP rank (q/k/v, o, gate/up, down of each layer, built by
`quant.make_linear` from random weights of those shapes: a kernel's time does not depend on the
values), every layer distinct up to `WEIGHT_BUDGET` (`layer_groups`), run in the model's order, all
candidates side by side in rounds (`time_candidates`); a step's time is the fastest round's pass
scaled to the layer count and TP ranks (one process drives every rank in turn), plus the LM head at
the step's sampled rows (one at a prefill chunk). Distinct layers matter: one layer of each shape
called again and again stays in the core's L2, and at decode batches a kernel that reads twice the
bytes then times the same as one that reads half (int8 against int4: docs/BENCHMARKS.md, "Linear
kernels per machine kind", the caveat on the AMX table; and docs/EXPERIMENTS.md §23). Activations
are in the candidate's compute dtype, so the layers' conversions are in the time; the rest of a step
(attention, norms) is not. A batch of `COMPUTE_ROWS` or more (a prefill chunk) is compute-bound and
timed on a few layers only. A candidate `DROP_FACTOR`x slower than the fastest at a batch is not
timed at the larger ones (it scores infinity): on a CPU without bf16 dot products the bf16
candidates would otherwise spend seconds a pass at a prefill chunk. A batch under `DROP_FROM_ROWS`
drops nothing (`DropRule`): there a format's time is the bytes it reads, and one that reads 4x the
bytes (bf16 against int4) can still be the fastest at a prefill chunk, the large half of a split
(dropped at one row under a noisy neighbour, onednn-bf16 was in no split; under the AVX2 cap fp32
`none`, far behind fbgemm-int8 at 8 rows, was dropped there and never timed at 512, where it is
close to the best that passes the perplexity bound: docs/EXPERIMENTS.md §13). Only the layers are
built; the perplexity builds the whole model (a `ModelRunner`) in that configuration.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

import pd.worker.model.quant as quant
import pd.worker.model.tuning.knobs as knobs
from pd.config import format_at, split_quantization
from pd.worker.model.assemble import lm_head_weight
from pd.worker.model.config import ModelConfig
from pd.worker.model.device import DTYPES
from pd.worker.model.int4_fp32 import BLOCK, INT4_FP32, int4_fp32_refusal
from pd.worker.model.kernels import DYNAMIC_INT8, ONEDNN_DTYPES, onednn_refusal
from pd.worker.model.runner import ModelRunner
from pd.worker.model.runner_config import RunnerConfig
from pd.worker.model.smooth_quant import (
    KINDS,
    SMOOTH_INT8,
    ActivationMaxima,
    holds_smooth,
)
from pd.worker.model.tuning.autotune import REFERENCE, Candidate
from pd.worker.model.tuning.calibration import activation_maxima
from pd.worker.model.tuning.perplexity import final_hidden, pages_for, perplexity, perplexity_of

log = logging.getLogger(__name__)


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
        if not int4_fp32_refusal() and all(s.out % BLOCK == 0 for s in linear_shapes(config, tp)):
            out.append(INT4_FP32)
    except ValueError:
        pass
    out += [
        q
        for q, engine in DYNAMIC_INT8.items()
        if engine in torch.backends.quantized.supported_engines
    ]
    out += [q for q in ONEDNN_DTYPES if not onednn_refusal(q)]
    if "fbgemm" in torch.backends.quantized.supported_engines:
        out.append(SMOOTH_INT8)
    return out


def _resident_bytes(layer: quant.Linear) -> int:
    return int(getattr(layer, "resident_bytes", layer.nbytes))


def layer_groups(shapes: Sequence[LinearShape], budget_bytes: float = knobs.WEIGHT_BUDGET) -> int:
    """How many layers' worth of distinct weights to time: the model's layer count (over its
    ranks), or as many as `budget_bytes` of fp32 weights hold (at least one)."""
    layers = [s for s in shapes if s.name != "lm_head"]
    per_layer = sum(s.out * s.inp * 4 for s in layers)
    return max(1, min(layers[0].count, int(budget_bytes // per_layer)))


@dataclass
class RandomWeights:
    """The weights every candidate is built from: `groups` layers of each shape, and the head."""

    shapes: list[LinearShape]
    groups: int
    layers: list[list[tuple[LinearShape, torch.Tensor]]]  # [group][shape]
    head: tuple[LinearShape, torch.Tensor]

    @property
    def nbytes(self) -> int:
        """fp32 bytes of the layers and the head: about a candidate's at most."""
        return sum(w.nbytes for group in self.layers for _, w in group) + self.head[1].nbytes

    @staticmethod
    def make(shapes: Sequence[LinearShape], groups: int) -> RandomWeights:
        gen = torch.Generator().manual_seed(0)

        def w(s: LinearShape) -> torch.Tensor:
            return torch.randn(s.out, s.inp, generator=gen) * s.inp**-0.5

        body = [s for s in shapes if s.name != "lm_head"]
        head = next(s for s in shapes if s.name == "lm_head")
        return RandomWeights(
            list(shapes),
            groups,
            [[(s, w(s)) for s in body] for _ in range(groups)],
            (head, w(head)),
        )


def _flat(s: LinearShape) -> torch.Tensor | None:
    """A flat calibration for smooth-int8's layers (their time does not depend on its values)."""
    return torch.ones(s.inp) if s.name in KINDS else None


def _round_s(calls: Sequence[tuple[quant.Linear, torch.Tensor]]) -> float:
    """Seconds of one pass through `calls`."""
    t = time.perf_counter()
    for layer, x in calls:
        layer(x)
    return time.perf_counter() - t


@dataclass
class BuiltCandidate:
    """A candidate's layers (`groups` of each shape, in the model's order) and LM head, built
    from `RandomWeights`; `count`: the model's layers of each shape."""

    candidate: Candidate
    layers: list[list[tuple[LinearShape, quant.Linear]]]
    head_shape: LinearShape
    head: quant.Linear
    count: int

    @staticmethod
    def build(c: Candidate, weights: RandomWeights, group_size: int) -> BuiltCandidate:
        dtype, cpu = DTYPES[c.dtype], torch.device("cpu")
        layers = [
            [(s, quant.make_linear(w, None, c.quantization, group_size, dtype, cpu, _flat(s)))
             for s, w in g]
            for g in weights.layers
        ]  # fmt: skip
        head_shape, head_w = weights.head
        head_q = quant.head_quantization(c.quantization, dtype)
        head = quant.make_linear(head_w, None, head_q, group_size, dtype, cpu)
        return BuiltCandidate(c, layers, head_shape, head, weights.layers[0][0][0].count)

    @property
    def nbytes(self) -> int:
        """Its weights' bytes, scaled to the model's layer count."""
        body = sum(_resident_bytes(layer) for group in self.layers for _, layer in group)
        return int(body * self.count / len(self.layers)) + _resident_bytes(self.head)

    def calls(
        self, rows: int, prefill_rows: int, gen: torch.Generator
    ) -> tuple[
        list[tuple[quant.Linear, torch.Tensor]], list[tuple[quant.Linear, torch.Tensor]], float
    ]:
        """(a pass's layer calls, the head's call, the factor from the layers timed to the
        model's): a batch of knobs.COMPUTE_ROWS or more runs a few layer groups (module docstring),
        and a batch of `prefill_rows` samples one row at the head."""
        dtype = DTYPES[self.candidate.dtype]
        xs = {s.name: torch.randn(rows, s.inp, generator=gen).to(dtype) for s, _ in self.layers[0]}
        timed = self.layers if rows < knobs.COMPUTE_ROWS else self.layers[: knobs.COMPUTE_GROUPS]
        body = [(layer, xs[s.name]) for group in timed for s, layer in group]
        n = 1 if rows == prefill_rows else rows
        h = torch.randn(n, self.head_shape.inp, generator=gen).to(dtype)
        return body, [(self.head, h)], self.count / len(timed)


def time_candidates(
    cands: Sequence[Candidate],
    config: ModelConfig,
    tp: int,
    rows: Sequence[int],
    prefill_rows: int,
    group_size: int,
    reps: int = knobs.LAYER_ROUNDS,
    memory_bytes: float = math.inf,
) -> tuple[dict[Candidate, dict[int, float]], dict[Candidate, int]]:
    """(ms of a step's linear layers per candidate per batch in `rows`, the bytes each one's
    weights hold). A pass runs every layer group in the model's order, so each call reads
    weights the last one did not leave in the caches, as a step does; a step is the pass scaled
    to the model's layer count, plus the head (one row of it at a batch of `prefill_rows`).

    The candidates are built up front, as many at once as `memory_bytes` holds at their fp32 size
    (all of them, for a small model), and each batch, smallest first, is timed in `reps` rounds of
    one pass of every candidate still in, the order rotated from round to round (a first pass over
    `LONG_PASS_S` leaves that candidate one more round only). So a slow spell of the machine (a
    neighbour's burst, seconds long) falls on them all instead of on whichever was being timed:
    timed one after another, a kernel's figure moved from one search to the next by more than the
    candidates differ, and a search under the AVX2 cap chose bfloat16 on a slow spell of
    float32/int4's (docs/EXPERIMENTS.md §13, "The search chose by the noise"; §23). A candidate's
    time is its fastest round: noise only adds time, and the first round, where a kernel packs,
    allocates and builds its primitives for the batch, is its warm-up. After each batch `DropRule`
    leaves out the candidates far behind (freed): not timed at the larger batches, they score
    infinity."""
    shapes, rows = linear_shapes(config, tp), sorted(rows)
    weights = RandomWeights.make(shapes, layer_groups(shapes))
    at_once = max(
        1, len(cands) if math.isinf(memory_bytes) else int(memory_bytes // weights.nbytes)
    )
    rule = DropRule(rows)
    out: dict[Candidate, dict[int, float]] = {c: {} for c in cands}
    nbytes: dict[Candidate, int] = {}
    for i in range(0, len(cands), at_once):
        built = [BuiltCandidate.build(c, weights, group_size) for c in cands[i : i + at_once]]
        nbytes |= {b.candidate: b.nbytes for b in built}
        _time_side_by_side(built, rows, prefill_rows, reps, rule, out)
    return out, nbytes


def _time_side_by_side(
    built: list[BuiltCandidate],
    rows: Sequence[int],
    prefill_rows: int,
    reps: int,
    rule: DropRule,
    out: dict[Candidate, dict[int, float]],
) -> None:
    """`time_candidates`' rounds for the candidates `built`, into `out`."""
    gen = torch.Generator().manual_seed(1)
    for r in rows:
        calls = [(b.candidate, *b.calls(r, prefill_rows, gen)) for b in built]
        samples: dict[Candidate, list[float]] = {c: [] for c, *_ in calls}
        long: set[Candidate] = set()  # a first pass over knobs.LONG_PASS_S: two rounds only
        for k in range(reps):
            for c, body, head, scale in calls[k % len(calls) :] + calls[: k % len(calls)]:
                if k >= 2 and c in long:
                    continue
                body_s, head_s = _round_s(body), _round_s(head)
                if k == 0 and body_s + head_s > knobs.LONG_PASS_S:
                    long.add(c)
                samples[c].append(body_s * scale + head_s)
        for c, s in samples.items():
            out[c][r] = 1e3 * min(s)
        # the fastest first, so that the drop rule knows the pace before it judges the others
        kept = {c for c in sorted(samples, key=lambda c: out[c][r]) if rule.go_on(r, out[c][r])}
        built = [b for b in built if b.candidate in kept]


def time_heads(
    dtype: str,
    formats: Sequence[str],
    config: ModelConfig,
    rows: Sequence[int],
    prefill_rows: int,
    group_size: int,
    reps: int = knobs.HEAD_ROUNDS,
) -> tuple[dict[Candidate, dict[int, float]], dict[Candidate, int]]:
    """(ms of the LM head alone in each of `formats` at each batch in `rows`, its bytes): the
    head at a step's sampled rows (one at a prefill chunk), after a read of `FLUSH_BYTES` that
    evicts it from the caches, as a step's layers do between two heads (a hot head times several
    times faster than one a step reads: docs/EXPERIMENTS.md §12)."""
    head = next(s for s in linear_shapes(config, 1) if s.name == "lm_head")
    w = RandomWeights.make([head], 1).head[1]
    flush = torch.ones(int(knobs.FLUSH_BYTES) // 4)
    gen = torch.Generator().manual_seed(2)
    ms: dict[Candidate, dict[int, float]] = {}
    nbytes: dict[Candidate, int] = {}
    for fmt in formats:
        c = Candidate(dtype, fmt)
        layer = quant.make_linear(w, None, fmt, group_size, DTYPES[dtype], torch.device("cpu"))
        ms[c] = {}
        for r in rows:
            x = torch.randn(1 if r == prefill_rows else r, head.inp, generator=gen)
            x = x.to(DTYPES[dtype])
            layer(x)  # warm-up
            samples = []
            for _ in range(reps):
                flush.sum()
                t = time.perf_counter()
                layer(x)
                samples.append(time.perf_counter() - t)
            ms[c][r] = 1e3 * statistics.median(samples)
        nbytes[c] = _resident_bytes(layer)
    return ms, nbytes


class ChunkedLinear:
    """A linear layer called on at most `rows` rows at a time: a split's small half as it runs
    (decode batches of up to ROWS rows), for its perplexity. Weight-only formats give the same
    answer either way; a dynamic int8 kernel quantizes its activations once per call, so over a
    whole text at once (369 rows in one call) it is judged far harsher than it runs: an
    fbgemm-int8 head fails the bound in one call and passes it a row at a time
    (docs/EXPERIMENTS.md §12, "Their quality, as they run")."""

    def __init__(self, layer: quant.Linear, rows: int) -> None:
        self.layer, self.rows, self.nbytes = layer, rows, layer.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.layer(part) for part in x.split(self.rows)])


class DropRule:
    """Whether a candidate just timed at a batch is timed at the next (larger) one: when it is
    within `DROP_FACTOR` of the fastest timed so far at that batch, or the batch is under
    `DROP_FROM_ROWS` rows, or the smallest (where time is bytes read: the module's note)."""

    def __init__(self, rows: Sequence[int]) -> None:
        self.smallest = min(rows)
        self.best: dict[int, float] = {}  # the fastest ms at each batch so far

    def go_on(self, rows: int, ms: float) -> bool:
        self.best[rows] = min(self.best.get(rows, ms), ms)
        spared = rows == self.smallest or rows < knobs.DROP_FROM_ROWS
        return spared or ms <= knobs.DROP_FACTOR * self.best[rows]


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
        encode: Callable[[str], Sequence[int]] | None = None,  # for smooth-int8's calibration
    ) -> None:
        self.config, self.weights, self.ids, self.tp, self.group_size = (
            config,
            weights,
            ids,
            tp,
            group_size,
        )
        self.encode = encode
        self._maxima: ActivationMaxima | None = None
        self._base: float | None = None
        self._hiddens: dict[Candidate, torch.Tensor] = {}
        # (dtype, layers' format, head's format, rows a head call takes or None) -> ratio
        self._head_ratios: dict[tuple[str, str, str, int | None], float] = {}

    def _act_maxima(self, quantization: str) -> ActivationMaxima | None:
        """smooth-int8's calibration, made once, for a format that holds it (None otherwise)."""
        if not holds_smooth(quantization):
            return None
        if self._maxima is None:
            if self.encode is None:
                raise ValueError(f"judging {SMOOTH_INT8} needs the tokenizer (encode)")
            t = time.perf_counter()
            self._maxima = activation_maxima(self.config, self.weights, self.encode)
            log.info("%s calibration: %.1f s", SMOOTH_INT8, time.perf_counter() - t)
        return self._maxima

    def _runner(self, c: Candidate) -> ModelRunner:
        page = knobs.JUDGE_PAGE_SIZE
        return self.runner(c, "auto", pages_for(len(self.ids), page) + 1, len(self.ids) + page)

    def runner(
        self, c: Candidate, head: str, num_pages: int, max_len: int | None = None
    ) -> ModelRunner:
        """A model of `c` with the LM head `head` (auto: its rule), `num_pages` pages of
        `knobs.JUDGE_PAGE_SIZE`,
        for sequences of up to `max_len` tokens (default: all its pages')."""
        rc = RunnerConfig(
            tp=self.tp,
            dtype=DTYPES[c.dtype],
            device="cpu",
            num_pages=num_pages,
            page_size=knobs.JUDGE_PAGE_SIZE,
            max_model_len=max_len or num_pages * knobs.JUDGE_PAGE_SIZE,
            quantization=c.quantization,
            lm_head_quantization=head,
            group_size=self.group_size,
        )
        return ModelRunner(self.config, self.weights, rc, self._act_maxima(c.quantization))

    def head(self, dtype: str, fmt: str) -> quant.Linear:
        """The LM head in `fmt` for layers in `dtype`."""
        t = DTYPES[dtype]
        w = lm_head_weight(self.config, self.weights, t)
        return quant.make_linear(w, None, fmt, self.group_size, t, torch.device("cpu"))

    def perplexity(self, c: Candidate) -> float:
        t = time.perf_counter()
        p = perplexity(self._runner(c), self.ids)
        log.info("perplexity of %s: %.3f (%.1f s)", c.name, p, time.perf_counter() - t)
        return p

    def ratio(self, c: Candidate) -> float:
        """`c`'s perplexity (with its own head) over the reference's, measured once."""
        head_q = quant.head_quantization(c.quantization, DTYPES[c.dtype])
        key = (c.dtype, c.quantization, head_q, None)
        if key not in self._head_ratios:
            self._head_ratios[key] = self.perplexity(c) / self.base()
        return self._head_ratios[key]

    def base(self) -> float:
        if self._base is None:
            self._base = self.perplexity(Candidate(*REFERENCE))
        return self._base

    def _hidden(self, layers: Candidate) -> torch.Tensor:
        """The LM head's input over the text with `layers`' model, computed once."""
        if layers not in self._hiddens:
            self._hiddens[layers] = final_hidden(self._runner(layers), self.ids)
        return self._hiddens[layers]

    def head_ratio(self, layers: Candidate, head: Candidate) -> float:
        """The perplexity ratio of `layers` with the LM head `head`, each of the head's formats
        judged as it runs: a split's small half on chunks of its ROWS rows (`ChunkedLinear`)
        beside the layers' format at that many rows, its large half (or a single format) on
        the whole text at once beside the layers' format there; the worse of the two. A
        combination measured before (by `ratio`: a format with its own head) is not again."""
        split = split_quantization(head.quantization)
        parts = (
            [(head.quantization, None)]
            if split is None
            else [(split[0], split[1]), (split[2], None)]
        )
        worst = 0.0
        for fmt, rows in parts:
            lq = format_at(layers.quantization, rows or len(self.ids))
            if fmt not in DYNAMIC_INT8 and fmt != SMOOTH_INT8:
                rows = None  # weights only: the same answer whatever the rows a call
            key = (layers.dtype, lq, fmt, rows)
            if key not in self._head_ratios:
                t = time.perf_counter()
                hidden = self._hidden(Candidate(layers.dtype, lq))
                layer: quant.Linear = self.head(layers.dtype, fmt)
                if rows is not None:
                    layer = ChunkedLinear(layer, rows)
                with torch.inference_mode():
                    p = perplexity_of(layer(hidden), self.ids)
                self._head_ratios[key] = p / self.base()
                at = "" if rows is None else f" on {rows} rows a call"
                log.info("perplexity of %s/%s with an LM head %s%s: %.3f (%.1f s)",
                         layers.dtype, lq, fmt, at, p, time.perf_counter() - t)  # fmt: skip
            worst = max(worst, self._head_ratios[key])
        return worst
