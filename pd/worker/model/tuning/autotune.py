"""`--dtype auto` / `--quantization auto` on a CPU: the decision rule, apart from the timing
(kernel_search.py), the judges (perplexity.py, row_invariance.py) and the cache
(kernel_cache.py), so it is tested without a model.

A candidate is a compute dtype and a weight format (`Candidate`). Each is timed on the model's
linear layers at the batch sizes of a co-located worker (`search_batches`): its prefill chunk
(`--chunk-size` rows) for half the weight, 1, 8 and 32 rows (no more than
`--max-running-requests`) for the other half. The batches are the same for every role, so a
prefill and a decode worker on one machine decide alike: the compute dtype is also the KV
cache's, and one deployment runs one model (the search never asks which role it serves). A
candidate's score is the weighted geometric mean, over those batches, of its time over the
fastest candidate's at that batch: 1.0 is fastest everywhere, 1.3 is 30% slower on (weighted)
average, whatever the scale of each batch's times. The choice is the best-scored candidate that
passes the judges: it computes a row the same way in a batch of any size as alone
(row_invariance.py), and the model's perplexity on the shipped text stays within `PPL_BOUND` of
the fp32 dense model's. Judges are asked lazily, best first, so only candidates that could win
are judged (`choose`).

Only single formats are candidates: a split (`--quantization SMALL@ROWS+LARGE`, the weights in
two formats, small batches on the first's kernel) computes one row one way and many another, so
a request's answer would change with the load; it stays an explicit flag.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pd.worker.model.tuning.knobs as knobs
from pd.config import quantization_formats, split_quantization

DTYPES = ("float32", "bfloat16")
REFERENCE = ("float32", "none")  # what the perplexity bound is relative to


@dataclass(frozen=True, order=True)
class Candidate:
    dtype: str  # "float32" | "bfloat16"
    quantization: str  # a quant.QUANTIZATIONS value, or a split of two (SMALL@ROWS+LARGE)

    @property
    def name(self) -> str:
        return f"{self.dtype}/{self.quantization}"

    @property
    def is_split(self) -> bool:
        return split_quantization(self.quantization) is not None

    @property
    def parts(self) -> tuple[Candidate, ...]:
        """The single formats it holds (itself unless a split)."""
        return tuple(Candidate(self.dtype, q) for q in quantization_formats(self.quantization))

    @staticmethod
    def parse(name: str) -> Candidate:
        dtype, _, quantization = name.partition("/")
        return Candidate(dtype, quantization)


def candidates(dtype_pin: str, quantization_pin: str, formats: Sequence[str]) -> list[Candidate]:
    """Every (dtype, format) to time: a pinned dimension ("auto" if not) holds one value;
    `formats` are the weight formats this machine's torch can run."""
    dtypes = DTYPES if dtype_pin == "auto" else (dtype_pin,)
    quants = formats if quantization_pin == "auto" else (quantization_pin,)
    return [Candidate(d, q) for d in dtypes for q in quants]


def search_batches(chunk_size: int, max_running: int) -> dict[int, float]:
    """Rows of a step -> the weight of that batch size in a candidate's score (summing to 1):
    a co-located worker's, for every role (module docstring)."""
    decode = sorted({min(r, max_running) for r in knobs.DECODE_ROWS})
    out = {r: 0.5 / len(decode) for r in decode}
    out[chunk_size] = out.get(chunk_size, 0.0) + 0.5
    return out


def scores(
    ms: Mapping[Candidate, Mapping[int, float]], weights: Mapping[int, float]
) -> dict[Candidate, float]:
    """Each candidate's weighted geometric mean of (its ms / the fastest ms) over `weights`'
    batches; a candidate not timed at a batch (dropped as far too slow) scores infinity."""
    best = {r: min(t[r] for t in ms.values() if r in t) for r in weights}
    out = {}
    for c, t in ms.items():
        if any(r not in t for r in weights):
            out[c] = math.inf
            continue
        log = sum(w * math.log(t[r] / best[r]) for r, w in weights.items())
        out[c] = math.exp(log / sum(weights.values()))
    return out


