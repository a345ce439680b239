"""The answer judge: whether a kernel configuration answers like the model (issue 40 item 5).

Perplexity averages a text's log-likelihood and missed bf16 + smooth-int8 answering README's
question "L'Étoile, la Cité, ...". This judge looks at answers: on the shipped prompts
(`data/quality_prompts.json`: 64, chat and completion, README's first), fp32's greedy answers
(32 tokens, all prompts decoded at once) are the reference; a configuration's agreement is the
mean number of leading tokens of each answer equal to fp32's. A configuration is accepted when
its agreement is at least bf16 without quantization's (`bfloat16/none`, the plain half-precision
model) less one prompt's worth (32 tokens over 64 prompts: 0.5).

A candidate's tokens are read teacher-forced: each prompt followed by fp32's answer runs as a
prefill, and the leading agreement is the first position where the candidate's most likely token
differs from fp32's. Up to that position the candidate's own greedy answer is fp32's, so the
count is the one a greedy run gives wherever the candidate computes a prompt's row as it
computes a decode step's (exactly so under `--deterministic`; by default up to near-ties), at
the cost of one prefill instead of 32 steps. Each candidate runs the prompts one at a time (a
forward each) and all at once (packed into forwards of a prefill chunk's tokens), and the worse
of the two counts.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, Protocol

import torch

import pd.worker.model.tuning.knobs as knobs
from pd.kvcache.paged_metadata import build_paged_metadata
from pd.worker.model.device import DTYPES
from pd.worker.model.quant import head_quantization
from pd.worker.model.runner import ModelRunner
from pd.worker.model.tuning.autotune import REFERENCE, Candidate
from pd.worker.model.tuning.perplexity import pages_for

log = logging.getLogger(__name__)

BASELINE = Candidate("bfloat16", "none")  # the bar, less one prompt's worth


PROMPTS_ENV = "PD_ANSWER_JUDGE_PROMPTS"  # N of the prompts only: a knob for CI, not a default


def shipped_prompts() -> list[dict[str, Any]]:
    """The judge's prompts: {"kind": "chat", "messages": [...]} or {"kind": "completion",
    "prompt": "..."} (CC0, written for pd); `$PD_ANSWER_JUDGE_PROMPTS` of them spread over the
    set where it is set."""
    data = resources.files("pd.worker.model").joinpath("data/quality_prompts.json").read_text()
    prompts = list(json.loads(data)["prompts"])
    first = os.environ.get(PROMPTS_ENV, "").strip()
    if not first.isdigit() or int(first) >= len(prompts):
        return prompts
    step = len(prompts) / max(1, int(first))  # spread over the set: chat and completion
    return [prompts[int(i * step)] for i in range(max(1, int(first)))]


def prompt_ids(
    encode: Callable[[str], list[int]], render_chat: Callable[[list[dict[str, Any]]], str]
) -> list[list[int]]:
    """The shipped prompts as a worker tokenizes them: a chat under the model's template (the
    last message's text where the model has none), a completion as it is."""
    out = []
    for p in shipped_prompts():
        if p["kind"] == "chat":
            try:
                text = render_chat(p["messages"])
            except ValueError:  # no chat template (ChatTemplateError)
                text = p["messages"][-1]["content"]
        else:
            text = p["prompt"]
        out.append(encode(text))
    return out


