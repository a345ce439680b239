"""`--priority-mix`: each job's priority class, drawn from a mix with the run's seed (issue 45).

A mix is `CLASS=WEIGHT,...` over the router's classes (system, interactive, default, batch;
pd/router/admission.py, docs/api.md "Priority classes"). Weights must be positive and are
normalised: `interactive=1,batch=4` is `interactive=0.2,batch=0.8`. Each job (a request, or a
whole conversation: its turns keep one class) draws its class, in job order, from a generator
seeded with `--seed`, so a run repeats and every rate and target is sent the same classes.
A request names its class with the `X-Priority-Class` header only: vLLM's body `priority` is
refused by a vLLM server not started with `--scheduling-policy priority`.
"""

from __future__ import annotations

import math
import random

from pd.bench.serve.workloads import Job
from pd.router.admission import CLASS_HEADER, CLASSES

__all__ = ["CLASS_HEADER", "CLASSES", "assign_classes", "draw_classes", "parse_mix"]


def parse_mix(text: str) -> dict[str, float]:
    """`CLASS=WEIGHT,...` as class -> share, the shares summing to 1, in `CLASSES` order
    (highest first). ValueError on a malformed item, an unknown or repeated class, or a weight
    that is not a positive finite number."""
    weights: dict[str, float] = {}
    for item in text.split(","):
        name, sep, value = item.partition("=")
        name = name.strip().lower()
        if not sep or not name:
            raise ValueError(
                f"takes CLASS=WEIGHT,... (e.g. interactive=0.2,batch=0.8), got {text!r}"
            )
        if name not in CLASSES:
            raise ValueError(f"unknown class {name!r}: choose from {', '.join(CLASSES)}")
        if name in weights:
            raise ValueError(f"class {name} is given twice")
        try:
            weight = float(value)
        except ValueError:
            raise ValueError(f"{name}'s weight must be a number, got {value.strip()!r}") from None
        if not (weight > 0 and math.isfinite(weight)):
            raise ValueError(f"{name}'s weight must be > 0, got {value.strip()}")
        weights[name] = weight
    total = sum(weights.values())
    return {c: weights[c] / total for c in CLASSES if c in weights}


def draw_classes(n: int, mix: dict[str, float], seed: int) -> list[str]:
    """`n` classes drawn independently with the mix's shares; the same for the same seed."""
    rng = random.Random(f"priority-mix:{seed}")
    names = list(mix)
    return rng.choices(names, weights=[mix[c] for c in names], k=n)


def assign_classes(jobs: list[Job], mix: dict[str, float], seed: int) -> None:
    """Set each job's `priority_class` (in place), drawn in job order."""
    for job, cls in zip(jobs, draw_classes(len(jobs), mix, seed)):
        job.priority_class = cls