@dataclass
class Choice:
    """What `auto` resolved to, and the figures that chose it (for /health and the log)."""

    dtype: str
    quantization: str
    how: str  # "measured", "cache", or why nothing was measured
    ms: dict[str, dict[int, float]] = field(default_factory=dict)  # candidate -> rows -> ms
    scores: dict[str, float] = field(default_factory=dict)  # at the search's batches
    perplexity_ratio: dict[str, float] = field(default_factory=dict)  # over fp32 dense's
    search_s: float = 0.0
    # The LM head's format ("auto": the layers' rule, quant.head_quantization) and, when it was
    # measured (`choose_head`), each head format's ms alone, score and perplexity ratio (the
    # chosen layers with that head).
    head: str = "auto"
    head_ms: dict[str, dict[int, float]] = field(default_factory=dict)
    head_scores: dict[str, float] = field(default_factory=dict)
    head_perplexity_ratio: dict[str, float] = field(default_factory=dict)
    # Where each judged candidate (head) computes a row otherwise in a batch than alone
    # (row_invariance.py: "down at 33 rows"), or None where it never does.
    row_differs: dict[str, str | None] = field(default_factory=dict)
    head_row_differs: dict[str, str | None] = field(default_factory=dict)
    # The answer judge (answer_judge.py): each judged configuration's mean leading tokens equal
    # to fp32's ("float32/int4, head none"), the worse
    # of alone and all at once; the least accepted (bf16-none's less one prompt's worth); its
    # seconds. Empty where it did not run.
    agreement: dict[str, float] = field(default_factory=dict)
    agreement_bar: float | None = None
    judge_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "quantization": self.quantization,
            "how": self.how,
            "search_s": round(self.search_s, 2),
            "ms_per_step": _rounded_ms(self.ms),
            # None: not timed at every batch (dropped as far too slow)
            "score": _rounded_scores(self.scores),
            "perplexity_ratio": {c: round(p, 4) for c, p in self.perplexity_ratio.items()},
            "row_differs": dict(self.row_differs),
            "lm_head": {
                "quantization": self.head,
                "ms": _rounded_ms(self.head_ms),
                "score": _rounded_scores(self.head_scores),
                "perplexity_ratio": {c: round(p, 4) for c, p in self.head_perplexity_ratio.items()},
                "row_differs": dict(self.head_row_differs),
            },
            "answers": {
                "agreement": {c: round(a, 3) for c, a in self.agreement.items()},
                "bar": None if self.agreement_bar is None else round(self.agreement_bar, 3),
                "judge_s": round(self.judge_s, 2),
            },
        }

    @staticmethod
    def from_dict(d: Mapping[str, Any], how: str) -> Choice:
        head = d["lm_head"]
        return Choice(
            dtype=d["dtype"],
            quantization=d["quantization"],
            how=how,
            ms=_read_ms(d["ms_per_step"]),
            scores=_read_scores(d["score"]),
            perplexity_ratio=dict(d["perplexity_ratio"]),
            search_s=d["search_s"],
            head=head["quantization"],
            head_ms=_read_ms(head["ms"]),
            head_scores=_read_scores(head["score"]),
            head_perplexity_ratio=dict(head["perplexity_ratio"]),
            row_differs=dict(d["row_differs"]),
            head_row_differs=dict(head["row_differs"]),
            agreement=dict(d["answers"]["agreement"]),
            agreement_bar=d["answers"]["bar"],
            judge_s=d["answers"]["judge_s"],
        )

    def summary(self) -> str:
        """One line for the start-up log."""
        ranked = sorted(self.scores.items(), key=lambda kv: kv[1])
        parts = []
        for name, s in ranked:
            ppl = self.perplexity_ratio.get(name)
            differs = self.row_differs.get(name)
            rows = ", ".join(f"{r}: {v:.1f}" for r, v in sorted(self.ms.get(name, {}).items()))
            parts.append(
                f"{name} "
                + (f"x{s:.2f}" if math.isfinite(s) else "dropped")
                + f" ({rows} ms"
                + ("" if ppl is None else f"; perplexity x{ppl:.3f}")
                + ("" if differs is None else f"; a row differs in a batch: {differs}")
                + ")"
            )
        agreed = ", ".join(f"{name} {a:.2f}" for name, a in self.agreement.items())
        ppl_h = self.head_perplexity_ratio
        heads = [
            f"{name} x{s:.2f}" + (f" (perplexity x{ppl_h[name]:.3f})" if name in ppl_h else "")
            for name, s in sorted(self.head_scores.items(), key=lambda kv: kv[1])
            if math.isfinite(s)
        ]
        return (
            f"kernels {self.dtype}/{self.quantization}"
            + ("" if self.head == "auto" else f", LM head {self.head}")
            + f" ({self.how}"
            + (f", search {self.search_s:.1f} s" if self.how == "measured" else "")
            + "): "
            + ("; ".join(parts) or "nothing timed")
            + (f"; LM heads: {'; '.join(heads)}" if heads else "")
            + (
                f"; answers agree with fp32's for {agreed} leading tokens (at least "
                f"{self.agreement_bar:.2f}, judged in {self.judge_s:.1f} s)"
                if self.agreement_bar is not None
                else ""
            )
        )


