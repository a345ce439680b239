"""`ScheduledBatch`: what the scheduler hands the model runner for one step."""

from __future__ import annotations

from dataclasses import dataclass, field

from pd.worker.engine.request import Sequence


@dataclass
class ScheduledBatch:
    """One step's work, in parallel columns (the runner reads it as a `StepBatch`)."""

    seqs: list[Sequence]  # requests in this step, decode ones first
    num_cached: list[int]  # per seq: tokens already in its pages before this step
    num_new: list[int]  # per seq: tokens computed this step (1 for decode)
    sample: list[bool]  # per seq: whether this step reaches its end, so a token is sampled
    preempted: list[Sequence] = field(default_factory=list)  # requests preempted to make room
    # n > 1 (fork.py): (row of a parent among the sampled rows, a child of it) for children whose
    # first token is sampled from that row's logits; their tokens come after the sampled rows'.
    riders: list[tuple[int, Sequence]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)

    @property
    def sampled(self) -> list[Sequence]:
        """The requests that get a token this step, in the order of the runner's output rows."""
        return [s for s, flag in zip(self.seqs, self.sample) if flag] + [c for _, c in self.riders]

    def __len__(self) -> int:
        return len(self.seqs)
