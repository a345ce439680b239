"""A request as a simulated worker holds it: its tokens and pages, in counts."""

from __future__ import annotations

from pd.sim.cluster.requests import RequestTiming, SimTurn

WAITING, PREFILL, DECODE, PINNED, PULL, DONE = range(6)


class Seq:
    """One request on a worker: its tokens and pages (in counts)."""

    __slots__ = ("uid", "job", "timing", "prompt", "output", "segments", "emitted",
                 "computed", "shared", "private", "state", "s0", "c0", "version",
                 "admitted")  # fmt: skip

    def __init__(self, uid: int, timing: RequestTiming, turn: SimTurn, job: int = 0) -> None:
        self.uid = uid
        self.job = job  # its job's index (the DES sends the next turn when it ends)
        self.timing = timing
        self.prompt = turn.prompt_tokens
        self.output = turn.output_tokens
        self.segments = turn.segments
        self.emitted = 0  # output tokens sampled
        self.computed = 0  # tokens in the KV cache
        self.shared = 0  # full prompt pages counted in the prefix cache, not privately
        self.private = 0  # pages held privately (a decode row's: `SimWorker.decode_pages`)
        self.state = WAITING
        self.s0 = 0  # decode rows: the step the row joined at, with c0 tokens computed
        self.c0 = 0
        self.version = 0  # bumped when a decode row leaves (stale finish-heap entries)
        self.admitted = False  # into a running batch once (its cached tokens are counted)

    @property
    def remaining(self) -> int:
        """Tokens to compute before the next sample (the last sampled one is not in the KV)."""
        return self.prompt + self.emitted - self.computed


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)