def _rounded_ms(ms: Mapping[str, Mapping[int, float]]) -> dict[str, dict[str, float]]:
    return {c: {str(r): round(v, 3) for r, v in t.items()} for c, t in ms.items()}


def _rounded_scores(scores: Mapping[str, float]) -> dict[str, float | None]:
    return {c: round(s, 3) if math.isfinite(s) else None for c, s in scores.items()}


def _read_ms(d: Mapping[str, Mapping[str, float]]) -> dict[str, dict[int, float]]:
    return {c: {int(r): v for r, v in t.items()} for c, t in d.items()}


def _read_scores(d: Mapping[str, float | None]) -> dict[str, float]:
    return {c: math.inf if s is None else s for c, s in d.items()}


def _best(
    pool: Sequence[Candidate],
    score: Mapping[Candidate, float],
    passes: Callable[[Candidate], bool],
) -> Candidate | None:
    """The best-scored candidate of `pool` that `passes` (asked best first)."""
    for c in sorted(pool, key=lambda c: (score[c], c)):
        if math.isfinite(score[c]) and passes(c):
            return c
    return None


def choose(
    ms: Mapping[Candidate, Mapping[int, float]],
    weights: Mapping[int, float],
    ratio_of: Callable[[Candidate], float],
    row_invariant: Callable[[Candidate], bool],
    bound: float = knobs.PPL_BOUND,
    prefer_dtype: str | None = None,
    accepts: Callable[[Candidate], bool] = lambda c: True,
    agreement: Callable[[Candidate], float] | None = None,
) -> tuple[Candidate, dict[Candidate, float], dict[Candidate, float]]:
    """(the choice, the scores, the perplexity ratios measured): the best-scored candidate
    that computes a row the same at any batch (`row_invariant`) and whose perplexity over the
    reference's (`ratio_of`) is within `bound`, or the best of `prefer_dtype` when it scores
    within `DTYPE_TIE` of it; `accepts` (the answer judge, answer_judge.py) must pass too. With
    `agreement` (the answer judge's figure), the passing candidate within `FAITHFUL_TIE` of the
    choice's score that agrees best with fp32's answers is taken instead (the better score
    breaks a tie). Each
    judge is asked only of candidates tried, best first, the cheap ones first (`row_invariant`,
    then the perplexity, then the answers), and at most once each. Where no candidate computes
    rows the same at every batch, the best within the bound whose answers pass, else the best
    within the bound (the caller says so). Refuses (ValueError) when no candidate passes the
    bound."""
    ratios: dict[Candidate, float] = {}

    def within_bound(c: Candidate) -> bool:
        if c.is_split:  # pinned (`--quantization SMALL@ROWS+LARGE`): both formats pass
            return all(within_bound(p) for p in c.parts)
        if (c.dtype, c.quantization) == REFERENCE:
            return True
        if c not in ratios:
            ratios[c] = ratio_of(c)
        return ratios[c] <= bound

    answers: dict[Candidate, bool] = {}

    def answers_pass(c: Candidate) -> bool:
        if c not in answers:
            answers[c] = accepts(c)
        return answers[c]

    def passes(c: Candidate) -> bool:
        return row_invariant(c) and within_bound(c) and answers_pass(c)

    def judged(c: Candidate) -> bool:
        return within_bound(c) and answers_pass(c)

    score = scores(ms, weights)
    pool = [c for c in ms if not c.is_split] or list(ms)  # a split only where pinned
    chosen = (
        _best(pool, score, passes) or _best(pool, score, judged) or _best(pool, score, within_bound)
    )
    if chosen is None:
        raise ValueError(
            "no kernel configuration keeps the perplexity within "
            f"{bound}x of fp32's: pin --dtype float32 --quantization none"
        )
    if prefer_dtype is not None and prefer_dtype != chosen.dtype:
        same = passes if passes(chosen) else judged if judged(chosen) else within_bound
        alt = _best([c for c in pool if c.dtype == prefer_dtype], score, same)
        if alt is not None and score[alt] <= score[chosen] * knobs.DTYPE_TIE:
            chosen = alt
    if agreement is not None and passes(chosen):
        near = [c for c in pool if score[c] <= score[chosen] * knobs.FAITHFUL_TIE and passes(c)]
        chosen = max(near, key=lambda c: (agreement(c), -score[c]))
    return chosen, score, ratios


