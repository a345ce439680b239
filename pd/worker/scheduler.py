"""Continuous batching with chunked prefill, over integers only (no torch, no sockets).

Each step gets a token budget (`chunk_size`) shared by decode and prefill tokens:

1. Running requests, oldest first, each asks for what it still has to compute: one token when
   decoding, a chunk of its prompt when prefilling. A request whose new tokens need a page that
   is not free preempts the newest running request (its pages are freed and it goes back to the
   front of the waiting queue, to be recomputed later: preemption by recompute). If the newest is
   the request itself, it is preempted.
2. Waiting requests are admitted in arrival order while budget, `max_running` and free pages allow.
   Admission never preempts: it stops at the first request that does not fit.

The scheduler owns pages: it allocates them as tokens are scheduled and frees them exactly once,
when a request finishes, is aborted or is preempted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pd.kvcache.allocator import PageAllocator
from pd.worker.sequence import SeqStatus, Sequence


@dataclass
class ScheduledBatch:
    """What the model runner computes in one step."""

    seqs: list[Sequence]  # requests in this step, decode ones first
    num_cached: list[int]  # per seq: tokens already in its pages before this step
    num_new: list[int]  # per seq: tokens computed this step (1 for decode)
    sample: list[bool]  # per seq: whether this step reaches its end, so a token is sampled
    preempted: list[Sequence] = field(default_factory=list)  # requests preempted to make room

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(
        self,
        allocator: PageAllocator,
        page_size: int,
        chunk_size: int,
        max_running: int,
    ) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.chunk_size = chunk_size
        self.max_running = max_running
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order

    # ------------------------------------------------------------------------------ queues

    def add(self, seq: Sequence) -> None:
        assert seq.status is SeqStatus.WAITING and not seq.page_ids
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take a request out of the queues and free its pages (idempotent)."""
        if seq.is_finished:
            return
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def queued_prefill_tokens(self) -> int:
        prefilling = (s.num_remaining for s in self.running if s.num_remaining > 1)
        return sum(s.num_remaining for s in self.waiting) + sum(prefilling)

    # ------------------------------------------------------------------------------ schedule

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch([], [], [], [])
        budget = self.chunk_size
        # Decoding requests first (they set ITL), then prefills in progress; both oldest first.
        order = sorted(self.running, key=lambda s: s.num_remaining > 1)
        for seq in order:
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = min(seq.num_remaining, budget)
            if not self._reserve(seq, n, batch):
                continue
            self._add(batch, seq, n)
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            seq = self.waiting[0]
            n = min(seq.num_remaining, budget)
            pages = self.allocator.allocate(self._pages_needed(seq, n))
            if pages is None:
                break
            self.waiting.popleft()
            seq.page_ids.extend(pages)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self._add(batch, seq, n)
            budget -= n
        return batch

    def _add(self, batch: ScheduledBatch, seq: Sequence, n: int) -> None:
        batch.seqs.append(seq)
        batch.num_cached.append(seq.num_computed)
        batch.num_new.append(n)
        batch.sample.append(n == seq.num_remaining)

    def _pages_needed(self, seq: Sequence, n: int) -> int:
        total = -(-(seq.num_computed + n) // self.page_size)
        return max(0, total - len(seq.page_ids))

    def _reserve(self, seq: Sequence, n: int, batch: ScheduledBatch) -> bool:
        """Give `seq` the pages for `n` more tokens, preempting the newest requests if needed."""
        need = self._pages_needed(seq, n)
        while not self.allocator.can_allocate(need):
            victim = self.running[-1]
            self._preempt(victim, batch)
            if victim is seq:
                return False
        if need:
            seq.page_ids.extend(self.allocator.allocate(need))
        return True

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)
        if seq in batch.seqs:  # it was scheduled earlier in this step: take it back out
            i = batch.seqs.index(seq)
            for column in (batch.seqs, batch.num_cached, batch.num_new, batch.sample):
                del column[i]

    def _release(self, seq: Sequence) -> None:
        if seq.page_ids:
            self.allocator.free(seq.page_ids)
        seq.page_ids = []
        seq.num_computed = 0

    # ------------------------------------------------------------------------------ results

    def advance(self, batch: ScheduledBatch) -> None:
        """Record that the batch's tokens are now in the KV cache."""
        for seq, n in zip(batch.seqs, batch.num_new):
            if seq.status is SeqStatus.RUNNING:
                seq.num_computed += n

    def check_integrity(self) -> None:
        self.allocator.check_integrity()
        held = [p for s in self.running for p in s.page_ids]
        assert len(held) == len(set(held)), "a page is held by two running requests"
        assert len(held) == self.allocator.num_used, (
            f"running requests hold {len(held)} pages but {self.allocator.num_used} are in use"
        )
        assert all(not s.page_ids for s in self.waiting), "a waiting request holds pages"
