"""What `--dtype auto` and `--quantization auto` resolve to for one worker: pinned values kept,
the cache (kernel_cache.py) read, else the search measured (kernel_search.py) and decided
(autotune.py) and cached. Off a CPU, or with `PD_KERNEL_SEARCH=0`, nothing is measured: auto
is the fixed rule (bfloat16 on CUDA and on CPUs with AVX512-BF16/AMX, else float32; weights
`none`)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping

import torch

from pd.config import format_at
from pd.worker.model import one_row
from pd.worker.model.tuning import kernel_cache
from pd.worker.model.tuning.autotune import (
    Candidate,
    Choice,
    candidates,
    choose,
    choose_head,
    decision_batches,
    with_splits,
)
from pd.worker.model.config import ModelConfig
from pd.worker.model.cpu_info import read_cpu_info
from pd.worker.model.device import DTYPES, cpu_has_fast_bf16
from pd.worker.model.tuning.kernel_search import (
    PerplexityJudge,
    formats_here,
    time_candidates,
    time_heads,
)
from pd.worker.model.kernels import DYNAMIC_INT8
from pd.worker.model.tuning.perplexity import shipped_text
from pd.worker.model.quant import Weight, head_quantization
from pd.worker.model.smooth_quant import SMOOTH_INT8

log = logging.getLogger(__name__)

SPLITS_SHOWN = 3  # splits in /health and the log beside every single format
SKIP_ENV = "PD_KERNEL_SEARCH"  # "0" (or off/no/false): auto takes the fixed rule, unmeasured


def search_disabled() -> bool:
    return os.environ.get(SKIP_ENV, "1").strip().lower() in ("0", "off", "no", "false")


def available_bytes() -> float:
    """The memory available now (0 where the OS does not say)."""
    try:
        return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError):
        return 0.0


def split_budget_bytes() -> float:
    """What two formats of the weights may hold together (autotune.with_splits): a quarter of
    the memory available now, the rest left to the KV pool and the machine's other workers."""
    return available_bytes() / 4


def layer_formats(formats: list[str]) -> list[str]:
    """The formats auto times for the linear layers: all of `formats` but the plain dynamic
    int8 ones where smooth-int8 runs (the same kernel without its rescalings: 1.6-3.1x fp32's
    perplexity on both machine kinds measured, never within the bound, and ~15 s of a search
    to time and judge); they stay formats of the LM head, judged a row or a few at a time."""
    if SMOOTH_INT8 not in formats:
        return formats
    return [q for q in formats if q not in DYNAMIC_INT8]


# A one-row step compiled in the background (one_row.py) against the same step eager, in the
# server: float32 `int4@1+smooth-int8` under the AVX2 cap 12.57 against 16.91 ms (1.35x);
# bfloat16 `int4@1+onednn-bf16` uncapped 19.9 against 22.3 in the compile's own timing (1.12x).
ONE_ROW_COMPILE_GAIN = 1.3  # between the two, nearer the AVX2 kind where eager costs the most


def with_one_row_compile(
    ms: Mapping[Candidate, Mapping[int, float]], background_compile: str, role: str
) -> dict[Candidate, dict[int, float]]:
    """`ms` with the one-row time of each candidate whose one-row step the worker would compile
    in the background divided by ONE_ROW_COMPILE_GAIN: the search times the linear layers
    eagerly, and the compiled graph also runs the rest of the step (norms, rotary, attention)
    as one. Without it, under the AVX2 cap `int4@1+smooth-int8` scored within 1.4% of
    smooth-int8 alone and lost (a split must win by 5%), and one stream ran at 15.7-17.6 ms a
    step against the compiled split's 12.6."""

    def compiled(quantization: str) -> bool:  # one_row.wanted's rule, for a measured choice
        how = dict(device="cpu", role=role, how="measured", quantization=quantization)
        return background_compile != "off" and one_row.wanted("auto", **how) is not None

    return {
        c: {r: t / ONE_ROW_COMPILE_GAIN if r == 1 else t for r, t in times.items()}
        if compiled(c.quantization)
        else dict(times)
        for c, times in ms.items()
    }


def fixed_choice(
    dtype: str, quantization: str, device: str, how: str, head: str = "auto"
) -> Choice:
    """The unmeasured rule for whichever of the two is auto (the head: the layers' rule)."""
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" or cpu_has_fast_bf16() else "float32"
    return Choice(dtype, "none" if quantization == "auto" else quantization, how, head=head)