def choose_head(
    ms: Mapping[Candidate, Mapping[int, float]],
    step_ms: Mapping[int, float],
    weights: Mapping[int, float],
    ratio_of: Callable[[Candidate], float],
    rule: Candidate,
    row_invariant: Callable[[Candidate], bool],
    bound: float = knobs.PPL_BOUND,
    accepts: Callable[[Candidate], bool] = lambda c: True,
) -> tuple[Candidate, dict[Candidate, float], dict[Candidate, float]]:
    """The LM head for layers already chosen (with `rule`'s head, which passed the bound with
    them): (the head, the scores at `weights`, the perplexity ratios measured). `ms` holds each
    head format alone at the search's batches, `step_ms` the chosen layers' step with the
    rule's head: a head is scored by the step it makes (the step less the rule's head plus its
    own), so a head's share of a prefill chunk counts for what it is. `ratio_of` gives the
    perplexity of the chosen layers with that head. The best head that computes a row the same
    at every batch (`row_invariant`) and passes the bound; the rule unless another beats it by
    knobs.HEAD_GAIN (or the rule itself fails); the rule where no head passes. Passing is computing
    rows the same at any batch, the perplexity bound and `accepts` (the answer judge), asked in
    that order. At a co-located worker's batches half the weight is the prefill
    chunk, where the head is a small share of the step: even a head much faster at one row
    (fbgemm-int8's against int8's, docs/EXPERIMENTS.md §12) scores only a few percent better."""
    ratios: dict[Candidate, float] = {}

    answers: dict[Candidate, bool] = {}

    def passes(c: Candidate) -> bool:
        if c.is_split or not row_invariant(c):
            return False
        if c != rule:
            if c not in ratios:
                ratios[c] = ratio_of(c)
            if ratios[c] > bound:
                return False
        if c not in answers:
            answers[c] = accepts(c)
        return answers[c]

    body = {r: max(step_ms[r] - ms[rule][r], 0.0) for r in weights}
    steps = {c: {r: body[r] + t[r] for r in weights if r in t} for c, t in ms.items()}
    head_scores = scores(steps, weights)
    best = _best(list(ms), head_scores, passes)
    if best is None or (passes(rule) and head_scores[best] * knobs.HEAD_GAIN >= head_scores[rule]):
        best = rule
    return best, head_scores, ratios
