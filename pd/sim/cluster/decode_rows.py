"""A worker's decoding requests in aggregate, so that a decode step costs O(1) in its size.

NOTE: `Limits` has chunk_size > max_running, so every decoding request is in every step. A row
that joins at step s0 with c0 tokens computed then has c0 + (s - s0) at step s, needs a new page
when that is a multiple of page_size, and finishes at step s0 + (tokens left) - 1. So the rows'
count, the sum of their c0 - s0 (the batch's context at step s is that sum plus count x s), the
count per (c0 - s0) mod page_size (the rows at a page boundary at step s) and a heap of the step
each finishes at say all a step needs. A row that leaves early (preempted) is dropped from the
heap lazily (its version changes).
"""

from __future__ import annotations

import heapq

from pd.sim.cluster.seq import DECODE, Seq


class DecodeRows:
    def __init__(self, page_size: int) -> None:
        self.page = page_size
        self._n = 0
        self._k = 0  # sum of c0 - s0
        self._phase = [0] * page_size  # rows per (c0 - s0) mod page_size
        self._finish: list[tuple[int, int, int, Seq]] = []  # (last step, uid, version, row)

    def __len__(self) -> int:
        return self._n

    def join(self, seq: Seq, step: int) -> None:
        """`seq` decodes from `step` on, its computed tokens as they are now."""
        seq.s0, seq.c0 = step, seq.computed
        self._n += 1
        self._k += seq.c0 - seq.s0
        self._phase[(seq.c0 - seq.s0) % self.page] += 1
        last = seq.s0 + seq.output - seq.emitted - 1
        heapq.heappush(self._finish, (last, seq.uid, seq.version, seq))

    def leave(self, seq: Seq) -> None:
        self._n -= 1
        self._k -= seq.c0 - seq.s0
        self._phase[(seq.c0 - seq.s0) % self.page] -= 1
        seq.version += 1

    def context(self, step: int) -> int:
        """Tokens of context of every row together at `step` (the sum of their c_i)."""
        return self._k + self._n * step

    def at_boundary(self, step: int) -> int:
        """Rows whose token at `step` starts a new page."""
        return self._phase[(-step) % self.page]

    def needs_page(self, seq: Seq, step: int) -> bool:
        return (seq.c0 - seq.s0 + step) % self.page == 0

    def finished(self, step: int) -> list[Seq]:
        """The rows whose last token step `step` computed (the worker takes them out)."""
        heap, done = self._finish, []
        while heap and heap[0][0] <= step:
            _, _, version, seq = heapq.heappop(heap)
            if version == seq.version and seq.state is DECODE:
                done.append(seq)
        return done
