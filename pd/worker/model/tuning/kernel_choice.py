"""What `--dtype auto` and `--quantization auto` resolve to for one worker: pinned values kept,
the cache (kernel_cache.py) read, else the search measured (kernel_search.py), judged
(row_invariance.py, perplexity.py) and decided (autotune.py) and cached. Workers that share a
machine share one search: the key leaves out the role, and the first to miss measures under a
lock while the others wait and read its result. An explicit `--dtype` with `--quantization
auto` takes the checkpoint's weights dense (`none`): quantized weights only where asked for.
Off a CPU, or with `PD_KERNEL_SEARCH=0`, nothing is measured: auto is the fixed rule (bfloat16
on CUDA and on CPUs with AVX512-BF16/AMX, else float32; weights `none`)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping

import pd.worker.model.tuning.knobs as knobs
from pd.worker.model.config import ModelConfig
from pd.worker.model.device import DTYPES, cpu_has_fast_bf16
from pd.worker.model.kernels import DYNAMIC_INT8
from pd.worker.model.quant import Weight, head_quantization
from pd.worker.model.smooth_quant import SMOOTH_INT8
from pd.worker.model.tuning import kernel_cache
from pd.worker.model.tuning.answer_judge import AnswerJudge
from pd.worker.model.tuning.autotune import (
    REFERENCE,
    Candidate,
    Choice,
    candidates,
    choose,
    choose_head,
    search_batches,
)
from pd.worker.model.tuning.cpu_info import read_cpu_info
from pd.worker.model.tuning.kernel_search import (
    PerplexityJudge,
    formats_here,
    time_candidates,
    time_heads,
)
from pd.worker.model.tuning.perplexity import shipped_text
from pd.worker.model.tuning.row_invariance import batch_rows, head_differs, layers_differ
from pd.worker.model.tuning.search_input import SearchInput

log = logging.getLogger(__name__)

SKIP_ENV = "PD_KERNEL_SEARCH"  # "0" (or off/no/false): auto takes the fixed rule, unmeasured


def search_disabled() -> bool:
    return os.environ.get(SKIP_ENV, "1").strip().lower() in ("0", "off", "no", "false")


def available_bytes() -> float:
    """The memory available now (0 where the OS does not say)."""
    try:
        return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError):
        return 0.0


def layer_formats(formats: list[str]) -> list[str]:
    """The formats auto times for the linear layers: all of `formats` but the plain dynamic int8
    ones where smooth-int8 runs (the same kernel without its rescalings: never within the bound on
    either machine kind measured, and a large share of a search to time and judge:
    docs/EXPERIMENTS.md §14, "The search", and §23); they stay formats of the LM head, judged a row
    or a few at a time."""
    if SMOOTH_INT8 not in formats:
        return formats
    return [q for q in formats if q not in DYNAMIC_INT8]


def fixed_choice(
    dtype: str, quantization: str, device: str, how: str, head: str = "auto"
) -> Choice:
    """The unmeasured rule for whichever of the two is auto (the head: the layers' rule)."""
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" or cpu_has_fast_bf16() else "float32"
    return Choice(dtype, "none" if quantization == "auto" else quantization, how, head=head)


def resolve_kernels(
    inp: SearchInput,
    *,
    config: ModelConfig,
    weights: Mapping[str, Weight],
    encode: Callable[[str], list[int]],  # the model's tokenizer (pd.worker.text is not model's)
    judge_prompts: Callable[[], list[list[int]]] | None = None,
) -> Choice:
    """The worker's (dtype, quantization, LM head), with the figures behind it. Runs torch ops:
    call it on the worker's torch thread, with `inp.threads` its thread count. The head is
    measured when the layers are (`--quantization auto`) and it is not pinned; else it is the
    pinned one, or the layers' rule ("auto"). `judge_prompts`: the answer judge's prompts as
    token ids (answer_judge.py; None: no answer judge, the perplexity bound alone)."""
    dtype, quantization, head = inp.dtype, inp.quantization, inp.lm_head_quantization
    if dtype != "auto" and quantization != "auto":
        return Choice(dtype, quantization, "pinned", head=head)
    if dtype != "auto":  # quantized weights only where asked for
        return Choice(dtype, "none", f"--dtype {dtype}: the checkpoint's weights dense", head=head)
    if inp.device != "cpu":
        return fixed_choice(dtype, quantization, inp.device, f"not measured on {inp.device}", head)
    if search_disabled():
        return fixed_choice(dtype, quantization, inp.device, f"not measured: {SKIP_ENV}=0", head)
    formats = formats_here(config, inp.tp, inp.group_size)
    if inp.compile:  # the runner compiles these only (runner.py)
        formats = [q for q in formats if q in ("none", "int8", "int4")]
    cands = candidates(dtype, quantization, layer_formats(formats))
    if len(cands) == 1:
        return Choice(cands[0].dtype, cands[0].quantization, "the only candidate", head=head)
    key = kernel_cache.cache_key(inp, read_cpu_info())
    with kernel_cache.locked(key):  # a worker beside that is measuring: wait, then read
        hit = kernel_cache.load(key)
        if hit is not None:
            try:
                return _checked(Choice.from_dict(hit, "cache"), cands, formats, head)
            except (KeyError, TypeError, ValueError, AttributeError) as e:
                log.warning("a kernel choice in the cache is unusable (%s): measured again", e)
        choice = _search(
            cands, formats, inp, config, weights, encode,
            measure_head=head == "auto" and quantization == "auto", judge_prompts=judge_prompts,
        )  # fmt: skip
        kernel_cache.store(key, choice.as_dict())
    return choice


def _checked(choice: Choice, cands: list[Candidate], formats: list[str], head: str) -> Choice:
    """A cached choice, if it names a candidate of this search (and a head format this machine
    has, or the pinned one); a ValueError naming what is wrong otherwise (a cache file edited,
    or written by another version: measured again, never a failed start)."""
    if Candidate(choice.dtype, choice.quantization) not in cands:
        raise ValueError(f"{choice.dtype}/{choice.quantization} is not a candidate here")
    heads = {head} if head != "auto" else {"auto", *formats}
    if choice.head not in heads:
        raise ValueError(f"LM head format {choice.head!r} is not one here")
    for table in (choice.ms, choice.head_ms):
        for rows in table.values():
            if not all(type(v) in (int, float) and v >= 0 for v in rows.values()):
                raise ValueError("a step time is not a non-negative number")
    return choice


def _search(
    cands: list[Candidate],
    formats: list[str],
    inp: SearchInput,
    config: ModelConfig,
    weights: Mapping[str, Weight],
    encode: Callable[[str], list[int]],
    measure_head: bool,
    judge_prompts: Callable[[], list[list[int]]] | None = None,
) -> Choice:
    """Judge `cands` for computing a row the same in every batch (row_invariance.py), time
    those that do (all where none does), judge their perplexity best first and choose
    (autotune.choose); then the LM head. A format whose rows differ is never timed: it cannot
    win, and the drop rule would otherwise leave out a slow one that can (int4 at a prefill
    chunk, several times onednn-bf16's: docs/BENCHMARKS.md, "Faithful by default")."""
    tp, group_size, head = inp.tp, inp.group_size, inp.lm_head_quantization
    chunk_size, max_running = inp.chunk_size, inp.max_running
    start = time.perf_counter()
    largest = max(chunk_size, max_running)
    layer_rows = batch_rows(largest, (chunk_size, max_running))
    differs = {
        c: layers_differ(c.dtype, c.quantization, config, tp, group_size, layer_rows) for c in cands
    }
    timed = [c for c in cands if differs[c] is None] or cands
    batches = search_batches(chunk_size, max_running)
    rows = sorted(batches)
    log.info(
        "timing %d kernel configurations at %s rows (--dtype/--quantization auto; %d others "
        "compute a row otherwise in a batch than alone)",
        len(timed),
        ", ".join(map(str, rows)),
        len(cands) - len(timed),
    )
    # the candidates timed side by side hold half the memory available at most (freed when
    # the timing ends)
    ms, _ = time_candidates(
        timed, config, tp, rows, chunk_size, group_size, memory_bytes=available_bytes() / 2
    )
    judge = PerplexityJudge(config, weights, encode(shipped_text()), tp, group_size, encode)

    def row_invariant(c: Candidate) -> bool:
        return differs.get(c, "not measured") is None

    answers = None
    if judge_prompts is not None:
        answers = AnswerJudge(judge_prompts(), judge, chunk_size, row_invariant)

    def accepts(c: Candidate) -> bool:
        """The layers' answers, with a dense head in their dtype when the head is chosen next
        (a lossy head's answers are its own judgement), else with the head they will run."""
        return answers is None or answers.accepts(c, "none" if measure_head else head)

    def agreement(c: Candidate) -> float:
        assert answers is not None
        return answers.agreement(c, "none" if measure_head else head).counted

    chosen, scores, ratios = choose(
        ms, batches, judge.ratio, row_invariant, prefer_dtype=REFERENCE[0], accepts=accepts,
        agreement=None if answers is None else agreement,
    )  # fmt: skip
    if differs.get(chosen) is not None:
        log.warning(
            "no kernel configuration within the perplexity bound computes a row the same in "
            "every batch on this machine: %s (%s), whose answers may change with the load",
            chosen.name,
            differs[chosen],
        )
    choice = Choice(
        chosen.dtype,
        chosen.quantization,
        "measured",
        ms={c.name: dict(t) for c, t in ms.items()},
        scores={c.name: s for c, s in scores.items()},
        perplexity_ratio={c.name: r for c, r in ratios.items()},
        row_differs={c.name: d for c, d in differs.items()},
    )
    if measure_head:
        _measured_head(
            choice, chosen, ms[chosen], formats, config, chunk_size, max_running, judge, answers
        )
    if answers is not None and answers.agreements:
        choice.agreement = {
            f"{c.name}, head {h}": a.counted for (c, h), a in answers.agreements.items()
        }
        choice.agreement_bar = answers.bar()
        choice.judge_s = answers.seconds
    choice.search_s = time.perf_counter() - start
    return choice


def _measured_head(
    choice: Choice,
    layers: Candidate,
    step_ms: Mapping[int, float],
    formats: list[str],
    config: ModelConfig,
    chunk_size: int,
    max_running: int,
    judge: PerplexityJudge,
    answers: AnswerJudge | None = None,
) -> None:
    """The LM head for the chosen layers (`autotune.choose_head`), into `choice`: every format
    in the layers' dtype, the head alone timed at the search's batches, scored by the step it
    makes with the layers (`step_ms`, their step with the rule's head), judged at the decode
    batches (up to `max_running` rows: one a sequence)."""
    rule = Candidate(layers.dtype, head_quantization(layers.quantization, DTYPES[layers.dtype]))
    batches = search_batches(chunk_size, max_running)
    group_size = judge.group_size
    rows = batch_rows(max_running, (max_running,))
    # as for the layers: only heads that compute a row the same in every batch are timed (and
    # the rule, whose time the step was measured with)
    heads = list(dict.fromkeys([*formats, rule.quantization]))
    differs = {q: head_differs(layers.dtype, q, config, group_size, rows) for q in heads}
    timed = [q for q in heads if differs[q] is None or q == rule.quantization]
    ms, _ = time_heads(layers.dtype, timed, config, sorted(batches), chunk_size, group_size)

    def row_invariant(c: Candidate) -> bool:
        return differs[c.quantization] is None

    def accepts(h: Candidate) -> bool:
        return answers is None or answers.accepts(layers, h.quantization)

    head, scores, ratios = choose_head(
        ms, step_ms, batches, lambda h: judge.head_ratio(layers, h), rule, row_invariant,
        accepts=accepts,
    )  # fmt: skip
    if differs[head.quantization] is not None:
        log.warning(
            "no LM head computes a row the same in every batch here: %s",
            differs[head.quantization],
        )
    shown = sorted(scores, key=lambda c: (scores[c], c))[: knobs.SHOWN_HEADS]
    shown += [c for c in (rule, head) if c not in shown]
    choice.head = "auto" if head == rule else head.quantization
    choice.head_ms = {c.quantization: dict(ms[c]) for c in shown}
    choice.head_scores = {c.quantization: scores[c] for c in shown}
    choice.head_perplexity_ratio = {c.quantization: r for c, r in ratios.items()}
    choice.head_row_differs = dict(differs)


__all__ = ["Candidate", "Choice", "SKIP_ENV", "SearchInput", "resolve_kernels"]
