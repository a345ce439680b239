"""One simulated worker of the DES: pd's scheduler (pd/worker/engine/scheduler.py) over counts of
pages, stepping in modeled time (`CostModel.batch_s`).

A step, as pd schedules it, within the `chunk_size` token budget: every decoding request one
token (oldest first), then prefills in progress, then waiting requests in arrival order while
the budget, `max_running` and free pages allow (admission never preempts). A request whose next
tokens need a page that is not free preempts the newest running request (by recompute: it goes
back to the front of the queue with its pages freed). Roles differ after a prompt's last chunk:
a prefill worker hands the request off (its pages stay pinned until the pull is done), a decode
or co-located worker decodes it. A decode worker takes a pulled request's pages when no
preempted request waits, it is under `max_running` (pulls in flight count) and one free page per
running request stays in reserve (`Scheduler.lend_free`).

Decode rows are kept in aggregate (decode_rows.py): a step costs O(1) in the batch's size.
"""

from __future__ import annotations

from collections import deque

from pd.sim.cluster.decode_rows import DecodeRows
from pd.sim.cluster.prefix import PrefixCache
from pd.sim.cluster.seq import DECODE, DONE, PINNED, PREFILL, PULL, WAITING, Seq, pages_for
from pd.sim.cluster.spec import Limits
from pd.sim.cost import CostModel
from pd.sim.profile import Profile


