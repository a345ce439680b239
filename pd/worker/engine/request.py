"""A request inside the engine: `Sequence` (what the scheduler and the runner see: token ids,
pages, how far its KV is computed) and `RequestHandle` (what the HTTP side sees: a queue of
`Delta`s, plus the text state that turns tokens into them).

Who changes what: the scheduler changes a sequence's status and pages (`page_ids`,
`num_computed`); postprocess alone appends to `output_ids` and finishes it.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pd.protocol import APIError, GenerationOptions
from pd.worker.model.prompt_logprobs import PromptLogprob
from pd.worker.text.detokenizer import IncrementalDetokenizer
from pd.worker.text.stop import StopChecker
from pd.worker.text.token_rules import TokenRules

# One position's logprobs: (chosen token id, its logprob, [(token id, logprob)] alternatives).
LogprobEntry = tuple[int, float, list[tuple[int, float]] | None]


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # queued; holds no pages (new, or preempted)
    RUNNING = "running"  # admitted; holds pages for its computed tokens
    WAITING_FOR_KV = "waiting_for_kv"  # its KV comes from elsewhere (the connector's)
    FORKING = "forking"  # a choice of n > 1 waiting for its parent's prompt (fork.py); no pages
    FINISHED = "finished"  # done or aborted; its pages are freed


class Timeline:
    """When a traced request reached each stage (time.monotonic(); None: not reached): what its
    worker's spans are made of once it ends (pd/worker/api/spans.py). Kept only while the
    worker exports traces."""

    __slots__ = ("scheduled", "pages", "kv_start", "kv_end", "kv_bytes", "gaps")

    def __init__(self) -> None:
        self.scheduled: float | None = None  # first admitted to the running batch
        self.pages: float | None = None  # KV from elsewhere: its pages lent
        self.kv_start: float | None = None
        self.kv_end: float | None = None
        self.kv_bytes = 0
        self.gaps: list[float] = []  # seconds between its tokens


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: GenerationOptions
    max_tokens: int  # resolved at admission: what the client asked, capped by the context
    output_ids: list[int] = field(default_factory=list)
    page_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in `page_ids`
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | "kv_lent"
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_preemptions: int = 0
    page_hashes: list[bytes] = field(default_factory=list)  # of its first pages, once cached
    # Prompt tokens found in the prefix cache at its first admission (None: not admitted yet);
    # with KV from elsewhere, those its source reported. Answered as
    # usage.prompt_tokens_details.cached_tokens.
    num_cached_tokens: int | None = None
    cache_salt: str | None = None  # the client's: its pages are shared only with the same salt
    rules: TokenRules | None = None  # what its next token may be (grammar, min_tokens, ...)
    # When params.prompt_logprobs asks: entry p for prompt token p + 1, filled as the prompt is
    # prefilled (postprocess), or from its KV's source; complete once the first token is out.
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)
    # A continuation (docs/migration.md §3): its first `num_given` outputs came with the request
    # (another worker generated them); they are prefilled with the prompt, never emitted.
    num_given: int = 0
    priority: int = 0  # vLLM's: lower first (the order waiting requests are taken in)
    times: Timeline | None = None  # traced: when it reached each stage

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


@dataclass
class Delta:
    """New output of one request since the previous delta."""

    text: str
    token_ids: list[int]
    logprobs: list[LogprobEntry]
    finish_reason: str | None = None  # "stop" | "length" | "error"
    error: APIError | None = None  # with finish_reason "error": what the client is answered
    # Drain by migration (docs/migration.md §2): the stream ends here without [DONE], the
    # request aborted; the router continues it elsewhere. Never from the engine.
    migrate: bool = False


@dataclass(eq=False)
class RequestHandle:
    seq: Sequence
    detok: IncrementalDetokenizer
    stop: StopChecker
    queue: asyncio.Queue[Delta] = field(default_factory=asyncio.Queue)
    # Set by a connector with a side channel for this request (its KV from elsewhere), called
    # once when the request is aborted, with the reason.
    on_abort: Callable[[str], None] | None = None
    # What another worker needs for its KV, once the connector kept its pages (request_finished)
    kv_transfer_params: dict[str, Any] | None = None
    # n > 1: choices 1..n-1, each a request of its own forked from this one (fork.py)
    forks: list[RequestHandle] = field(default_factory=list)
    # A continuation: the text the given outputs showed on the first worker (what its client
    # has); the tool-call parser is fed it before this worker's deltas.
    given_text: str = ""

    @property
    def finished(self) -> bool:
        return self.seq.is_finished