def resolve_kernels(
    *,
    dtype: str,
    quantization: str,
    device: str,
    role: str,
    chunk_size: int,
    max_running: int,
    threads: int,
    tp: int,
    group_size: int,
    config: ModelConfig,
    weights: Mapping[str, Weight],
    encode: Callable[[str], list[int]],  # the model's tokenizer (pd.worker.text is not model's)
    digest: str,
    compile: bool = False,
    lm_head_quantization: str = "auto",
    background_compile: str = "off",  # --background-compile: whether a one-row step compiles
) -> Choice:
    """The worker's (dtype, quantization, LM head), with the figures behind it. Runs torch ops:
    call it on the worker's torch thread, with `threads` its thread count. The head is measured
    when the layers are (`--quantization auto`) and it is not pinned; else it is the pinned one,
    or the layers' rule ("auto")."""
    head = lm_head_quantization
    if dtype != "auto" and quantization != "auto":
        return Choice(dtype, quantization, "pinned", head=head)
    if device != "cpu":
        return fixed_choice(dtype, quantization, device, f"not measured on {device}", head)
    if search_disabled():
        return fixed_choice(dtype, quantization, device, f"not measured: {SKIP_ENV}=0", head)
    formats = formats_here(config, tp, group_size)
    if compile:  # the runner compiles these only (runner.py)
        formats = [q for q in formats if q in ("none", "int8", "int4")]
    cands = candidates(dtype, quantization, layer_formats(formats))
    if len(cands) == 1:
        return Choice(cands[0].dtype, cands[0].quantization, "the only candidate", head=head)
    cpu = read_cpu_info()
    key = kernel_cache.cache_key(
        cpu_model=cpu.model,
        cpu_flags=cpu.flags,
        isa_limits=dict(cpu.limits),
        torch=torch.__version__,
        checkpoint=digest,
        role=role,
        chunk_size=chunk_size,
        max_running=max_running,
        threads=threads,
        tp=tp,
        group_size=group_size,
        dtype=dtype,
        quantization=quantization,
        compile=compile,
        lm_head_quantization=head,
        background_compile=background_compile,
    )
    hit = kernel_cache.load(key)
    if hit is not None:
        try:
            return Choice.from_dict(hit, "cache")
        except (KeyError, TypeError, ValueError):
            log.warning("a kernel choice in the cache is unreadable: measured again")
    start = time.perf_counter()
    dtype_w, role_w = decision_batches(role, chunk_size, max_running)
    rows = sorted(set(dtype_w) | set(role_w))
    log.info(
        "timing %d kernel configurations at %s rows (--dtype/--quantization auto)",
        len(cands),
        ", ".join(map(str, rows)),
    )
    # the candidates timed side by side hold half the memory available at most (freed when
    # the timing ends)
    single, nbytes = time_candidates(
        cands, config, tp, rows, chunk_size, group_size, memory_bytes=available_bytes() / 2
    )
    # --compile runs single formats only (runner.py): no splits then
    ms = with_splits(single, nbytes, 0.0 if compile else split_budget_bytes())
    if not compile:
        ms = with_one_row_compile(ms, background_compile, role)
    judge = PerplexityJudge(config, weights, encode(shipped_text()), tp, group_size, encode)
    prefer = "bfloat16" if cpu.native_bf16 else "float32"
    chosen, scores, ratios = choose(ms, dtype_w, role_w, judge.ratio, prefer_dtype=prefer)
    if head == "auto" and quantization == "auto":
        head_ms, head_scores, head_ratios, chosen_head = _measured_head(
            chosen, ms[chosen], formats, config, rows, chunk_size, group_size, role_w, judge
        )
    else:
        head_ms, head_scores, head_ratios, chosen_head = {}, {}, {}, head
    # what /health and the log show: every single format, and the best few splits
    splits = sorted((c for c in ms if c.is_split), key=lambda c: (scores[c], c))
    shown = [c for c in ms if not c.is_split] + [
        c for c in splits if c in splits[:SPLITS_SHOWN] or c == chosen
    ]
    choice = Choice(
        chosen.dtype,
        chosen.quantization,
        "measured",
        ms={c.name: dict(ms[c]) for c in shown},
        scores={c.name: scores[c] for c in shown},
        perplexity_ratio={c.name: r for c, r in ratios.items()},
        search_s=time.perf_counter() - start,
        head=chosen_head,
        head_ms={c.quantization: dict(t) for c, t in head_ms.items() if c in head_scores},
        head_scores={c.quantization: s for c, s in head_scores.items()},
        head_perplexity_ratio={c.quantization: r for c, r in head_ratios.items()},
    )
    kernel_cache.store(key, choice.as_dict())
    return choice


def _measured_head(
    layers: Candidate,
    step_ms: Mapping[int, float],
    formats: list[str],
    config: ModelConfig,
    rows: list[int],
    chunk_size: int,
    group_size: int,
    role_w: Mapping[int, float],
    judge: PerplexityJudge,
) -> tuple[dict[Candidate, dict[int, float]], dict[Candidate, float], dict[Candidate, float], str]:
    """The LM head for the chosen layers (`autotune.choose_head`): every format and split of two
    in the layers' dtype, the head alone timed at the role's batches, scored by the step it
    makes with the layers (`step_ms`, their step with the rule's head); the layers' own head
    (the rule, which passed with them) unless another scores better within the bound. Returns
    (each shown head's ms alone, scores, perplexity ratios measured, the head: "auto" for the
    rule)."""
    rule = Candidate(layers.dtype, head_quantization(layers.quantization, DTYPES[layers.dtype]))
    single, nbytes = time_heads(layers.dtype, formats, config, rows, chunk_size, group_size)
    seen = {chunk_size: 1}  # the head gets one row of a prefill chunk (time_heads times that)
    ms = with_splits(single, nbytes, split_budget_bytes(), seen)
    if rule not in ms:  # a split beyond the memory budget: its parts' times
        ms[rule] = {
            r: single[Candidate(rule.dtype, format_at(rule.quantization, seen.get(r, r)))][r]
            for r in rows
        }
    head, head_scores, ratios = choose_head(
        ms, step_ms, role_w, lambda h: judge.head_ratio(layers, h), rule
    )
    shown = sorted(head_scores, key=lambda c: (head_scores[c], c))[: SPLITS_SHOWN * 2]
    shown += [c for c in (rule, head) if c not in shown]
    return (
        {c: ms[c] for c in shown},
        {c: head_scores[c] for c in shown},
        ratios,
        "auto" if head == rule else head.quantization,
    )


__all__ = ["Candidate", "Choice", "SKIP_ENV", "resolve_kernels"]
