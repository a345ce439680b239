"""Workloads: what each request of a run asks, generated from a seed so that runs repeat.

A workload is a list of `Job`s. A job is one request, or one conversation whose turns are sent
one after another (each turn carries the whole history, the previous answers included, so it is
built when the previous turn has been answered). Arrivals (open or closed loop) start jobs.
Lengths are in tokens of the served model's tokenizer (`TokenText`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from pd.bench.serve.text import TokenText

WORKLOADS = ("random", "shared-prefix", "multi-turn", "mixed")


@dataclass(frozen=True)
class Turn:
    """One request. `prompt` for /v1/completions; `system` + `user` for /v1/chat/completions
    (where a conversation's history goes between them)."""

    max_tokens: int
    prompt: str | None = None
    system: str | None = None
    user: str | None = None
    input_len: int = 0  # tokens asked for (the prompt, or system + user)


@dataclass
class Job:
    job_id: str
    turns: list[Turn]
    ignore_eos: bool
    room: str | None = None  # multi-turn: the conversation id (body `user`, X-Room-Id)
    at_s: float | None = None  # trace replay: when to start, from the run's start
    priority_class: str | None = None  # --priority-mix: sent as X-Priority-Class (priority.py)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def chat(self) -> bool:
        return self.turns[0].prompt is None


@dataclass(frozen=True)
class WorkloadConfig:
    """Lengths and counts; None takes the workload's default (`DEFAULTS`)."""

    name: str
    num_requests: int | None = None  # per rate (multi-turn: conversations x turns)
    input_len: int | None = None
    output_len: int | None = None
    range_ratio: float = 0.0  # random: lengths uniform in [len * (1 - r), len * (1 + r)]
    prefix_len: int | None = None  # shared-prefix / multi-turn: the system prompt
    conversations: int = 8
    turns: int = 4
    long_input_len: int = 1024  # mixed: the long prompts
    long_output_len: int = 8
    long_every: int = 8  # mixed: every n-th request is long
    ignore_eos: bool | None = None  # None: on for random and mixed
    seed: int = 0


# name -> (num_requests, input_len, output_len, prefix_len)
DEFAULTS = {
    "random": (64, 256, 64, 0),
    "shared-prefix": (64, 32, 32, 1500),
    "multi-turn": (32, 50, 64, 1000),
    "mixed": (64, 32, 64, 0),
}


def build(cfg: WorkloadConfig, text: TokenText) -> list[Job]:
    if cfg.name not in WORKLOADS:
        raise ValueError(f"unknown workload {cfg.name!r}: choose from {', '.join(WORKLOADS)}")
    n, input_len, output_len, prefix_len = DEFAULTS[cfg.name]
    n = cfg.num_requests if cfg.num_requests is not None else n
    input_len = cfg.input_len if cfg.input_len is not None else input_len
    output_len = cfg.output_len if cfg.output_len is not None else output_len
    prefix_len = cfg.prefix_len if cfg.prefix_len is not None else prefix_len
    ignore_eos = cfg.ignore_eos
    if ignore_eos is None:
        ignore_eos = cfg.name in ("random", "mixed")
    rng = random.Random(f"{cfg.name}:{cfg.seed}")
    if cfg.name == "random":
        return [
            _completion(f"r{i}", text, rng, _spread(input_len, cfg.range_ratio, rng),
                        _spread(output_len, cfg.range_ratio, rng), ignore_eos)
            for i in range(n)
        ]  # fmt: skip
    if cfg.name == "mixed":
        jobs = []
        for i in range(n):
            long = cfg.long_every > 0 and i % cfg.long_every == cfg.long_every - 1
            length = cfg.long_input_len if long else input_len
            out = cfg.long_output_len if long else output_len
            jobs.append(_completion(f"m{i}", text, rng, length, out, ignore_eos))
            jobs[-1].meta["kind"] = "long" if long else "short"
        return jobs
    if cfg.name == "shared-prefix":
        system = text.block(f"shared-prefix:{cfg.seed}", prefix_len)
        return [
            Job(f"s{i}", [_chat_turn(system, text.random(input_len, rng), output_len,
                                     prefix_len + input_len)], ignore_eos)
            for i in range(n)
        ]  # fmt: skip
    # multi-turn: each conversation has its own system prompt; turns share it and the history.
    conversations = cfg.conversations
    turns = cfg.turns
    if cfg.num_requests is not None:
        conversations = max(1, cfg.num_requests // turns)
    jobs = []
    for c in range(conversations):
        system = text.block(f"multi-turn:{cfg.seed}:{c}", prefix_len)
        chat = [
            _chat_turn(system, text.random(input_len, rng), output_len, prefix_len + input_len)
            for _ in range(turns)
        ]
        jobs.append(Job(f"c{c}", chat, ignore_eos, room=f"conv-{cfg.seed}-{c}"))
    return jobs


def _spread(length: int, ratio: float, rng: random.Random) -> int:
    if ratio <= 0:
        return length
    return max(1, rng.randint(int(length * (1 - ratio)), int(length * (1 + ratio))))


def _completion(
    job_id: str, text: TokenText, rng: random.Random, n: int, out: int, ignore_eos: bool
) -> Job:
    return Job(job_id, [Turn(out, prompt=text.random(n, rng), input_len=n)], ignore_eos)


def _chat_turn(system: str, user: str, out: int, input_len: int) -> Turn:
    return Turn(out, system=system, user=user, input_len=input_len)
