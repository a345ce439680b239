"""The planner's discrete-event model of a pd cluster: requests arrive, the router picks a
worker, workers step in modeled time (worker.py), KV moves from P to D over the link, and each
request's token times come out (`RequestTiming`). Deterministic: no randomness of its own.

The flow, as in pd (docs/architecture.md "One request through the stack"):
- disaggregated: the router sends a request to a prefill worker (`policy` over the P pool); P
  prefills it in chunks and samples token 0, which is the client's first token (TTFT); the router
  then picks a decode worker, which queues the pull until its pages are granted
  (`SimWorker.grant`); the pull takes `CostModel.kv_transfer_s(prompt tokens)` of the side with
  the smaller TP, one pull at a time on each worker's link (P's and D's, FIFO); then P frees its
  pinned pages and the request decodes on D from its next step on;
- co-located: the router sends it to one worker, which prefills and decodes it in mixed steps.
- a conversation's turn k + 1 is sent when turn k finished (`pd-bench serve`'s multi-turn).

What it leaves out: the router's and HTTP's own latency (0 here), decode-local prefill and
cache-aware routing, D's prefix cache, overlap scheduling, `max_waiting_requests` (503s: here
every request queues), EOS (every request generates its `output_tokens`).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pd.sim.cluster.requests import RequestTiming, SimJob
from pd.sim.cluster.seq import Seq, pages_for
from pd.sim.cluster.spec import ClusterSpec
from pd.sim.cluster.worker import SimWorker

ARRIVE, STEP, PULLED = range(3)


@dataclass
class SimResult:
    requests: list[RequestTiming]  # every turn of every job, in job order
    workers: list[SimWorker]  # P then D (or the co-located ones)
    end_s: float  # when the last event happened
    steps: int


class _Router:
    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._next: dict[str, int] = {}

    def choose(self, pool: str, workers: list[SimWorker]) -> SimWorker:
        if self.policy == "round-robin" or len(workers) == 1:
            i = self._next.get(pool, 0)
            self._next[pool] = i + 1
            return workers[i % len(workers)]
        return min(workers, key=lambda w: w.load)  # the first of the least loaded


class ClusterSim:
    def __init__(
        self,
        spec: ClusterSpec,
        check: bool = False,
        stop: Callable[[RequestTiming], bool] | None = None,
    ) -> None:
        self.spec = spec
        self.check = check  # every worker's page accounting checked after each event (tests)
        # Told of each request that ends (finished or failed); True stops the run there (the
        # requests not ended yet come back unfinished).
        self.stop = stop
        self.stopped = False
        limits = spec.limits
        self.page = limits.page_size
        self.pools: list[list[SimWorker]] = []
        for pool in spec.pools:
            profile = spec.pool_profile(pool)
            self.pools.append(
                [SimWorker(i, pool.role, profile, limits) for i in range(pool.workers)]
            )
        self.router = _Router(spec.policy)
        self._events: list[tuple[float, int, int, object]] = []
        self._order = 0
        self._pending: list[SimWorker] = []  # to schedule at the end of this instant
        self._uid = 0
        self.now = 0.0

    @property
    def workers(self) -> list[SimWorker]:
        return [w for pool in self.pools for w in pool]

    def run(self, jobs: Sequence[SimJob], arrivals: Sequence[float]) -> SimResult:
        """Simulate `jobs`, job i's first turn sent at `arrivals[i]`, until every one ends."""
        assert len(jobs) == len(arrivals)
        timings = [[] for _ in jobs]  # type: list[list[RequestTiming]]
        for i, at in enumerate(arrivals):
            self._push(at, ARRIVE, (i, 0))
        steps = 0
        events = self._events
        while events and not self.stopped:
            now, _, kind, obj = heapq.heappop(events)
            self.now = now
            if kind == STEP:
                assert isinstance(obj, SimWorker)
                steps += 1
                self._step_done(obj, jobs, timings)
            elif kind == PULLED:
                assert isinstance(obj, tuple)
                self._pulled(*obj)
            else:
                assert isinstance(obj, tuple)
                self._arrive(jobs, timings, *obj)
            if not events or events[0][0] > now:  # this instant's events all applied
                self._kick_pending()
            if self.check:
                for w in self.workers:
                    w.check_integrity()
        return SimResult([t for per_job in timings for t in per_job], self.workers, self.now, steps)

    # ------------------------------------------------------------------------------ events

    def _push(self, at: float, kind: int, obj: object) -> None:
        self._order += 1
        heapq.heappush(self._events, (at, self._order, kind, obj))

    def _kick(self, w: SimWorker) -> None:
        """`w` may have work: it schedules once every event of this instant is applied (requests
        that arrive together are batched together)."""
        if not w.busy and w not in self._pending:
            self._pending.append(w)

    def _kick_pending(self) -> None:
        for w in self._pending:
            if not w.busy:
                duration = w.start()
                if duration is not None:
                    self._push(self.now + duration, STEP, w)
        self._pending.clear()

    def _arrive(self, jobs: Sequence[SimJob], timings: list[list[RequestTiming]], job: int,
                turn: int) -> None:  # fmt: skip
        t = jobs[job].turns[turn]
        timing = RequestTiming(jobs[job].job_id, turn, self.now, t.prompt_tokens, t.output_tokens)
        timings[job].append(timing)
        first = self.pools[0]
        if not self._fits(t.prompt_tokens, t.output_tokens):
            timing.error = "too_long"
            self._cut(jobs, timings, job, turn)
            self._ended(timing)
            return
        self._uid += 1
        seq = Seq(self._uid, timing, t, job)
        w = self.router.choose("first", first)
        timing.prefill_worker = w.index
        if not self.spec.is_disaggregated:
            timing.decode_worker = w.index
        w.add(seq)
        self._kick(w)

    def _fits(self, prompt: int, output: int) -> bool:
        """Whether a request can ever run: its KV within one worker's pages (D: all of it)."""
        last = self.pools[-1][0]
        if self.spec.is_disaggregated and pages_for(prompt, self.page) > self.pools[0][0].total:
            return False
        return pages_for(prompt + output, self.page) <= last.total

    def _step_done(self, w: SimWorker, jobs: Sequence[SimJob],
                   timings: list[list[RequestTiming]]) -> None:  # fmt: skip
        done, handed = w.finish_step(self.now)
        for seq in handed:
            d = self.router.choose("decode", self.pools[1])
            seq.timing.decode_worker = d.index
            d.add_pull(seq)
            self._grant(d)
        for seq in done:
            self._next_turn(jobs, seq)
            self._ended(seq.timing)
        if w.role == "decode":
            self._grant(w)
        self._kick(w)

    def _grant(self, d: SimWorker) -> None:
        """Start the pulls `d` has pages for now (each from its request's P)."""
        for seq in d.grant():
            assert seq.timing.prefill_worker is not None
            self._start_pull(self.pools[0][seq.timing.prefill_worker], d, seq)

    def _start_pull(self, p: SimWorker, d: SimWorker, seq: Seq) -> None:
        side = p if p.cost.profile.tp <= d.cost.profile.tp else d
        begin = max(self.now, p.link_free_s, d.link_free_s)
        end = begin + side.cost.kv_transfer_s(seq.prompt)
        p.link_free_s = d.link_free_s = end
        self._push(end, PULLED, (p, d, seq))

    def _pulled(self, p: SimWorker, d: SimWorker, seq: Seq) -> None:
        p.release_pinned(seq)
        d.admit_pulled(seq)
        self._kick(p)  # its pages are free: admissions may fit now
        self._kick(d)

    def _ended(self, timing: RequestTiming) -> None:
        if self.stop is not None and self.stop(timing):
            self.stopped = True

    def _next_turn(self, jobs: Sequence[SimJob], seq: Seq) -> None:
        if seq.timing.turn + 1 < len(jobs[seq.job].turns):
            self._push(self.now, ARRIVE, (seq.job, seq.timing.turn + 1))

    def _cut(self, jobs: Sequence[SimJob], timings: list[list[RequestTiming]], job: int,
             turn: int) -> None:  # fmt: skip
        for k in range(turn + 1, len(jobs[job].turns)):
            t = jobs[job].turns[k]
            cut = RequestTiming(jobs[job].job_id, k, self.now, t.prompt_tokens, t.output_tokens)
            cut.error = "conversation_cut"
            timings[job].append(cut)


def simulate(spec: ClusterSpec, jobs: Sequence[SimJob], arrivals: Sequence[float]) -> SimResult:
    """Run `jobs` on a fresh cluster of `spec` (job i sent at `arrivals[i]`)."""
    return ClusterSim(spec).run(jobs, arrivals)
