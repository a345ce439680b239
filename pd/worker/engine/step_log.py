"""The step record: what a worker's steps cost, for the planner's fits (issue 43).

Per step, the time the runner took (on its thread: the forward pass, or the simulated sleep),
split by what the step did: prompt tokens it computed (a prefill worker's rate is those tokens
over the busy seconds of the steps that computed them) and, for a step of decode rows alone, its
rows, the KV tokens they attend to and its seconds (a decode worker's step-time fit). Totals
since start, so a reader takes differences; decode samples in a window of the latest, each with
its step index, so a reader asks for those after the last it saw (`GET /steps?after=N`).

Pure Python: the engine records on its event loop, `/steps` reads from it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

WINDOW = 256  # decode samples kept (a reader polling every few seconds sees them all at ~50/s)


class StepLog:
    def __init__(self, window: int = WINDOW) -> None:
        self.steps = 0
        self.prefill_tokens = 0  # prompt tokens computed (cache hits excluded)
        self.prefill_busy_s = 0.0  # seconds of the steps that computed prompt tokens
        self.prefills_done = 0  # prompts whose last chunk was computed
        # arrival to the end of the step that computed a prompt's last chunk, summed over those
        # prompts: on a prefill worker the part of the TTFT it serves (queue and prefill)
        self.prefill_latency_s = 0.0
        self.sampled_tokens = 0  # tokens sampled, every row
        self.decode: deque[tuple[int, int, int, float]] = deque(maxlen=window)
        self.last_decode: tuple[int, int] = (0, 0)  # the latest decode step's rows and KV tokens

    def record(
        self,
        prompt_lens: Sequence[int],
        num_cached: Sequence[int],
        num_new: Sequence[int],
        sampled: int,
        seconds: float,
        waited: Sequence[float] = (),
    ) -> None:
        """One step: per row its prompt's length, tokens cached before it, tokens it computed,
        and (optional) the seconds since its request arrived, at the step's end."""
        prefill = 0
        kv = 0
        for i, (plen, cached, new) in enumerate(zip(prompt_lens, num_cached, num_new)):
            kv += cached + new
            if cached < plen:  # a prompt chunk (a decode row has its whole prompt cached)
                prefill += min(new, plen - cached)
                if cached + new >= plen:
                    self.prefills_done += 1
                    if i < len(waited):
                        self.prefill_latency_s += waited[i]
        self.steps += 1
        self.sampled_tokens += sampled
        if prefill:
            self.prefill_tokens += prefill
            self.prefill_busy_s += seconds
        elif num_new:
            self.decode.append((self.steps, len(num_new), kv, seconds))
            self.last_decode = (len(num_new), kv)

    def since(self, after: int) -> dict[str, Any]:
        """The totals, and the samples (steps of decode rows alone) after step index `after`
        (`[rows, kv tokens, seconds]` each, oldest first; those past the window are gone)."""
        return {
            "steps": self.steps,
            "prefill_tokens": self.prefill_tokens,
            "prefill_busy_s": round(self.prefill_busy_s, 6),
            "prefills_done": self.prefills_done,
            "prefill_latency_s": round(self.prefill_latency_s, 6),
            "sampled_tokens": self.sampled_tokens,
            "last_sample": {"rows": self.last_decode[0], "kv_tokens": self.last_decode[1]},
            "samples": [[r, kv, round(s, 6)] for i, r, kv, s in self.decode if i > after],
        }
