"""The arrival rate and mean lengths the planner reads off a window of polls: pure, on the
cluster's counters at each poll (`Totals`), oldest first.

A few seconds of a bursty load say little of its rate, so the rate and the lengths are the
window's; a rise shows at once (the last polls' rate when it is higher beyond the noise of their
count at two polls in a row, and their mean prompt when it is longer), a fall waits for the window, as scale-downs
wait for their cool-down. A longer prompt read at once keeps the prompt tokens a second that P
receives (computed, plus the change of its queue): a phase of longer prompts at a lower rate is
not more tokens, where the window's rate times the last polls' length would read it as more.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

RECENT_POLLS = 3  # the short window a rise is read over
RISE_SIGMAS = 2.0  # ... when it is this many standard deviations of its Poisson count
# ... at this many polls in a row: one poll's chance excess is not a rise (at 4 a second, one
# poll in 250 read one, a worker started and let go; two in a row: one in 1700)
RISE_POLLS = 2
RECENT_PROMPTS = 8  # prompts done in the last polls before their mean length counts as a rise


@dataclass(frozen=True)
class Totals:
    """The cluster's counters at one poll (totals since the planner's start)."""

    at: float
    arrivals: float
    prefill_tokens: int  # prompt tokens computed
    prefills_done: int
    sampled_tokens: int
    prefill_latency_s: float  # arrival to prompt computed, summed over the prefills done
    ttft_s: float  # the router's TTFT: its sum and count
    ttfts: float
    queued_prefill_tokens: int = 0  # prompt tokens waiting on the prefill workers now


@dataclass(frozen=True)
class Windowed:
    arrivals_per_s: float
    prompt_tokens: float  # mean uncached prompt tokens a request
    output_tokens: float  # mean output tokens a request
    ttft_overhead_s: float  # the TTFT's part no prefill worker serves (mean)


def _tokens_in(a: Totals, b: Totals) -> float:
    """Prompt tokens that reached the prefill workers between two polls, a second."""
    span = b.at - a.at
    if span <= 0:
        return 0.0
    return (
        b.prefill_tokens - a.prefill_tokens + b.queued_prefill_tokens - a.queued_prefill_tokens
    ) / span


def _rate(a: Totals, b: Totals) -> float:
    span = b.at - a.at
    return (b.arrivals - a.arrivals) / span if span > 0 else 0.0


def _risen(totals: Sequence[Totals]) -> float | None:
    """The last polls' arrival rate where it is above the window's beyond the noise of their
    count (None: not, or too few polls)."""
    if len(totals) < 2:
        return None
    last, recent = totals[-1], totals[-min(len(totals), RECENT_POLLS + 1)]
    short = last.at - recent.at
    if short <= 0:
        return None
    count = last.arrivals - recent.arrivals
    if count / short - _rate(totals[0], last) > RISE_SIGMAS * math.sqrt(max(count, 1.0)) / short:
        return count / short
    return None


def windowed(totals: Sequence[Totals]) -> Windowed:
    """The rate and lengths over `totals` (the window's polls, oldest first; at least one)."""
    totals = list(totals)  # a deque's slices
    first, last = totals[0], totals[-1]
    recent = totals[-min(len(totals), RECENT_POLLS + 1)]
    rate = _rate(first, last)
    rise = _risen(totals)
    earlier = (_risen(totals[: len(totals) - k]) for k in range(1, RISE_POLLS))
    if rise is not None and all(r is not None for r in earlier):
        rate = rise
    done = last.prefills_done - first.prefills_done
    prompt = (last.prefill_tokens - first.prefill_tokens) / done if done else 0.0
    lately = last.prefills_done - recent.prefills_done
    if lately >= RECENT_PROMPTS:
        longer = (last.prefill_tokens - recent.prefill_tokens) / lately
        if longer > prompt:
            prompt = longer
            tokens = max(_tokens_in(first, last), _tokens_in(recent, last))
            rate = min(rate, tokens / prompt)
    # Each request's first token is sampled on P, the others on D.
    output = (last.sampled_tokens - first.sampled_tokens) / done + 1 if done else 0.0
    # The TTFT's part that no prefill worker serves (the hops, the KV pull, D's first token):
    # the router's mean TTFT less the prefill workers' mean arrival-to-prompt-done.
    overhead = 0.0
    ttfts = last.ttfts - first.ttfts
    if done and ttfts:
        p_latency = (last.prefill_latency_s - first.prefill_latency_s) / done
        overhead = max(0.0, (last.ttft_s - first.ttft_s) / ttfts - p_latency)
    return Windowed(max(0.0, rate), prompt, output, overhead)
