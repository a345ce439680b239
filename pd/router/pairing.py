"""Which prefill worker may hand a request to which decode worker: only one that computes the
same way (`runtime_format` in each worker's /health: compute dtype, the linear layers' and the
LM head's formats, attention). P's first token and K/V and D's next tokens are one answer; a
pair on two formats would answer with two models (and D refuses it at the handshake). The
router keeps each request on a matching pair (proxy.py), says in its log when a worker's format
differs from a worker's of the other pool, and counts such pairs (`pd_router_unpaired_workers`).
"""

from __future__ import annotations

import logging

from pd.router.worker import Worker

log = logging.getLogger("pd.router")


def same_format(p: Worker, d: Worker) -> bool:
    """Whether P and D report the same runtime format (both none: workers that report none,
    as a stub's, pair as before)."""
    return p.runtime_format == d.runtime_format


def describe(fmt: dict[str, str] | None) -> str:
    if fmt is None:
        return "no runtime format"
    return " ".join(f"{k}={v}" for k, v in sorted(fmt.items()))


def unpaired(prefill: list[Worker], decode: list[Worker]) -> list[tuple[Worker, Worker]]:
    """The (P, D) of these workers that will not be paired: their formats differ."""
    return [(p, d) for p in prefill for d in decode if not same_format(p, d)]


def report_format(w: Worker, others: list[Worker]) -> None:
    """Log the workers of the other pool (`others`) that `w`, whose format was just learnt or
    changed, will not be paired with."""
    apart = [o for o in others if o.runtime_format is not None and not same_format(w, o)]
    if apart:
        log.warning(
            "%s worker %s runs %s; %s run another format and will not be paired with it: %s",
            w.role,
            w.url,
            describe(w.runtime_format),
            ", ".join(o.url for o in apart),
            "; ".join(f"{o.url} runs {describe(o.runtime_format)}" for o in apart),
        )
