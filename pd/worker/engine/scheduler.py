"""Continuous batching with chunked prefill, over integers only (no torch, no sockets).

Each step gets a token budget (`chunk_size`) shared by decode and prefill tokens:

1. Running requests, oldest first, each asks for what it still has to compute: one token when
   decoding, a chunk of its prompt when prefilling. A request whose new tokens need a page that
   is not free preempts the newest running request (its pages are freed and it goes back to the
   front of the waiting queue, to be recomputed later: preemption by recompute). If the newest is
   the request itself, it is preempted.
2. Waiting requests are admitted in arrival order while budget, `max_running` and free pages allow.
   Admission never preempts: it stops at the first request that does not fit.

Priority (vLLM's `priority`, lower first): when the waiting requests' priorities differ, they
are taken by priority, then arrival (preempted ones still first: they get their pages back
before anyone); prompts prefilled in chunks get the step's budget in that order too; and the
request preempted for pages is the lowest priority's newest. No request waits forever: its
priority counts one lower for every `aging_s` seconds since it arrived.

Pages come from the `KVCacheManager` (pd/kvcache/cache_manager.py), which owns every page's
state; the scheduler decides when a request takes or drops its references: as tokens are
scheduled, and exactly once when it finishes, is aborted or is preempted. With the prefix cache,
a request admitted from the queue first takes references on the cached pages of its longest
cached prefix (whole pages, never its last token: the forward pass needs that token's logits) and
computes only the rest; after each step its newly full pages become matchable. Pages are also
lent to the engine's connector by key (`LentPages`, pd/worker/engine/connector.py): a finished
request's, whose KV another worker reads, or free ones, for KV another worker writes.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable

from pd.kvcache.cache_manager import KVCacheManager
from pd.worker.engine.batch import ScheduledBatch
from pd.worker.engine.fork import Forks, attach_riders
from pd.worker.engine.request import SeqStatus, Sequence


class Scheduler:
    def __init__(
        self,
        cache: KVCacheManager,
        chunk_size: int,
        max_running: int,
        arrival_slots: int = 0,
        aging_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cache = cache
        self.aging_s = aging_s  # a waiting request's priority counts one lower per aging_s
        self.clock = clock
        self.page_size = cache.page_size
        self.chunk_size = chunk_size
        # Running slots count choices: a request with n choices takes n (its children fork
        # into the batch after its first token). `arrival_slots` of them only requests whose KV
        # comes from elsewhere may take (their clients have their first token: never starved
        # by requests computed here).
        self.max_running = max_running
        self.arrival_slots = arrival_slots
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.forks: Forks = {}  # n > 1: parent -> its children until they fork (fork.py)
        self._lent_choices: dict[str, int] = {}  # by key: the choices of KV that arrives

    # ------------------------------------------------------------------------------ queues

    def add(self, seq: Sequence) -> None:
        assert seq.status is SeqStatus.WAITING and not seq.page_ids
        self.waiting.append(seq)

    def add_children(self, parent: Sequence, children: list[Sequence]) -> None:
        """n > 1: `children` (FORKING) fork from `parent` once its prompt is computed."""
        assert all(c.status is SeqStatus.FORKING and not c.page_ids for c in children)
        if children:
            self.forks[parent] = children

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take a request out of the queues and free its pages (idempotent)."""
        if seq.is_finished:
            return
        self._orphan(seq)
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

    def choices_of(self, seq: Sequence) -> int:
        """The running slots `seq` stands for: itself and its children still to fork."""
        return 1 + len(self.forks.get(seq, ()))

    @property
    def running_choices(self) -> int:
        """Running slots taken: the running sequences, the children still to fork from running
        parents, and the choices of the requests whose KV arrives into lent pages."""
        pending = sum(len(c) for p, c in self.forks.items() if p.status is SeqStatus.RUNNING)
        return len(self.running) + pending + sum(self._lent_choices.values())

    @property
    def waiting_choices(self) -> int:
        """The choices of the requests waiting for admission."""
        pending = sum(len(c) for p, c in self.forks.items() if p.status is SeqStatus.WAITING)
        return len(self.waiting) + pending

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
        # Decoding requests first (they set ITL), then prefills in progress; both oldest first.
        # When priorities differ: prefills by priority, and those below the first waiting
        # request's only after it (a prompt's chunks never hold a higher one back).
        order, deferred = self._running_order()
        budget = self._run(order, self.chunk_size, batch)
        slots = self.max_running - self.arrival_slots - self.running_choices  # computed here
        while self.waiting and budget > 0 and self.choices_of(self.waiting[0]) <= slots:
            seq = self.waiting[0]
            self._reuse_prefix(seq)
            n = min(seq.num_remaining, budget)
            pages = self.cache.allocate(self._pages_needed(seq, n))
            if pages is None:
                self._release(seq)  # the prefix hit is looked up again next time
                break
            if seq.num_cached_tokens is None:  # counted once, at the first admission
                # (of its prompt: a continuation's given outputs are prefilled too)
                seq.num_cached_tokens = min(seq.num_computed, len(seq.prompt_ids))
                self.cache.count_query(len(seq.prompt_ids), seq.num_cached_tokens)
            self.waiting.popleft()
            if seq.times is not None and seq.times.scheduled is None:
                seq.times.scheduled = self.clock()
            seq.page_ids.extend(pages)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            slots -= self.choices_of(seq)
            self._add(batch, seq, n)
            budget -= n
        if deferred and budget > 0:
            self._run(deferred, budget, batch)
        attach_riders(batch, self.forks)
        return batch

    def _running_order(self) -> tuple[list[Sequence], list[Sequence]]:
        """The running requests in the order they get the step's budget, and those (lower
        prefills) that get what is left after the waiting requests are admitted. Sorts the
        waiting queue when priorities differ."""
        running = self.running
        if _uniform(running, self.waiting):
            return sorted(running, key=lambda s: s.num_remaining > 1), []
        now = self.clock()
        if len(self.waiting) > 1:
            # Preempted first (as appendleft put them), then by aged priority, then arrival.
            self.waiting = deque(
                sorted(self.waiting, key=lambda s: (not s.num_preemptions, self._rank(s, now)))
            )
        head = self._rank(self.waiting[0], now) if self.waiting else float("inf")
        decoding = [s for s in running if s.num_remaining <= 1]
        ranked = sorted(
            ((self._rank(s, now), i, s) for i, s in enumerate(running) if s.num_remaining > 1)
        )
        first = [s for rank, _, s in ranked if rank <= head]
        return decoding + first, [s for rank, _, s in ranked if rank > head]

    def _run(self, order: list[Sequence], budget: int, batch: ScheduledBatch) -> int:
        """Give running requests, in `order`, what they ask of `budget`; what is left."""
        for seq in order:
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:  # preempted earlier in this step
                continue
            n = min(seq.num_remaining, budget)
            if not self._reserve(seq, n, batch):
                continue
            self._add(batch, seq, n)
            budget -= n
        return budget

    def _reuse_prefix(self, seq: Sequence) -> None:
        """Take references on the cached pages of `seq`'s longest cached prefix (none when it
        wants its prompt's logprobs: a cached page has no logits; its pages are still cached)."""
        limit = seq.num_tokens - 1  # the last token is computed: its logits sample the next
        if seq.params.prompt_logprobs is not None:
            limit = 0
        pages, hashes = self.cache.match(seq.token_slice(0, limit), limit, seq.cache_salt)
        self.cache.acquire(pages)
        seq.page_ids = pages
        seq.page_hashes = hashes
        seq.num_computed = len(pages) * self.page_size

    def _cache_full_pages(self, seq: Sequence) -> None:
        """Make `seq`'s full, computed pages matchable (deduplicated against cached ones)."""
        full, done = seq.num_computed // self.page_size, len(seq.page_hashes)
        if full <= done:
            return
        tokens = seq.token_slice(done * self.page_size, full * self.page_size)  # the new pages
        new, swaps = self.cache.insert(seq.page_ids, seq.page_hashes, tokens, seq.cache_salt)
        seq.page_hashes.extend(new)
        for i, page in swaps.items():
            seq.page_ids[i] = page

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
        while not self.cache.can_allocate(need):
            victim = self._victim()
            self._preempt(victim, batch)
            if victim is seq:
                return False
        if need:
            pages = self.cache.allocate(need)
            assert pages is not None  # can_allocate said so
            seq.page_ids.extend(pages)
        return True

    def _rank(self, seq: Sequence, now: float) -> float:
        """Its priority, aged: one lower for every `aging_s` seconds since it arrived (ties:
        the earlier arrival first, as the key's age breaks them)."""
        return seq.priority - (now - seq.arrival_time) / self.aging_s

    def _victim(self) -> Sequence:
        """The running request to preempt for pages: the newest, of the lowest priority."""
        running = self.running
        if _uniform(running):
            return running[-1]
        worst = max(s.priority for s in running)
        return next(s for s in reversed(running) if s.priority == worst)

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
            # Tail first: the LRU then evicts a chain from its end, keeping its prefix matchable.
            self.cache.free(reversed(seq.page_ids))
        seq.page_ids = []
        seq.page_hashes = []
        seq.num_computed = 0

    # ------------------------------------------------------------------------------ lent pages

    def lend(self, seq: Sequence, key: str) -> list[int]:
        """Finish a running request but keep its pages (cached ones too), each referenced under
        `key` until given back (its KV is read elsewhere)."""
        assert seq.status is SeqStatus.RUNNING and key not in self.cache.keyed
        self.running.remove(seq)
        pages, seq.page_ids, seq.page_hashes = seq.page_ids, [], []
        self.cache.hold(key, pages)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = "kv_lent"
        return pages

    def lend_free(self, key: str, num_pages: int, choices: int = 1) -> list[int] | None:
        """Pages for a request's KV that arrives from elsewhere, if no preempted request waits,
        they fit beside the running batch's growth (one free or evictable page per running
        request stays in reserve) and its `choices` fit in `max_running` (the arrival slots
        included). New requests waiting for admission do not hold it back: its client has its
        first token already."""
        assert key not in self.cache.keyed
        if any(s.num_preemptions for s in self.waiting):  # they get their pages back first
            return None
        if self.running_choices + choices > self.max_running:
            return None
        if self.cache.num_free - num_pages < len(self.running):
            return None
        pages = self.cache.allocate(num_pages)
        if pages is not None:
            self.cache.hold(key, pages)
            self._lent_choices[key] = choices
        return pages

    def give_back(self, key: str) -> None:
        """Drop the pages lent under `key` (idempotent: done, abort and expiry may race)."""
        self.cache.release(key)
        self._lent_choices.pop(key, None)

    def admit_arrived(self, seq: Sequence, key: str) -> None:
        """The KV from elsewhere is in the pages lent under `key`: the request runs on them,
        from there (and its full prompt pages become matchable on this worker)."""
        assert seq.status is SeqStatus.WAITING_FOR_KV
        seq.page_ids = self.cache.take(key)
        self._lent_choices.pop(key, None)  # running now, its children with it
        # The KV covers the prompt (and a continuation's given outputs); the token sampled
        # elsewhere is next.
        seq.num_computed = len(seq.prompt_ids) + seq.num_given
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        self._cache_full_pages(seq)
        self._fork_arrived(seq)

    @property
    def lent(self) -> dict[str, list[int]]:
        """Pages lent by key."""
        return self.cache.keyed

    # ------------------------------------------------------------------------------ results

    def advance(self, batch: ScheduledBatch) -> None:
        """Record that the batch's tokens are now in the KV cache."""
        for seq, n in zip(batch.seqs, batch.num_new):
            if seq.status is SeqStatus.RUNNING:
                seq.num_computed += n
                self._cache_full_pages(seq)
        sampled = [s for s, flag in zip(batch.seqs, batch.sample) if flag]
        for row, child in batch.riders:
            parent = sampled[row]
            if parent.status is SeqStatus.RUNNING:
                self._fork(child, parent.page_ids, parent.page_hashes, parent.num_cached_tokens)
            self.forks.pop(parent, None)  # (a parent that ended meanwhile requeued them)

    # ------------------------------------------------------------------------------ n > 1

    def _fork_arrived(self, parent: Sequence) -> None:
        """n > 1, KV from elsewhere: it arrived; the parent's children (each with its first
        token) fork from its pages."""
        for child in self.forks.pop(parent, ()):
            self._fork(child, parent.page_ids, parent.page_hashes, child.num_cached_tokens)

    def _fork(
        self, child: Sequence, pages: list[int], hashes: list[bytes], cached: int | None
    ) -> None:
        """`child` shares the full prompt pages of `pages` (one reference each) and runs from the
        page boundary: its next step recomputes the partial last page and its first token."""
        if child.status is not SeqStatus.FORKING:
            return
        if child.max_tokens <= 1 and not child.output_ids:  # it ends on its first token
            return
        full = len(child.prompt_ids) // self.page_size
        shared = pages[:full]
        self.cache.acquire(shared)
        child.page_ids = list(shared)
        child.page_hashes = list(hashes[:full])
        child.num_computed = full * self.page_size
        child.num_cached_tokens = cached
        # Its recomputed tokens count as computed prompt tokens (prefix cache queries - hits).
        self.cache.count_query(len(child.prompt_ids), child.num_computed)
        child.status = SeqStatus.RUNNING
        self.running.append(child)

    def _orphan(self, parent: Sequence) -> None:
        """`parent` ends before its children forked: they become ordinary requests, prefilling
        the prompt (and the first token each has, when sampled elsewhere) themselves."""
        for child in self.forks.pop(parent, ()):
            if child.status is SeqStatus.FORKING:
                child.status = SeqStatus.WAITING
                self.waiting.append(child)

    def quick_check(self) -> None:
        """`check_integrity`'s counters only (time independent of the pages: /health runs it)."""
        self.cache.quick_check(sum(len(s.page_ids) for s in self.running))
        assert all(not s.page_ids for s in self.waiting), "a waiting request holds pages"

    def check_integrity(self) -> None:
        """Every page in one state, each reference accounted for by a running request or a key,
        and no waiting request holding pages."""
        self.cache.check_integrity(s.page_ids for s in self.running)
        assert all(not s.page_ids for s in self.waiting), "a waiting request holds pages"


def _uniform(*groups: Iterable[Sequence]) -> bool:
    """Whether all their priorities are one (then arrival order alone decides, as without)."""
    first: int | None = None
    for group in groups:
        for s in group:
            if first is None:
                first = s.priority
            elif s.priority != first:
                return False
    return True
