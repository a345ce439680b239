"""The engine loop: one step = schedule -> execute -> postprocess.

One asyncio task drives it. The forward pass and sampling run in a dedicated executor thread, so
the event loop keeps serving HTTP (and `/health`) while a long prefill computes. Requests talk to
the engine through `RequestHandle`s: an asyncio queue of `Delta`s per request.

Who ends a request: the engine alone. Postprocess returns the requests that finished; the engine
frees their pages (or lends them to the connector), forgets their handles, and queues
their last delta. The scheduler allocates and frees pages; a request that ends while the step
that computes it runs (abort, error, a stop string found while the next step computes) is freed
when that step ends, since the forward pass may still write into its pages.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Protocol

import torch

from pd.protocol import APIError, WorkerLoad, bad_request
from pd.worker.engine.admission import Capacity
from pd.worker.engine.admit_request import AdmitRequest
from pd.worker.engine.batch import ScheduledBatch
from pd.worker.engine.connector import FirstToken, KVConnector, LentPages
from pd.worker.engine.fork import choice_options
from pd.worker.engine.postprocess import Finished, OutputProcessor, PendingText, first_logprobs
from pd.worker.engine.request import Delta, RequestHandle, SeqStatus, Sequence, Timeline
from pd.worker.engine.scheduler import Scheduler
from pd.worker.engine.step_log import StepLog
from pd.worker.metrics import WorkerMetrics
from pd.worker.model.runner import StepBatch
from pd.worker.model.sampler import SampleOutput
from pd.worker.model.torch_thread import DEFAULT_THREADS
from pd.worker.text.detokenizer import IncrementalDetokenizer
from pd.worker.text.stop import StopChecker
from pd.worker.text.token_rules import TokenRules
from pd.worker.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

NOTHING_FITS_WAIT_S = 0.005  # every page held outside the batch: look again after this


class StepExecutor(Protocol):
    """Computes one step (the `ModelRunner`; tests pass stand-ins)."""

    def execute(self, batch: StepBatch) -> SampleOutput: ...


class Engine:
    def __init__(
        self,
        runner: StepExecutor,
        scheduler: Scheduler,
        tokenizer: Tokenizer,
        *,
        max_model_len: int,
        max_waiting: int,
        connector: KVConnector | None = None,
        metrics: WorkerMetrics | None = None,
        executor: Executor | None = None,
        overlap: bool = True,
    ) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_waiting = max_waiting
        self.metrics = metrics
        self.trace_times = False  # keep each request's Timeline (the worker exports traces)
        self.capacity = Capacity(max_model_len, scheduler.page_size, scheduler.cache.num_total)
        # Whether KV comes from or goes to other workers (connector.py): `connect` plugs it in
        self.connector = connector or KVConnector("")
        self.handles: dict[str, RequestHandle] = {}  # live requests: the engine alone pops them
        self.postprocess = OutputProcessor(tokenizer, max_model_len=max_model_len, metrics=metrics)
        # Overlap scheduling: the text of step N's tokens is produced while step N + 1 computes.
        self.overlap = overlap
        self._pending_text: list[PendingText] = []  # step N's, until step N + 1 is submitted
        self._ids = itertools.count()
        self._wakeup: asyncio.Event | None = None
        # The thread forward passes run on: the worker's torch thread (see torch_thread.py), or
        # one of the engine's own from start() to stop().
        self._given_executor = executor
        self._executor: Executor | None = None
        self._task: asyncio.Task | None = None
        self._step_seqs: frozenset[Sequence] = frozenset()  # in the forward pass running now
        self._deferred: list[tuple[Sequence, str]] = []  # ended during it: freed after it
        self.steps = 0
        self.step_log = StepLog()  # what the steps cost: the planner's fits (`GET /steps`)
        self._last_walk = "ok"  # the last full integrity walk's result

    @property
    def lent_pages(self) -> LentPages:
        """The pages the engine lends its connector by key (connector.py)."""
        return self.scheduler

    def give_back(self, key: str) -> None:
        """Free the pages lent under `key` (idempotent); the connector's waiters may fit now."""
        self.scheduler.give_back(key)
        self.connector.pages_freed()

    def connect(self, connector: KVConnector) -> None:
        """Plug in the worker's connector (once, before requests come)."""
        assert type(self.connector) is KVConnector, "one connector per engine"
        self.connector = connector

    # ----------------------------------------------------------------------------- requests

    def add(self, request: AdmitRequest) -> RequestHandle:
        """Queue a request; raises APIError (400 too long, 503 queue full or not running). Its
        other choices (n > 1: `handle.forks`) fork from it (fork.py). A continuation's ids are
        taken as its first outputs (postprocess `prime`) and prefilled after the prompt. A
        request whose KV comes from elsewhere (`KVConnector.waits_for_kv`) is queued for
        nothing: its tokens sampled elsewhere come through `accept_token`, and it joins the batch
        when its KV arrived (`kv_arrived`)."""
        elsewhere = self.connector.waits_for_kv(request)
        status = SeqStatus.WAITING_FOR_KV if elsewhere else SeqStatus.WAITING
        given = list(request.continuation) if request.continuation is not None else None
        handle = self._new_handle(request, status, given)
        seq = handle.seq
        seq.cache_salt = request.cache_salt
        if elsewhere:
            seq.num_cached_tokens = request.cached_tokens
        if given is not None:
            if request.budget_past_continuation:
                seq.max_tokens += len(given)
            if (ends := self.postprocess.prime(handle, given)) is not None:
                if elsewhere:  # its source sampled past them: it should not have been sent
                    self.handles.pop(seq.request_id, None)
                    raise bad_request(
                        f"the continuation's output ids end the request already ({ends})",
                        "pd_continuation",
                    )
                self._end_at_once(handle, ends)
                return handle
        self._add_forks(handle, request.rules[1:])  # with KV from elsewhere: they fork from it
        if not elsewhere:
            self.scheduler.add(seq)
            self._wake()
        return handle

    def _end_at_once(self, handle: RequestHandle, reason: str) -> None:
        """A continuation its given outputs end already: no token is sampled, no page taken."""
        handle.seq.status = SeqStatus.FINISHED
        handle.seq.finish_reason = reason
        self.handles.pop(handle.seq.request_id, None)
        handle.queue.put_nowait(Delta("", [], [], reason))

    def _add_forks(
        self, handle: RequestHandle, choice_rules: tuple[TokenRules | None, ...]
    ) -> None:
        seq = handle.seq
        for i, rules in enumerate(choice_rules, 1):
            options = choice_options(seq.params, i)
            child = self._new_handle(
                AdmitRequest(seq.prompt_ids, options, rules=(rules,), priority=seq.priority),
                SeqStatus.FORKING,
                n=0,
            )
            child.seq.cache_salt = seq.cache_salt
            child.seq.num_cached_tokens = seq.num_cached_tokens
            handle.forks.append(child)
        self.scheduler.add_children(seq, [c.seq for c in handle.forks])

    def accept_token(self, handle: RequestHandle, token: int, raw_logprobs: list | None) -> None:
        """A token sampled elsewhere (with its `[logprob, top]` when asked for), at once: the
        first token of a request whose KV comes from elsewhere."""
        logprobs = first_logprobs(raw_logprobs, token) if handle.seq.params.wants_logprobs else []
        if (done := self.postprocess.accept(handle, token, logprobs, time.monotonic())) is not None:
            self._end(done)

    def kv_arrived(self, handle: RequestHandle, key: str) -> None:
        """The KV of `handle` (from elsewhere) is in the pages lent under `key`: it runs on them
        from there."""
        self.scheduler.admit_arrived(handle.seq, key)
        self._wake()

    def _new_handle(
        self, request: AdmitRequest, status: SeqStatus, given: list[int] | None = None, n: int = -1
    ) -> RequestHandle:
        """A request's handle once it is admissible: `n` choices (default: the request's; 0: a
        choice after the first, admitted with it) of which each fits the context and all the KV
        cache together, and all a running batch; its choices within --max-waiting-requests
        (those the connector queues for pages included)."""
        prompt_ids, options = list(request.prompt_ids), request.options
        n = request.n if n < 0 else n
        max_tokens = self.capacity.max_tokens_for(len(prompt_ids), options.max_tokens, max(n, 1))
        sched = self.scheduler
        most = sched.max_running - (0 if request.kv_from_elsewhere else sched.arrival_slots)
        if n > most:
            raise APIError(
                400,
                f"{n} choices can never run at once here: this worker runs at most {most} "
                + ("" if most == sched.max_running else "local ")
                + "choices (--max-running-requests counts each choice of n)",
                code="invalid_value",
                param="n",
            )
        if given is not None and len(prompt_ids) + len(given) >= self.max_model_len:
            raise bad_request(
                f"the prompt's {len(prompt_ids)} tokens and the continuation's {len(given)} "
                f"output ids leave no room in this model's context ({self.max_model_len})",
                "pd_continuation",
            )
        if self._wakeup is None:
            raise APIError(503, "the engine is not running", "server_busy", "not_ready")
        if n > self.max_waiting:
            raise APIError(
                400,
                f"{n} choices can never wait here: this worker queues at most "
                f"{self.max_waiting} (--max-waiting-requests counts each choice of n)",
                code="invalid_value",
                param="n",
            )
        if n and self.queued_choices + n > self.max_waiting:
            raise APIError(
                503,
                "the worker's request queue is full; retry later",
                "server_busy",
                "queue_full",
                headers={"Retry-After": "1"},
            )
        request_id = f"req-{next(self._ids)}"
        handle = RequestHandle(
            Sequence(
                request_id,
                prompt_ids,
                options,
                max_tokens,
                status=status,
                rules=request.rules[0],
                priority=request.priority,
                times=Timeline() if self.trace_times else None,
            ),
            IncrementalDetokenizer(self.tokenizer, options.skip_special_tokens),
            StopChecker(options.stop, options.include_stop_str_in_output),
        )
        self.handles[request_id] = handle
        return handle

    def admit_blocker(self) -> str | None:
        """What keeps any new request (KV from elsewhere included) from being admitted now, or
        None."""
        sched = self.scheduler
        if self.queued_choices >= self.max_waiting:
            return f"the waiting queue is full ({self.max_waiting} choices)"
        if sched.running_choices >= sched.max_running:
            return f"the running batch is full ({sched.max_running} choices)"
        if sched.cache.num_free == 0:
            return "the KV pool is full"
        return None

    @property
    def queued_choices(self) -> int:
        """Choices waiting: for admission, and in the connector's queue for pages."""
        return self.scheduler.waiting_choices + self.connector.waiting()[1]

    def abort(self, handle: RequestHandle, reason: str = "the client left") -> None:
        """Stop a request (client gone), its other choices (n > 1) too. Its pages are freed at
        once, or, when the step that computes it is running, as soon as that step ends; its side
        channel is told."""
        for child in handle.forks:
            self.abort(child, reason)
        if not handle.finished:
            self._release(handle.seq, "abort")
            if self.metrics:
                self.metrics.aborted.inc()
        self._tell_side_channel(handle, reason)
        self.handles.pop(handle.seq.request_id, None)

    def fail(self, handle: RequestHandle, error: APIError) -> None:
        """End a request with an error (its pages are freed; see `abort` for a step in flight);
        its side channel (the connector's, for KV from elsewhere) is aborted too."""
        self._release(handle.seq, "error")
        self._tell_side_channel(handle, f"the request failed: {error.message}")
        self.handles.pop(handle.seq.request_id, None)
        handle.queue.put_nowait(Delta("", [], [], "error", error))

    def _end_all(self, finished: list[Finished]) -> None:
        """End the requests a step finished (a parent with the last deltas of its choices)."""
        by_handle = {d.handle.seq.request_id: d for d in finished}
        for done in finished:
            self._end(done, [by_handle.get(c.seq.request_id) for c in done.handle.forks])

    def _end(self, done: Finished, choices: list[Finished | None] | None = None) -> None:
        """End a request postprocess finished: its connector may keep its pages (for another
        worker to read; the request's `kv_transfer_params` say where), else they are freed;
        forget it, and queue its last delta (an error one when the connector failed)."""
        handle, last = done.handle, done.last
        seq = handle.seq
        choices = choices or []
        reasons = [last.finish_reason] + [c.last.finish_reason for c in choices if c is not None]
        firsts = _first_tokens([done, *choices], [handle, *handle.forks])
        try:
            params = self.connector.request_finished(seq, [r for r in reasons if r], firsts)
            handle.kv_transfer_params = params
        except Exception as e:  # answered as a 5xx, so the router retries or reports it
            log.exception("the connector cannot take %s", seq.request_id)
            error = APIError(
                503,
                f"cannot hand the KV to another worker: {e}",
                "server_busy",
                "kv_hand_off_failed",
            )
            last = Delta("", [], [], "error", error)
        assert last.finish_reason is not None
        self._release(seq, last.finish_reason)  # a no-op once lent
        if self.metrics:
            self.metrics.e2e.observe(time.monotonic() - seq.arrival_time)
        self.handles.pop(seq.request_id, None)
        handle.queue.put_nowait(last)

    @staticmethod
    def _tell_side_channel(handle: RequestHandle, reason: str) -> None:
        if handle.on_abort is not None:
            on_abort, handle.on_abort = handle.on_abort, None
            on_abort(reason)

    def _release(self, seq: Sequence, reason: str) -> None:
        if seq in self._step_seqs:  # NOTE: the forward pass may still write into its pages
            self._deferred.append((seq, reason))
        else:
            self.scheduler.finish(seq, reason)
            self.connector.pages_freed()

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    def load(self) -> WorkerLoad:
        cache = self.scheduler.cache
        lent = len(set().union(*cache.keyed.values()))  # shared pages once
        waiting_for_pages = self.connector.waiting()[0]
        lent_field = self.connector.lent_pages_field
        return WorkerLoad(
            role=self.connector.name,
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            queued_prefill_tokens=self.scheduler.queued_prefill_tokens,
            kv_pages_total=cache.num_total,
            kv_pages_free=cache.num_free,  # free + evictable: what an allocation can have
            inflight_transfers=len(cache.keyed) + waiting_for_pages,
            kv_pages_held=lent,
            kv_pages_cached=cache.num_cached,
            kv_pages_evictable=cache.num_evictable,
            kv_page_size=cache.page_size,
            waiting_for_pages=waiting_for_pages,
            **({lent_field: lent} if lent_field else {}),
        )

    def reset_prefix_cache(self) -> tuple[int, int]:
        """Drop every unreferenced cached page. Returns how many, and how many cached pages
        stay matchable because requests still hold them (they are dropped by a later reset)."""
        cache = self.scheduler.cache
        return cache.reset_prefix_cache(), cache.num_cached

    def integrity(self) -> str:
        """ "ok", or what is wrong with the page accounting, from the counters (cheap: /health
        serves it) and the last full walk (`check_integrity`), if any."""
        try:
            self.scheduler.quick_check()
        except AssertionError as e:
            return f"error: {e}"
        return self._last_walk

    def check_integrity(self) -> str:
        """Walk every page: "ok", or what is wrong (remembered for `integrity`)."""
        try:
            self.scheduler.check_integrity()
        except AssertionError as e:
            self._last_walk = f"error: {e}"
        else:
            self._last_walk = "ok"
        return self._last_walk

    @property
    def idle(self) -> bool:
        return not self.scheduler.has_work and not self.scheduler.lent

    # ----------------------------------------------------------------------------- the loop

    def start(self) -> None:
        """Start the loop task on the running event loop (again after `stop`, e.g. in tests)."""
        self._wakeup = asyncio.Event()
        # Without a torch thread, the forward thread uses torch's default count (one per core).
        self._executor = self._given_executor or ThreadPoolExecutor(
            1,
            thread_name_prefix="pd-forward",
            initializer=torch.set_num_threads,
            initargs=(DEFAULT_THREADS,),
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
        if self._executor is not None and self._executor is not self._given_executor:
            self._executor.shutdown(wait=True)
        self._executor = None
        self._wakeup = None  # new requests are refused (503) until start() again
        self._fail_all("the worker is stopping")

    async def _run(self) -> None:
        wakeup = self._wakeup
        assert wakeup is not None
        while True:
            if not self.scheduler.has_work:
                self._emit_pending_text()
                wakeup.clear()
                await wakeup.wait()
                continue
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a failed step fails its requests, not the worker
                log.exception("engine step failed")
                self._pending_text.clear()
                self._fail_all(f"internal error in the engine step: {e}")

    async def step(self) -> None:
        """Schedule, execute and postprocess one step. With overlap, the text of the previous
        step's tokens is produced while this one computes (see postprocess.py); its tokens are
        in the requests already, so this step computes them without waiting for that."""
        batch = self.scheduler.schedule()
        if self.metrics and batch.preempted:
            self.metrics.preemptions.inc(len(batch.preempted))
        if not batch.seqs:  # every page is held outside the batch; cannot last while requests run
            self._emit_pending_text()
            await asyncio.sleep(NOTHING_FITS_WAIT_S)
            return
        out = await self.execute(batch, while_running=self._emit_pending_text)
        self.scheduler.advance(batch)
        if out.prompt_logprobs:
            self.postprocess.accept_prompt_logprobs(batch, out)
        live = [self.handles.get(seq.request_id) for seq in batch.sampled]
        self._pending_text, finished = self.postprocess.accept_tokens(live, out)
        self._end_all(finished)  # before the next step is scheduled: none computes for them
        if not self.overlap:
            self._emit_pending_text()
        self.connector.pages_freed()  # finished requests freed pages; the batch may have shrunk

    def _emit_pending_text(self) -> None:
        pending, self._pending_text = self._pending_text, []
        if pending:
            # Requests aborted since their token was appended get no text.
            live = [p for p in pending if self.handles.get(p.handle.seq.request_id) is p.handle]
            self._end_all(self.postprocess.emit_text(live))
            self.connector.pages_freed()

    async def execute(
        self, batch: ScheduledBatch, while_running: Callable[[], None] | None = None
    ) -> SampleOutput:
        """Run the batch in the forward thread (and `while_running` on the event loop meanwhile);
        then the requests that ended meanwhile are freed (the step records its tokens as
        computed: `Scheduler.advance`)."""
        self._step_seqs = frozenset(batch.seqs)
        try:
            loop = asyncio.get_running_loop()
            future = loop.run_in_executor(self._executor, self._timed, batch)
            try:
                if while_running is not None:
                    while_running()
            finally:  # never leave the step running unawaited: its pages are in use
                out, seconds = await future
        finally:
            self._step_seqs = frozenset()
            for seq, reason in self._deferred:
                self.scheduler.finish(seq, reason)
            self._deferred.clear()
        self.steps += 1
        now = time.monotonic()
        self.step_log.record(
            [len(seq.prompt_ids) for seq in batch.seqs],
            batch.num_cached,
            batch.num_new,
            len(out.token_ids),
            seconds,
            [now - seq.arrival_time for seq in batch.seqs],
        )
        return out

    def _timed(self, batch: ScheduledBatch) -> tuple[SampleOutput, float]:
        """The runner's step and its seconds, timed on the forward thread (the loop's delays
        are not the step's); a runner with `step_seconds` (the simulated one) gives its own."""
        t0 = time.perf_counter()
        out = self.runner.execute(batch)
        seconds = time.perf_counter() - t0
        device = getattr(self.runner, "step_seconds", None)  # a simulated runner's clock
        return out, device(seconds) if device is not None else seconds

    def _fail_all(self, message: str) -> None:
        for handle in list(self.handles.values()):
            self.fail(handle, APIError(500, message, "internal_error"))


def _first_tokens(done: list[Finished | None], handles: list[RequestHandle]) -> list[FirstToken]:
    """Each choice's first token sampled here (past a continuation's), with its logprobs when
    the choice ended on it (`done`: the last deltas, choice 0's first)."""
    firsts = []
    for d, h in zip(done, handles):
        sampled = h.seq.output_ids[h.seq.num_given :]
        if sampled:
            on_it = d is not None and len(sampled) == 1 and bool(d.last.logprobs)
            firsts.append((sampled[0], d.last.logprobs[0] if d is not None and on_it else None))
    return firsts
