"""Postprocess: the stage after the forward pass. It alone changes a request's outputs; it never
ends a request itself: it returns the requests that finished, and the engine ends them.

For each sampled token: append it (`append_token`, the one place a token joins its request),
check whether the token ends the request whatever its text (a stop token id, EOS, max_tokens, the
context), detokenize it and check stop strings (`_emit`), and queue the request's `Delta`. A
request that finished comes back as `Finished` with its last delta: the engine frees its pages
(or, on a prefill worker, hands them to a decode worker), forgets it, and then queues that delta.

It runs in two phases, so that the engine can overlap the second with the next forward pass
(overlap scheduling):

1. `accept_tokens`, before the next step is scheduled: every sampled token is appended (the next
   step computes it). A request that ends on the token itself is returned finished here, so the
   engine ends it before the next step is scheduled and no later step computes for it.
2. `emit_text`: detokenize and check stop strings for the others, and queue their deltas. With
   overlap on, this runs while the next step computes, and a request a stop string ends here
   is in that step: the engine frees its pages when the step ends, and the extra token the step
   sampled for it is dropped (the request is finished by then).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from pd.worker.engine.batch import ScheduledBatch
from pd.worker.engine.request import Delta, LogprobEntry, RequestHandle, Sequence
from pd.worker.metrics import WorkerMetrics
from pd.worker.model.sampler import SampleOutput
from pd.worker.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class PendingText(NamedTuple):
    """A token appended to its request whose text `emit_text` has still to produce."""

    handle: RequestHandle
    token: int
    logprobs: list[LogprobEntry]


@dataclass
class Finished:
    """A request its last token or its text ended; the engine ends it, then queues `last`."""

    handle: RequestHandle
    last: Delta  # finish_reason "stop" or "length"


class OutputProcessor:
    def __init__(
        self, tokenizer: Tokenizer, *, max_model_len: int, metrics: WorkerMetrics | None
    ) -> None:
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids)
        self.max_model_len = max_model_len
        self.metrics = metrics

    @staticmethod
    def accept_prompt_logprobs(batch: ScheduledBatch, out: SampleOutput) -> None:
        """Add the step's prompt logprobs to their requests (before their tokens: the first
        token's delta finds them complete). A request recomputed after a preemption gets the
        same entries again: they replace those from its position on."""
        for i, first, entries in out.prompt_logprobs:
            seq = batch.seqs[i]
            if seq.is_finished:
                continue
            acc = seq.prompt_logprobs
            if first <= len(acc):  # a new list: whoever reads the old one (an answer being
                seq.prompt_logprobs = acc[:first] + entries  # rendered) reads it whole

    def accept_tokens(
        self, handles: list[RequestHandle | None], out: SampleOutput
    ) -> tuple[list[PendingText], list[Finished]]:
        """Phase 1: append the step's sampled tokens, row i of `out` to `handles[i]` (None, or
        finished: it ended while the step ran). Returns the requests whose text `emit_text` has
        still to produce, and those their token ended (their last delta is not queued yet)."""
        now = time.monotonic()
        pending, finished = [], []
        for row, handle in enumerate(handles):
            if handle is None or handle.finished:
                continue
            token = out.token_ids[row]
            if handle.seq.max_tokens == 0:  # echo with max_tokens 0: the prompt alone (the
                finished.append(Finished(handle, Delta("", [], [], "length")))  # token dropped)
                continue
            logprobs: list[LogprobEntry] = []
            if handle.seq.params.wants_logprobs:
                lp = out.logprobs[row]
                assert lp is not None  # the sampler fills it for rows that ask
                logprobs.append((token, lp, out.top_logprobs[row]))
            ends = self.append_token(handle, token, now)
            if ends is None:
                pending.append(PendingText(handle, token, logprobs))
            else:
                done = self._emit(handle, token, logprobs, ends)
                assert done is not None  # a token that ends the request finishes it
                finished.append(done)
        return pending, finished

    def emit_text(self, pending: list[PendingText]) -> list[Finished]:
        """Phase 2: the text of tokens `accept_tokens` left, stop strings, and the deltas; returns
        the requests a stop string ended (their last delta is not queued yet)."""
        finished = []
        for handle, token, logprobs in pending:
            if (done := self._emit(handle, token, logprobs, None)) is not None:
                finished.append(done)
        return finished

    def accept(
        self, handle: RequestHandle, token: int, logprobs: list[LogprobEntry], now: float
    ) -> Finished | None:
        """Both phases for one token (one sampled elsewhere)."""
        return self._emit(handle, token, logprobs, self.append_token(handle, token, now))

    def prime(self, handle: RequestHandle, given: list[int]) -> str | None:
        """A continuation (docs/migration.md §3): take `given` as outputs another worker
        generated, as if they had been sampled here, without emitting anything: the request's
        rules (grammar) advance by each, the detokenizer and the stop checker end up where the
        first worker's were (the text they held back stays held), and `handle.given_text` is
        the text its client was shown. Returns why the given outputs end the request already
        ("stop" or "length"; then nothing more is sampled), or None."""
        seq = handle.seq
        assert not seq.output_ids, "a continuation starts with its given outputs"
        ends: str | None = None
        shown: list[str] = []
        for token in given:
            seq.output_ids.append(token)
            if self._stops(seq, token):
                ends = "stop"
            text, stopped = handle.stop.add(handle.detok.add(token))
            shown.append(text)
            if stopped:
                ends = "stop"
        seq.num_given = len(given)
        handle.given_text = "".join(shown)
        if ends is None and (after := self._ends_after(seq)) is not None:
            ends = "stop" if after == "complete" else after
        return ends

    def append_token(self, handle: RequestHandle, token: int, now: float) -> str | None:
        """Append a sampled token to its request: the one place a token joins a request, once
        per token and in order (a token sampled elsewhere included). Returns why the token ends
        the request whatever its text: "stop" (a stop token id, or EOS: its text is not shown),
        "complete" (its grammar allows nothing more: a stop, its text shown), "length"
        (max_tokens, or the context is full), or None (its text may still end it: `_emit`)."""
        seq = handle.seq
        if self.metrics:
            self._observe(handle, now)
        seq.output_ids.append(token)
        return "stop" if self._stops(seq, token) else self._ends_after(seq)

    # The stop rule, in two halves: what a token says (`_stops`), then the request's state after
    # it (`_ends_after`). Sampled tokens and a continuation's given ones both go through it.

    def _stops(self, seq: Sequence, token: int) -> bool:
        """Whether `token`, just appended, is a stop whose text is not shown: a stop token id,
        EOS, or one its rules refuse. Its rules (grammar) advance by it here, before the next
        step is scheduled, so its mask for that step is ready when the forward thread asks."""
        params = seq.params
        if seq.rules is not None and not seq.rules.accept(token):  # never, with the mask applied
            log.warning("%s: its grammar refused token %d", seq.request_id, token)
            return True
        return token in params.stop_token_ids or (
            not params.ignore_eos and token in self.eos_token_ids
        )

    def _ends_after(self, seq: Sequence) -> str | None:
        """Whether the request is done after its last token: "complete" (its grammar allows
        nothing but EOS), "length" (max_tokens, or the context is full), or None."""
        if seq.rules is not None and seq.rules.complete:
            return "complete"
        if len(seq.output_ids) >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _emit(
        self, handle: RequestHandle, token: int, logprobs: list[LogprobEntry], ends: str | None
    ) -> Finished | None:
        """Detokenize the appended token and check stop strings; queue the delta, or return it
        with the request when the request finished (`ends`: what `append_token` said)."""
        finish: str | None
        if ends == "stop":
            finish, text = "stop", _tail(handle)[0]  # the stop token's text is not shown
        else:
            text, stopped = handle.stop.add(handle.detok.add(token))
            finish = "stop" if stopped else ends
            if finish in ("length", "complete"):  # the token's text shows, and what is held
                tail, stopped = _tail(handle)
                finish = "stop" if stopped or finish == "complete" else "length"
                text += tail
        delta = Delta(text, [token], logprobs, finish)
        if finish is not None:
            return Finished(handle, delta)
        handle.queue.put_nowait(delta)
        return None

    def _observe(self, handle: RequestHandle, now: float) -> None:
        seq, m = handle.seq, self.metrics
        assert m is not None
        if seq.first_token_time is None:
            seq.first_token_time = now
            m.ttft.observe(now - seq.arrival_time)
        elif seq.last_token_time is not None:
            m.itl.observe(now - seq.last_token_time)
            if seq.times is not None:
                seq.times.gaps.append(now - seq.last_token_time)
        seq.last_token_time = now
        m.generation_tokens.inc()


def _tail(handle: RequestHandle) -> tuple[str, bool]:
    """Text still held by the detokenizer and the stop checker at the end of a request, and
    whether it completed a stop string."""
    text, stopped = handle.stop.add(handle.detok.flush())
    return (text, True) if stopped else (text + handle.stop.flush(), False)


def first_logprobs(raw: Iterable | None, token: int) -> list[LogprobEntry]:
    """P's `[logprob, [[id, logprob], ...]]` for the first token (from kv_transfer_params) as
    an entry list."""
    if not raw:
        return []
    lp, top = raw
    return [(token, lp, [(int(t), float(v)) for t, v in top or []])]
