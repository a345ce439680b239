"""A `pd-bench serve` workload or trace as the planner's DES jobs: token counts and prefix
sharing, no tokenizer and no text.

Workloads are built by `workloads.build` itself over `CountingText`, a stand-in for `TokenText`
that draws from the seeded generator exactly as `TokenText` does (so the lengths, `--range-ratio`
included, are those `pd-bench serve` sends at the same seed) and returns placeholders for the
text. What the prompts share comes from the workload's shape: a shared-prefix chat's system
prompt is one segment all its requests share; a multi-turn conversation's turn k is its system
prompt then its history (each earlier user turn and answer, the answers `max_tokens` long) and
its user turn, a prefix of turn k + 1's. A trace's `hash_ids` are 512-token blocks.
Chat templates add no tokens here.
"""

from __future__ import annotations

import random

from pd.bench.serve.arrivals import arrival_times
from pd.bench.serve.text import TokenText
from pd.bench.serve.trace import BLOCK_TOKENS, TraceEntry
from pd.bench.serve.workloads import Job, WorkloadConfig, build
from pd.sim.cluster import Segment, SimJob, SimTurn


class CountingText(TokenText):
    """`TokenText` without a tokenizer: the same draws from `rng`, text as placeholders."""

    def __init__(self) -> None:  # no super().__init__(): there is no tokenizer to scan
        self.words = [" w"]
        self.lengths: dict[str, int] = {}  # placeholder -> its tokens

    def random(self, n: int, rng: random.Random) -> str:
        rng.choices(self.words, k=n)  # NOTE: keeps `rng` where TokenText.random leaves it
        return self._placeholder(f"random:{n}", n)

    def block_words(self, seed: int | str, n: int) -> list[str]:
        return self.words * n

    def block(self, seed: int | str, n: int) -> str:
        return self._placeholder(f"block:{seed}:{n}", n)

    def _placeholder(self, text: str, n: int) -> str:
        self.lengths[text] = n
        return text


def workload_jobs(cfg: WorkloadConfig) -> list[SimJob]:
    text = CountingText()
    return [_sim_job(job, text) for job in build(cfg, text)]


def _sim_job(job: Job, text: CountingText) -> SimJob:
    if not job.chat:  # completions (random, mixed): nothing shared
        return SimJob(job.job_id, tuple(SimTurn(t.input_len, t.max_tokens) for t in job.turns))
    turns = []
    history = 0  # tokens of the earlier turns' user messages and answers
    for t in job.turns:
        system = text.lengths[t.system or ""] if t.system else 0
        user = t.input_len - system
        segments: tuple[Segment, ...] = ((t.system, system),) if system else ()
        segments += ((job.job_id, history + user),)
        turns.append(SimTurn(system + history + user, t.max_tokens, segments))
        history += user + t.max_tokens
    return SimJob(job.job_id, tuple(turns))


def trace_jobs(entries: list[TraceEntry]) -> list[SimJob]:
    """One job per entry, at its timestamp from the first (as `trace.trace_jobs` sends them)."""
    t0 = min(e.timestamp_ms for e in entries)
    jobs = []
    for i, e in enumerate(entries):
        segments: list[Segment] = []
        covered = 0
        for h in e.hash_ids:
            if covered >= e.input_length:
                break
            n = min(BLOCK_TOKENS, e.input_length - covered)
            segments.append((("trace", h), n))
            covered += n
        if covered < e.input_length:  # past the trace's blocks: this request's own tokens
            segments.append((("trace-request", i), e.input_length - covered))
        turn = SimTurn(e.input_length, e.output_length, tuple(segments))
        jobs.append(SimJob(f"t{i}", (turn,), at_s=(e.timestamp_ms - t0) / 1000))
    return jobs


def natural_rate(jobs: list[SimJob]) -> float | None:
    """A trace's own rate (jobs per second over its span); None for a workload or no span."""
    times = [j.at_s for j in jobs if j.at_s is not None]
    if len(times) < 2 or len(times) != len(jobs) or max(times) == min(times):
        return None
    return (len(times) - 1) / (max(times) - min(times))


def arrivals_at(jobs: list[SimJob], rate: float, arrival: str, seed: int) -> list[float]:
    """When each job starts at `rate` jobs per second: a workload's open-loop schedule
    (`arrival_times`, as one `pd-bench serve` phase of that seed draws it), or a trace's own
    timestamps stretched or compressed to that rate (its shape kept)."""
    if jobs and all(j.at_s is not None for j in jobs):
        own = natural_rate(jobs)
        if own is None:
            raise ValueError("a trace needs two distinct timestamps to be replayed at a rate")
        return [(j.at_s or 0.0) * own / rate for j in jobs]
    return arrival_times(len(jobs), rate, arrival, random.Random(seed))
