"""Postprocess: the stage after the forward pass. It alone changes a request's outputs.

For each sampled token: append it, record latency metrics, detokenize, check the stop conditions
(stop token ids, EOS, stop strings, max_tokens, the context), and queue the request's `Delta`.
A finished request leaves the scheduler (its pages are freed) or, when it asked for remote
decode, is handed to the prefill role's `hand_off` (its pages stay pinned for D).

It runs in two phases, so that the engine can overlap the second with the next forward pass
(overlap scheduling):

1. `accept_tokens`, before the next step is scheduled: every sampled token is appended (the next
   step computes it). A request that ends on the token itself (a stop token, EOS, max_tokens,
   the context) is finished here, wholly, so no later step computes for it.
2. `emit_text`: detokenize and check stop strings for the others, and queue their deltas. With
   overlap on, this runs while the next step computes, and a request a stop string ends here
   is in that step: the engine frees its pages when the step ends, and the extra token the step
   sampled for it is dropped (the request is finished by then).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from pd.protocol import APIError
from pd.worker.engine.batch import ScheduledBatch
from pd.worker.engine.hooks import RoleHooks
from pd.worker.engine.request import Delta, LogprobEntry, RequestHandle, Sequence
from pd.worker.engine.scheduler import Scheduler
from pd.worker.metrics import WorkerMetrics
from pd.worker.model.sampler import SampleOutput
from pd.worker.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# A sampled token appended to its request whose text `emit_text` has still to produce.
PendingText = tuple[RequestHandle, int, list[LogprobEntry]]


class OutputProcessor:
    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: Tokenizer,
        handles: dict[str, RequestHandle],  # the engine's live requests; finished ones leave it
        *,
        max_model_len: int,
        hooks: RoleHooks | None,
        metrics: WorkerMetrics | None,
        release: Callable[[Sequence, str], None] | None = None,
    ) -> None:
        self.scheduler = scheduler
        # Ends a request and frees its pages: the engine's, which waits for a step in flight
        # that computes the request (overlap); by default the scheduler's, at once.
        self.release = release or scheduler.finish
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids)
        self.handles = handles
        self.max_model_len = max_model_len
        self.hooks = hooks
        self.metrics = metrics

    def process(self, batch: ScheduledBatch, out: SampleOutput) -> None:
        """Both phases at once (no overlap)."""
        self.emit_text(self.accept_tokens(batch, out))

    def accept_tokens(self, batch: ScheduledBatch, out: SampleOutput) -> list[PendingText]:
        """Phase 1: append the step's sampled tokens (rows of `out`, in `batch.sampled` order)
        and finish the requests that end on their token; returns the rest for `emit_text`."""
        now = time.monotonic()
        pending = []
        for row, seq in enumerate(batch.sampled):
            handle = self.handles.get(seq.request_id)
            if handle is None or seq.is_finished:  # aborted while the step ran
                continue
            token = out.token_ids[row]
            logprobs: list[LogprobEntry] = []
            if seq.params.wants_logprobs:
                lp = out.logprobs[row]
                assert lp is not None  # the sampler fills it for rows that ask
                logprobs.append((token, lp, out.top_logprobs[row]))
            self._append(handle, token, now)
            if self._ends_on_token(handle, token):
                self._emit(handle, token, logprobs)
            else:
                pending.append((handle, token, logprobs))
        return pending

    def emit_text(self, pending: list[PendingText]) -> None:
        """Phase 2: the text of tokens `accept_tokens` left, stop strings, and the deltas."""
        for handle, token, logprobs in pending:
            if self.handles.get(handle.seq.request_id) is handle:  # not aborted meanwhile
                self._emit(handle, token, logprobs)

    def accept(
        self, handle: RequestHandle, token: int, logprobs: list[LogprobEntry], now: float
    ) -> None:
        """Append a sampled token, check the stop conditions, and queue the request's delta."""
        self._append(handle, token, now)
        self._emit(handle, token, logprobs)

    def _append(self, handle: RequestHandle, token: int, now: float) -> None:
        if self.metrics:
            self._observe(handle, now)
        handle.seq.output_ids.append(token)

    def _ends_on_token(self, handle: RequestHandle, token: int) -> bool:
        """Whether the request ends with the token just appended, whatever its text."""
        seq, params = handle.seq, handle.seq.params
        return (
            token in params.stop_token_ids
            or (not params.ignore_eos and token in self.eos_token_ids)
            or len(seq.output_ids) >= seq.max_tokens
            or seq.num_tokens >= self.max_model_len
        )

    def _emit(self, handle: RequestHandle, token: int, logprobs: list[LogprobEntry]) -> None:
        """Detokenize the appended token, check the stop conditions, and queue the delta."""
        seq, params = handle.seq, handle.seq.params
        finish = None
        if token in params.stop_token_ids or (
            not params.ignore_eos and token in self.eos_token_ids
        ):
            finish, text = "stop", _tail(handle)[0]  # the stop token's text is not shown
        else:
            text, stopped = handle.stop.add(handle.detok.add(token))
            if stopped:
                finish = "stop"
            elif len(seq.output_ids) >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
                tail, stopped = _tail(handle)
                finish, text = ("stop" if stopped else "length"), text + tail
        error = self._finish(handle, finish, logprobs) if finish else None
        if error is not None:
            handle.queue.put_nowait(Delta("", [], [], "error", error))
        else:
            handle.queue.put_nowait(Delta(text, [token], logprobs, finish))

    def _observe(self, handle: RequestHandle, now: float) -> None:
        seq, m = handle.seq, self.metrics
        assert m is not None
        if seq.first_token_time is None:
            seq.first_token_time = now
            m.ttft.observe(now - seq.arrival_time)
        elif seq.last_token_time is not None:
            m.itl.observe(now - seq.last_token_time)
        seq.last_token_time = now
        m.generation_tokens.inc()

    def _finish(
        self, handle: RequestHandle, reason: str, logprobs: list[LogprobEntry]
    ) -> APIError | None:
        """Finish a request (prefill role: hand its pages to a decode worker instead)."""
        seq = handle.seq
        error = None
        if reason == "length" and seq.remote_decode and self.hooks is not None:
            try:
                handle.kv_transfer_params = self.hooks.hand_off(
                    seq, logprobs[0] if logprobs else None
                )
            except Exception as e:  # answered as a 5xx, so the router retries or reports it
                log.exception("cannot hand %s to a decode worker", seq.request_id)
                error = APIError(
                    503,
                    f"cannot hand the KV to a decode worker: {e}",
                    "server_busy",
                    "kv_hand_off_failed",
                )
        self.release(seq, "error" if error else reason)  # no-op once handed off
        if self.metrics:
            self.metrics.e2e.observe(time.monotonic() - seq.arrival_time)
        self.handles.pop(seq.request_id, None)
        return error


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
