"""A request as the scheduler sees it: token ids, pages, and how far its KV has been computed."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pd.worker.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # queued; holds no pages (new, or preempted)
    RUNNING = "running"  # admitted; holds pages for its computed tokens
    TRANSFERRING = "transferring"  # decode side: its KV is being pulled from prefill
    FINISHED = "finished"  # done or aborted; its pages are freed


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams  # params.max_tokens is already capped by the context length
    output_ids: list[int] = field(default_factory=list)
    page_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in `page_ids`
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_preemptions: int = 0
    remote_decode: bool = False  # prefill side: hand the KV to a decode worker when prefilled

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_remaining(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return self.num_tokens - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without concatenating the whole sequence."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:] + self.output_ids[: end - n]