def _pack(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Sequences (indices) grouped in order into forwards of at most `budget` tokens (one at
    least)."""
    groups: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(lengths):
        if groups[-1] and used + n > budget:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += n
    return groups


def _pages(lengths: Sequence[int], page_size: int) -> list[list[int]]:
    """Each sequence's own pages, one range after another from page 0."""
    out, start = [], 0
    for n in lengths:
        count = pages_for(n, page_size)
        out.append(list(range(start, start + count)))
        start += count
    return out


def pages_needed(prompts: Sequence[Sequence[int]], page_size: int, tokens: int) -> int:
    return sum(pages_for(len(p) + tokens, page_size) for p in prompts)


@torch.inference_mode()
def greedy_answers(
    runner: ModelRunner, prompts: Sequence[Sequence[int]], tokens: int, chunk: int
) -> list[list[int]]:
    """Every prompt's greedy answer of `tokens` tokens, all decoded at once: the prompts
    prefilled in forwards of at most `chunk` tokens, then one step for all a token."""
    ps = runner.page_size
    pages = _pages([len(p) + tokens for p in prompts], ps)
    answers: list[list[int]] = [[] for _ in prompts]
    for group in _pack([len(p) for p in prompts], chunk):
        meta = build_paged_metadata([(pages[i], 0, len(prompts[i])) for i in group], ps, "cpu")
        ids = torch.tensor([t for i in group for t in prompts[i]], dtype=torch.long)
        last = meta.qo_indptr_host[1:].long() - 1
        for i, t in zip(group, runner.model.forward(ids, meta, last).argmax(-1).tolist()):
            answers[i].append(t)
    rows = torch.arange(len(prompts))
    for _ in range(tokens - 1):
        batch = [(pages[i], len(p) + len(answers[i]) - 1, 1) for i, p in enumerate(prompts)]
        meta = build_paged_metadata(batch, ps, "cpu")
        ids = torch.tensor([a[-1] for a in answers], dtype=torch.long)
        for a, t in zip(answers, runner.model.forward(ids, meta, rows).argmax(-1).tolist()):
            a.append(t)
    return answers


@dataclass(frozen=True)
class Forced:
    """A layers configuration's final hidden states at every answer position, teacher-forced:
    per forward, its rows and the prompts they answer (in order, one row per token of each
    prompt's reference answer)."""

    groups: list[tuple[torch.Tensor, list[int]]]  # ([rows, hidden], prompt indices)


@torch.inference_mode()
def forced_hidden(
    runner: ModelRunner,
    prompts: Sequence[Sequence[int]],
    reference: Sequence[Sequence[int]],
    budget: int,
) -> Forced:
    """Each prompt followed by its reference answer, prefilled in forwards of at most `budget`
    tokens (whole sequences; 0: one sequence a forward): the final norm's output at the rows
    that predict the reference's tokens."""
    ps = runner.page_size
    seqs = [list(p) + list(r[:-1]) for p, r in zip(prompts, reference)]
    pages = _pages([len(s) for s in seqs], ps)
    groups = _pack([len(s) for s in seqs], budget) if budget else [[i] for i in range(len(seqs))]
    model = runner.model
    out = []
    for group in groups:
        meta = build_paged_metadata([(pages[i], 0, len(seqs[i])) for i in group], ps, "cpu")
        ids = torch.tensor([t for i in group for t in seqs[i]], dtype=torch.long)
        starts = meta.qo_indptr_host
        rows = torch.cat(
            [
                torch.arange(len(prompts[i]) - 1, len(seqs[i])) + starts[k]
                for k, i in enumerate(group)
            ]
        )
        angles, kv_rows = model.plan(meta, [rank.attn for rank in model.ranks])
        out.append((model.hidden(ids, angles, kv_rows, None, rows), group))
    return Forced(out)


@torch.inference_mode()
def leading_agreement(
    forced: Forced, head: Callable[[torch.Tensor], torch.Tensor], reference: Sequence[Sequence[int]]
) -> list[int]:
    """Per prompt, how many leading tokens of its reference answer are the most likely ones
    under `head` (applied to each forward's rows together, as a step applies it)."""
    agree = [0] * len(reference)
    for hidden, group in forced.groups:
        best = head(hidden).argmax(-1).tolist()
        at = 0
        for i in group:
            ref = list(reference[i])
            mine = best[at : at + len(ref)]
            at += len(ref)
            agree[i] = next((j for j, (a, b) in enumerate(zip(mine, ref)) if a != b), len(ref))
    return agree


@dataclass(frozen=True)
class Agreement:
    """Mean leading tokens equal to fp32's, the prompts one at a time and all at once."""

    alone: float
    together: float

    @property
    def counted(self) -> float:
        return min(self.alone, self.together)


class Models(Protocol):
    """What the judge builds its models from (kernel_search.PerplexityJudge)."""

    def runner(
        self, c: Candidate, head: str, num_pages: int, max_len: int | None = None
    ) -> ModelRunner: ...

    def head(self, dtype: str, fmt: str) -> Callable[[torch.Tensor], torch.Tensor]: ...


class AnswerJudge:
    """Agreement with fp32's greedy answers on the shipped prompts, per (layers, LM head). The
    layers' hidden states are computed once per configuration and mode; each head is then
    applied to them. The reference and the bar (bf16-none's agreement) are made on first use.
    Where the layers compute a row the same in any batch (`row_invariant`, measured by the row
    judge) the prompts one at a time give the same bits as all at once (a prompt's attention is
    its own SDPA call either way), so they run once."""

    def __init__(
        self,
        prompts: Sequence[Sequence[int]],
        models: Models,
        chunk: int,
        row_invariant: Callable[[Candidate], bool] = lambda c: False,
        tokens: int = knobs.ANSWER_TOKENS,
    ) -> None:
        self.prompts = [list(p) for p in prompts]
        self.models, self.chunk, self.tokens = models, chunk, tokens
        self.row_invariant = row_invariant
        self._reference: list[list[int]] | None = None
        self._forced: dict[Candidate, tuple[Forced, Forced]] = {}
        self.agreements: dict[tuple[Candidate, str], Agreement] = {}
        self.seconds = 0.0  # spent judging, the reference and the bar included

    def _pages(self) -> int:
        return pages_needed(self.prompts, knobs.JUDGE_PAGE_SIZE, self.tokens)

    def reference(self) -> list[list[int]]:
        if self._reference is None:
            t = time.perf_counter()
            runner = self.models.runner(Candidate(*REFERENCE), "none", self._pages())
            self._reference = greedy_answers(runner, self.prompts, self.tokens, self.chunk)
            took = time.perf_counter() - t
            self.seconds += took
            log.info("answer judge: fp32's answers to %d prompts (%.1f s)", len(self.prompts), took)
        return self._reference

    def _hidden(self, layers: Candidate) -> tuple[Forced, Forced]:
        """(alone, all at once)."""
        if layers not in self._forced:
            reference = self.reference()
            runner = self.models.runner(layers, "none", self._pages())
            together = forced_hidden(runner, self.prompts, reference, self.chunk)
            alone = together
            if not self.row_invariant(layers):
                alone = forced_hidden(runner, self.prompts, reference, 0)
            self._forced[layers] = (alone, together)
        return self._forced[layers]

    def agreement(self, layers: Candidate, head: str = "auto") -> Agreement:
        """`layers` with the LM head `head` (auto: their rule)."""
        if head == "auto":
            head = head_quantization(layers.quantization, DTYPES[layers.dtype])
        key = (layers, head)
        if key not in self.agreements:
            t = time.perf_counter()
            alone, together = self._hidden(layers)
            layer = self.models.head(layers.dtype, head)
            reference = self.reference()
            got = Agreement(
                statistics.fmean(leading_agreement(alone, layer, reference)),
                statistics.fmean(leading_agreement(together, layer, reference)),
            )
            took = time.perf_counter() - t
            self.seconds += took
            self.agreements[key] = got
            log.info(
                "answer judge: %s, LM head %s: %.2f leading tokens of fp32's alone, %.2f all at "
                "once (%.1f s)",
                layers.name, head, got.alone, got.together, took,
            )  # fmt: skip
        return self.agreements[key]

    def bar(self) -> float:
        """The least agreement accepted: bf16-none's less one prompt's worth."""
        return self.agreement(BASELINE, "none").counted - self.tokens / len(self.prompts)

    def accepts(self, layers: Candidate, head: str = "auto") -> bool:
        if (layers.dtype, layers.quantization) == REFERENCE and head in ("auto", "none"):
            return True
        return self.agreement(layers, head).counted >= self.bar()
