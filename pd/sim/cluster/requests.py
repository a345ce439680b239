"""What the DES is given (jobs of turns, in tokens) and what it gives back (each request's
token times), so that its figures read like `pd-bench serve`'s and compare per request with a
process simulation's."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

Segment = tuple[Hashable, int]  # (id, tokens): runs of prompt tokens; equal ids, equal tokens


@dataclass(frozen=True)
class SimTurn:
    """One request. `segments` describe its prompt for the prefix cache: the prompt is their
    concatenation (a prefix of each segment with the same id is the same tokens), e.g. a shared
    system prompt then the request's own tokens. Empty: the prompt shares nothing."""

    prompt_tokens: int
    output_tokens: int  # generated in full (the model knows no EOS: `ignore_eos`)
    segments: tuple[Segment, ...] = ()

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise ValueError("a turn has >= 1 prompt and >= 1 output token")


@dataclass(frozen=True)
class SimJob:
    """A request, or a conversation whose turn k + 1 arrives when turn k has finished."""

    job_id: str
    turns: tuple[SimTurn, ...]
    at_s: float | None = None  # a trace's start time (from its first request's)


@dataclass
class RequestTiming:
    """One request as the simulated client saw it."""

    job_id: str
    turn: int
    arrival_s: float  # when it was sent (the simulation starts at 0)
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int = 0  # prompt tokens the prefix cache served at its first admission
    token_times: list[float] = field(default_factory=list)  # each output token's arrival
    error: str | None = None  # "too_long" (never fits a worker's KV), "conversation_cut"
    prefill_worker: int | None = None  # index in its pool (co-located: the worker)
    decode_worker: int | None = None
    preemptions: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None and len(self.token_times) == self.output_tokens

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.arrival_s if self.token_times else None

    @property
    def e2e_s(self) -> float | None:
        return self.token_times[-1] - self.arrival_s if self.token_times else None

    @property
    def itl_s(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot_s(self) -> float | None:
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)