class SimWorker:
    def __init__(self, index: int, role: str, profile: Profile, limits: Limits) -> None:
        self.index = index
        self.role = role
        self.cost = CostModel(profile)
        self.page = limits.page_size
        self.chunk = limits.chunk_size
        self.max_running = limits.max_running
        self.total = profile.kv_pages(self.page)
        self.used = 0  # pages held privately (running, pinned, reserved for a pull)
        self.cache = PrefixCache() if limits.prefix_cache and role != "decode" else None
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []  # in admission order
        self.prefilling: list[Seq] = []  # those of them prefilling, in admission order
        self.busy = False
        self.steps = 0  # steps started; the next one's index
        self.reserved = 0  # decode rows hold pages for the tokens of steps < this
        self.step_end: list[float] = []  # each finished step's end time
        self.queued_prefill = 0  # tokens still to prefill, waiting and running
        self.decoding = DecodeRows(self.page)
        self._chunks: list[tuple[Seq, int, bool]] = []  # this step's prefill rows
        # Decode side: pulls waiting for pages, pulls in flight (their pages reserved).
        self.pulls: deque[Seq] = deque()
        self.held = 0
        self.held_pages = 0
        self.pinned_pages = 0  # prefill side: pages of handed-off requests until pulled
        self.link_free_s = 0.0  # when this worker's KV link is next free
        self.busy_s = 0.0
        self.preemptions = 0
        self.max_decode_rows = 0  # the largest decode batch of a step

    # ------------------------------------------------------------------------------ pages

    @property
    def cache_pages(self) -> int:
        return pages_for(self.cache.tokens, self.page) if self.cache else 0

    @property
    def free_pages(self) -> int:
        """Free or evictable (cached, unreferenced) pages, as pd's `num_free` counts them."""
        return self.total - self.used

    def _allocate(self, n: int) -> None:
        assert n <= self.total - self.used, "allocating past the free pages"
        while self.cache is not None and self.total - self.used - self.cache_pages < n:
            self.cache.evict_one()
        self.used += n

    def decode_pages(self, seq: Seq) -> int:
        """A decode row's private pages: those of its tokens up to the reserved step."""
        return pages_for(seq.c0 + self.reserved - seq.s0, self.page) - seq.shared

    # ------------------------------------------------------------------------------ queues

    def add(self, seq: Seq) -> None:
        seq.state = WAITING
        self.waiting.append(seq)
        self.queued_prefill += seq.remaining

    def add_pull(self, seq: Seq) -> None:
        seq.state = PULL
        self.pulls.append(seq)

    def grant(self) -> list[Seq]:
        """Decode side: the pulls that get their pages now (`Scheduler.lend_free`'s rule)."""
        granted = []
        while self.pulls and not self.waiting:  # preempted requests get their pages first
            if len(self.running) + self.held >= self.max_running:
                break
            pages = pages_for(self.pulls[0].prompt, self.page)
            if self.free_pages - pages < len(self.running):
                break
            seq = self.pulls.popleft()
            self._allocate(pages)
            self.held += 1
            self.held_pages += pages
            granted.append(seq)
        return granted

    def admit_pulled(self, seq: Seq) -> None:
        """Decode side: the pull is done; P's first token is the row's next to compute."""
        pages = pages_for(seq.prompt, self.page)
        self.held -= 1
        self.held_pages -= pages
        seq.computed = seq.prompt
        seq.shared = 0
        self.running.append(seq)
        self._join_decode(seq)

    def release_pinned(self, seq: Seq) -> None:
        """Prefill side: the decode side is done with the request's pages."""
        self.used -= seq.private
        self.pinned_pages -= seq.private
        seq.private = 0

    @property
    def load(self) -> float:
        """The router's cost of this worker (pd/router/policies.py `cost`): prefill, tokens to
        prefill; decode and co-located, active requests scaled up as the KV cache fills."""
        if self.role == "prefill":
            return float(self.queued_prefill)
        active = len(self.running) + len(self.waiting) + len(self.pulls) + self.held
        return (active + 1.0) / max(1.0 - self.used / self.total, 0.01)

    # ------------------------------------------------------------------------------ steps

    def start(self) -> float | None:
        """Schedule the next step; its modeled duration, or None when nothing can run."""
        assert not self.busy
        chunks = self._schedule()
        n_dec = len(self.decoding)
        if not chunks and not n_dec:
            return None
        s = self.steps
        self.steps += 1
        self.busy = True
        if n_dec > self.max_decode_rows:
            self.max_decode_rows = n_dec
        sampled = n_dec
        rows = []
        for seq, n, sample in chunks:
            rows.append((seq.computed, n))
            sampled += sample
        duration = self.cost.batch_s(n_dec, self.decoding.context(s), rows, sampled)
        self.busy_s += duration
        return duration

    def _schedule(self) -> list[tuple[Seq, int, bool]]:
        s = self.steps
        budget = self.chunk
        # Decoding rows first: those at a page boundary need one page each.
        need = self.decoding.at_boundary(s)
        while need > self.free_pages:
            victim = self.running[-1]
            if victim.state is DECODE and self.decoding.needs_page(victim, s):
                need -= 1
            self._preempt(victim)
        self._allocate(need)
        self.reserved = s + 1
        budget -= len(self.decoding)
        chunks = self._chunks = []
        # Prefills in progress, oldest first.
        for seq in list(self.prefilling):
            if budget <= 0:
                break
            if seq.state is not PREFILL:  # preempted earlier in this loop
                continue
            n = min(seq.remaining, budget)
            need = pages_for(seq.computed + n, self.page) - seq.shared - seq.private
            fits = True
            while need > self.free_pages:
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    fits = False
                    break
            if not fits:
                continue
            self._allocate(need)
            seq.private += need
            chunks.append((seq, n, n == seq.remaining))
            budget -= n
        # Waiting requests, in arrival order, while budget, max_running and pages allow.
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            seq = self.waiting[0]
            cached = 0
            if self.cache is not None and seq.segments:
                hit = self.cache.match(seq.segments, seq.prompt + seq.emitted - 1)
                cached = hit // self.page * self.page
            n = min(seq.remaining - cached, budget)
            need = pages_for(cached + n, self.page) - cached // self.page
            if need > self.free_pages:
                break
            self.waiting.popleft()
            if not seq.admitted:
                seq.admitted = True
                seq.timing.cached_tokens = cached
            seq.computed = cached
            seq.shared = cached // self.page
            self.queued_prefill -= cached
            self._allocate(need)
            seq.private = need
            seq.state = PREFILL
            self.running.append(seq)
            self.prefilling.append(seq)
            chunks.append((seq, n, n == seq.remaining))
            budget -= n
        return chunks

    def finish_step(self, now: float) -> tuple[list[Seq], list[Seq]]:
        """The running step ended at `now`: (requests finished here, requests handed off)."""
        assert self.busy
        self.busy = False
        s = self.steps - 1
        self.step_end.append(now)
        done: list[Seq] = []
        handed: list[Seq] = []
        for seq, n, sample in self._chunks:
            seq.computed += n
            self.queued_prefill -= n
            if not sample:
                continue
            self.prefilling.remove(seq)
            seq.emitted += 1
            seq.timing.token_times.append(now)
            self._cache_prompt(seq)
            if seq.emitted >= seq.output:
                self.running.remove(seq)
                self._free(seq, seq.private)
                done.append(seq)
            elif self.role == "prefill":
                self.running.remove(seq)
                seq.state = PINNED
                self.pinned_pages += seq.private
                handed.append(seq)
            else:
                self._join_decode(seq)
        self._chunks = []
        for seq in self.decoding.finished(s):
            pages = self.decode_pages(seq)
            self._leave_decode(seq)
            self.running.remove(seq)
            self._free(seq, pages)
            done.append(seq)
        return done, handed

    # ------------------------------------------------------------------------------ rows

    def _join_decode(self, seq: Seq) -> None:
        """`seq` decodes from the next step on."""
        seq.state = DECODE
        seq.private = 0
        self.decoding.join(seq, self.steps)

    def _leave_decode(self, seq: Seq) -> None:
        """Take a decode row out; its tokens are those of the steps it was in so far."""
        ran = len(self.step_end) - seq.s0
        seq.timing.token_times.extend(self.step_end[seq.s0 :])
        seq.emitted += ran
        seq.computed = seq.c0 + ran
        self.decoding.leave(seq)

    def _cache_prompt(self, seq: Seq) -> None:
        """The prompt is computed: its full pages become the cache's (those it had already are
        the request's duplicates, freed: pd's insert deduplicates them)."""
        if self.cache is None or not seq.segments:
            return
        full = seq.prompt // self.page
        self.cache.insert(seq.segments, full * self.page)
        moved = full - seq.shared
        if moved > 0:
            seq.private -= moved
            self.used -= moved
            seq.shared = full

    def _preempt(self, seq: Seq) -> None:
        """Preemption by recompute: its pages freed, to the front of the queue."""
        if seq.state is DECODE:
            pages = self.decode_pages(seq)
            self._leave_decode(seq)
            counted = 0  # a decode row's one token is not queued prefill
        else:
            pages = seq.private
            self._chunks[:] = [c for c in self._chunks if c[0] is not seq]  # out of this step
            self.prefilling.remove(seq)
            counted = seq.remaining
        self.running.remove(seq)
        self.used -= pages
        seq.computed = seq.shared = seq.private = 0
        seq.state = WAITING
        seq.timing.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)
        self.queued_prefill += seq.remaining - counted

    def _free(self, seq: Seq, pages: int) -> None:
        self.used -= pages
        seq.private = 0
        seq.state = DONE

    # ------------------------------------------------------------------------------ checks

    def check_integrity(self) -> None:
        """Every privately held page accounted for by a request or a pull."""
        held = self.held_pages + self.pinned_pages
        for seq in self.running:
            held += self.decode_pages(seq) if seq.state is DECODE else seq.private
        assert held == self.used, f"worker {self.index}: {held} pages held, {self.used} used"
        assert 0 <= self.used <= self.total
        assert len(self.decoding) == sum(1 for s in self.running if s.state is DECODE)
        assert self.prefilling == [s for s in self.running if s.state is PREFILL]
        assert all(s.private == 0 and s.computed == 0 for s in self.waiting)
