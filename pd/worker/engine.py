"""The engine loop: admit -> schedule -> run (off the event loop) -> process results.

One asyncio task drives it. The forward pass and sampling run in a dedicated executor thread, so
the event loop keeps serving HTTP (and `/health`) while a long prefill computes. Requests talk to
the engine through `RequestHandle`s: an asyncio queue of `Delta`s per request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from pd.protocol import APIError, WorkerLoad
from pd.transfer import KVPoll, KVReceiver
from pd.worker.detokenizer import IncrementalDetokenizer
from pd.worker.model_runner import ModelRunner
from pd.worker.sampling import SampleOutput
from pd.worker.sampling_params import SamplingParams
from pd.worker.scheduler import ScheduledBatch, Scheduler
from pd.worker.sequence import SeqStatus, Sequence
from pd.worker.stop import StopChecker

log = logging.getLogger(__name__)


@dataclass
class Delta:
    """New output of one request since the previous delta."""

    text: str
    token_ids: list[int]
    logprobs: list[tuple[int, float, list[tuple[int, float]] | None]]  # (id, logprob, top)
    finish_reason: str | None = None  # "stop" | "length" | "error"
    error: APIError | None = None  # with finish_reason "error": what the client is answered


@dataclass(eq=False)
class RequestHandle:
    seq: Sequence
    detok: IncrementalDetokenizer
    stop: StopChecker
    queue: asyncio.Queue[Delta] = field(default_factory=asyncio.Queue)
    receiver: KVReceiver | None = None  # decode role: the pull of this request's KV
    kv_transfer_params: dict[str, Any] | None = None  # prefill role: what D needs, once handed off

    @property
    def finished(self) -> bool:
        return self.seq.is_finished


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        tokenizer,
        *,
        role: str,
        max_model_len: int,
        max_waiting: int,
        metrics=None,
    ) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.role = role
        self.max_model_len = max_model_len
        self.max_waiting = max_waiting
        self.metrics = metrics
        self.handles: dict[str, RequestHandle] = {}
        # Prefill role: pins a prefilled request's pages for D; returns its kv_transfer_params.
        self.hand_off: Callable[[Sequence, list], dict[str, Any]] | None = None
        self._ids = itertools.count()
        self._wakeup: asyncio.Event | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._task: asyncio.Task | None = None
        self._step_seqs: frozenset[Sequence] = frozenset()  # in the forward pass running now
        self._deferred: list[tuple[Sequence, str]] = []  # finished during it: freed after it
        self.steps = 0

    # ----------------------------------------------------------------------------- requests

    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, remote_decode: bool = False
    ) -> RequestHandle:
        """Queue a request; raises APIError (400 too long, 503 queue full or not running)."""
        handle = self._new_handle(prompt_ids, params)
        handle.seq.remote_decode = remote_decode
        self.scheduler.add(handle.seq)
        self._wakeup.set()
        return handle

    def add_pulled(
        self,
        prompt_ids: list[int],
        first_token: int,
        params: SamplingParams,
        rx: KVReceiver,
        first_logprobs: list | None = None,
    ) -> RequestHandle:
        """Decode role: a request whose KV is being pulled; its first token (sampled by P, with
        P's `[logprob, top]` when asked for) is emitted at once. It joins the batch through
        `admit_pulled` when the pull succeeds."""
        handle = self._new_handle(prompt_ids, params)
        handle.seq.status = SeqStatus.TRANSFERRING
        handle.receiver = rx
        logprobs = []
        if params.wants_logprobs and first_logprobs:
            lp, top = first_logprobs
            logprobs.append((first_token, lp, [tuple(t) for t in top or []]))
        self._accept(handle, first_token, logprobs, time.monotonic())
        return handle

    def admit_pulled(self, handle: RequestHandle, key: str) -> None:
        seq = handle.seq
        seq.num_computed = len(seq.prompt_ids)
        self.scheduler.admit_pulled(seq, key)
        self._wakeup.set()

    def _new_handle(self, prompt_ids: list[int], params: SamplingParams) -> RequestHandle:
        if self._wakeup is None:
            raise APIError(503, "the engine is not running", "server_busy", "not_ready")
        if len(self.scheduler.waiting) >= self.max_waiting:
            raise APIError(
                503,
                "the worker's request queue is full; retry later",
                "server_busy",
                "queue_full",
                headers={"Retry-After": "1"},
            )
        self.check_fits(len(prompt_ids), params.max_tokens)
        request_id = f"req-{next(self._ids)}"
        handle = RequestHandle(
            Sequence(request_id, prompt_ids, params),
            IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens),
            StopChecker(params.stop),
        )
        self.handles[request_id] = handle
        return handle

    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        if prompt_len >= self.max_model_len:
            raise APIError(
                400,
                f"the prompt has {prompt_len} tokens but this model's context length is "
                f"{self.max_model_len}: shorten it",
                code="context_length_exceeded",
                param="messages",
            )
        pages = -(-(prompt_len + max_tokens) // self.scheduler.page_size)
        if pages > self.scheduler.allocator.num_total:
            raise APIError(
                400,
                f"prompt + max_tokens ({prompt_len + max_tokens} tokens) exceed this worker's "
                f"KV cache ({self.scheduler.allocator.num_total * self.scheduler.page_size} tokens)",
                code="context_length_exceeded",
            )

    def abort(self, handle: RequestHandle) -> None:
        """Stop a request (client gone). Its pages are freed at once, or, when the step that
        computes it is running, as soon as that step ends (decode role: once the pull stopped)."""
        if not handle.finished:
            self._release(handle.seq, "abort")
            if self.metrics:
                self.metrics.aborted.inc()
        rx = handle.receiver
        if rx is not None and rx.poll() not in (KVPoll.Success, KVPoll.Failed):
            rx.abort("the client left")
        self.handles.pop(handle.seq.request_id, None)

    def fail(self, handle: RequestHandle, error: APIError) -> None:
        """End a request with an error (its pages are freed; see `abort` for a step in flight)."""
        self._release(handle.seq, "error")
        self.handles.pop(handle.seq.request_id, None)
        handle.queue.put_nowait(Delta("", [], [], "error", error))

    def _release(self, seq: Sequence, reason: str) -> None:
        if seq in self._step_seqs:  # NOTE: the forward pass may still write into its pages
            self._deferred.append((seq, reason))
        else:
            self.scheduler.finish(seq, reason)

    def load(self) -> WorkerLoad:
        alloc = self.scheduler.allocator
        return WorkerLoad(
            role=self.role,
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            queued_prefill_tokens=self.scheduler.queued_prefill_tokens,
            kv_pages_total=alloc.num_total,
            kv_pages_free=alloc.num_free,
            inflight_transfers=len(self.scheduler.held),
            kv_pages_held=sum(map(len, self.scheduler.held.values())),
        )

    @property
    def idle(self) -> bool:
        return not self.scheduler.has_work and not self.scheduler.held

    # ----------------------------------------------------------------------------- the loop

    def start(self) -> None:
        """Start the loop task on the running event loop (again after `stop`, e.g. in tests)."""
        self._wakeup = asyncio.Event()
        # The forward thread uses as many torch threads as the process was given (--threads).
        self._executor = ThreadPoolExecutor(
            1,
            thread_name_prefix="pd-forward",
            initializer=torch.set_num_threads,
            initargs=(torch.get_num_threads(),),
        )
        self._task = asyncio.get_running_loop().create_task(self._run(), name="pd-engine")

    async def stop(self) -> None:
        """Stop the loop; requests still queued are failed (their pages freed)."""
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self._executor:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._wakeup = None  # new requests are refused (503) until start() again
        self._fail_all("the worker is stopping")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.scheduler.has_work:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            try:
                await self.step(loop)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a failed step fails its requests, not the worker
                log.exception("engine step failed")
                self._fail_all(f"internal error in the engine step: {e}")

    async def step(self, loop: asyncio.AbstractEventLoop) -> None:
        batch = self.scheduler.schedule()
        if self.metrics and batch.preempted:
            self.metrics.preemptions.inc(len(batch.preempted))
        if not batch.seqs:
            # Nothing fits right now (every page is held); cannot happen while requests run.
            await asyncio.sleep(0.005)
            return
        self._step_seqs = frozenset(batch.seqs)
        try:
            out = await loop.run_in_executor(self._executor, self.runner.execute, batch)
        finally:
            self._step_seqs = frozenset()
            for seq, reason in self._deferred:
                self.scheduler.finish(seq, reason)
            self._deferred.clear()
        self.steps += 1
        self.scheduler.advance(batch)
        self._process(batch, out)

    def _process(self, batch: ScheduledBatch, out: SampleOutput) -> None:
        now = time.monotonic()
        sampled = [s for s, flag in zip(batch.seqs, batch.sample) if flag]
        for row, seq in enumerate(sampled):
            handle = self.handles.get(seq.request_id)
            if handle is None or seq.is_finished:  # aborted while the step ran
                continue
            token = out.token_ids[row]
            logprobs = []
            if seq.params.wants_logprobs:
                logprobs.append((token, out.logprobs[row], out.top_logprobs[row]))
            self._accept(handle, token, logprobs, now)

    def _observe(self, seq: Sequence, now: float) -> None:
        m = self.metrics
        if seq.first_token_time is None:
            seq.first_token_time = now
            m.ttft.observe(now - seq.arrival_time)
        else:
            m.itl.observe(now - seq.last_token_time)
        seq.last_token_time = now
        m.generation_tokens.inc()

    def _accept(self, handle: RequestHandle, token: int, logprobs: list, now: float) -> None:
        """Append a sampled token, check the stop conditions, and queue the request's delta."""
        seq, params = handle.seq, handle.seq.params
        if self.metrics:
            self._observe(seq, now)
        seq.output_ids.append(token)
        finish = None
        if token in params.stop_token_ids or (
            not params.ignore_eos and token in self.tokenizer.eos_token_ids
        ):
            finish, text = "stop", self._tail(handle)[0]  # the stop token's text is not shown
        else:
            text, stopped = handle.stop.add(handle.detok.add(token))
            if stopped:
                finish = "stop"
            elif len(seq.output_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
                tail, stopped = self._tail(handle)
                finish, text = ("stop" if stopped else "length"), text + tail
        error = self._finish(handle, finish, logprobs) if finish else None
        if error is not None:
            handle.queue.put_nowait(Delta("", [], [], "error", error))
        else:
            handle.queue.put_nowait(Delta(text, [token], logprobs, finish))

    def _finish(self, handle: RequestHandle, reason: str, logprobs: list) -> APIError | None:
        """Finish a request (prefill role: hand its pages to a decode worker instead)."""
        seq = handle.seq
        error = None
        if reason == "length" and seq.remote_decode and self.hand_off is not None:
            try:
                handle.kv_transfer_params = self.hand_off(seq, logprobs)
            except Exception as e:  # answered as a 5xx, so the router retries or reports it
                log.exception("cannot hand %s to a decode worker", seq.request_id)
                error = APIError(
                    503,
                    f"cannot hand the KV to a decode worker: {e}",
                    "server_busy",
                    "kv_hand_off_failed",
                )
        self.scheduler.finish(seq, "error" if error else reason)  # no-op once handed off
        if self.metrics:
            self.metrics.e2e.observe(time.monotonic() - seq.arrival_time)
        self.handles.pop(seq.request_id, None)
        return error

    @staticmethod
    def _tail(handle: RequestHandle) -> tuple[str, bool]:
        """Text still held by the detokenizer and the stop checker at the end of a request, and
        whether it completed a stop string."""
        text, stopped = handle.stop.add(handle.detok.flush())
        return (text, True) if stopped else (text + handle.stop.flush(), False)

    def _fail_all(self, message: str) -> None:
        for handle in list(self.handles.values()):
            self.fail(handle, APIError(500, message, "internal_error"))
