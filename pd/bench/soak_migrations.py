"""What `pd-bench soak` learns of the router's migrations (issue 22).

Per request, exactly, from the router's log: every request of the soak carries its own
`X-Request-Id`, which names the router's two lines of each migration (pd/router/migrate.py):

    request <id>: choice <i> migrates after <k> tokens from <url> (<reason>), migration <m>
    request <id>: choice <i> resumed <wait> s after the break, migration <m>

(the second once the continuation's first byte came; its wait is the one the router's histogram
gets). By reason, from the router's `/metrics`: `pd_router_migrations_total{reason}` and the
histogram `pd_router_migration_wait_seconds` (its count, sum and buckets: a cross-check of the
log, to the bucket's resolution).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

MIGRATES = re.compile(
    r"request (?P<id>\S+): choice (?P<choice>\d+) migrates after (?P<tokens>\d+) tokens from "
    r"(?P<url>\S+) \((?P<reason>[a-z_]+)\), migration (?P<m>\d+)"
)
RESUMED = re.compile(
    r"request (?P<id>\S+): choice (?P<choice>\d+) resumed (?P<wait>\d+(?:\.\d+)?) s after the "
    r"break, migration (?P<m>\d+)"
)


@dataclass
class Migration:
    """One migration of one choice of a request, as the router logged it."""

    request_id: str
    choice: int
    tokens: int  # relayed to the client before the break
    worker: str  # whose stream broke
    reason: str  # broken, eof, ejected, idle, draining
    number: int  # the request's m-th migration
    wait_s: float | None = None  # break -> the continuation's first byte; None: never resumed


def read_log(text: str) -> list[Migration]:
    """Every migration in a router log, with its wait when the log has it."""
    out: list[Migration] = []
    open_: dict[tuple[str, int, int], Migration] = {}
    for line in text.splitlines():
        if (m := MIGRATES.search(line)) is not None:
            mig = Migration(
                m["id"], int(m["choice"]), int(m["tokens"]), m["url"], m["reason"], int(m["m"])
            )
            out.append(mig)
            open_[(mig.request_id, mig.choice, mig.number)] = mig
        elif (m := RESUMED.search(line)) is not None:
            key = (m["id"], int(m["choice"]), int(m["m"]))
            if key in open_:
                open_.pop(key).wait_s = float(m["wait"])
    return out


def by_request(migrations: Iterable[Migration]) -> dict[str, list[Migration]]:
    out: dict[str, list[Migration]] = {}
    for mig in migrations:
        out.setdefault(mig.request_id, []).append(mig)
    return out


def quantile(values: list[float], q: float) -> float:
    """Nearest rank: the smallest value with at least a share `q` of `values` at or below it
    (with fewer than 100 values, p99 is the max)."""
    ordered = sorted(values)
    assert ordered, "a quantile of nothing"
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def spread(values: list[float]) -> dict[str, float | int | None]:
    """count, p50, p99 and max of `values` (seconds, to the ms); None each when empty."""
    if not values:
        return {"count": 0, "p50": None, "p99": None, "max": None}
    return {
        "count": len(values),
        "p50": round(quantile(values, 0.5), 3),
        "p99": round(quantile(values, 0.99), 3),
        "max": round(max(values), 3),
    }


@dataclass
class RouterMigrations:
    """The router's own counts (`/metrics`)."""

    reasons: dict[str, int] = field(default_factory=dict)  # pd_router_migrations_total
    wait_count: int = 0
    wait_sum: float = 0.0
    wait_buckets: list[tuple[float, int]] = field(default_factory=list)  # (le, cumulative)

    def wait_quantile_le(self, q: float) -> float | None:
        """The upper bound of the bucket that holds the q-th wait (None: no wait observed)."""
        if not self.wait_count:
            return None
        rank = max(1, math.ceil(q * self.wait_count))
        return next((le for le, n in self.wait_buckets if n >= rank), None)

    def to_dict(self) -> dict[str, object]:
        return {
            "reasons": self.reasons,
            "wait_count": self.wait_count,
            "wait_sum_s": round(self.wait_sum, 3),
            "wait_p50_le_s": self.wait_quantile_le(0.5),
            "wait_p99_le_s": self.wait_quantile_le(0.99),
        }


def read_metrics(text: str) -> RouterMigrations:
    """The migration families of a router's Prometheus text."""
    out = RouterMigrations()
    for family in text_string_to_metric_families(text):
        if family.name == "pd_router_migrations":
            for s in family.samples:
                if s.name == "pd_router_migrations_total":
                    out.reasons[s.labels.get("reason", "")] = int(s.value)
        elif family.name == "pd_router_migration_wait_seconds":
            for s in family.samples:
                if s.name.endswith("_count"):
                    out.wait_count = int(s.value)
                elif s.name.endswith("_sum"):
                    out.wait_sum = float(s.value)
                elif s.name.endswith("_bucket"):
                    out.wait_buckets.append((float(s.labels["le"]), int(s.value)))
    out.wait_buckets.sort()
    return out
