"""The `virtual` connector: the decision written for an external system to act on (a cluster
manager, a script, an operator), which acknowledges it when done, as Dynamo's virtual connector
does through its key-value store.

The decision file (`--decision-file PATH`) holds one JSON object, replaced atomically:
`{"revision": n, "prefill": p, "decode": d, "at": t, "reasons": [...]}`. The external system
writes `{"revision": n}` to `PATH.ack` once the cluster has `p` and `d` workers. The planner
writes a new revision only when its target changed, and not while the last is unacknowledged,
unless `ack_timeout_s` has passed since it was written (then it says so and goes on).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from pd.planner.connector import Connector
from pd.planner.decide import Decision
from pd.planner.signals import Observation

log = logging.getLogger("pd.planner")


class VirtualConnector(Connector):
    name = "virtual"

    def __init__(
        self, path: str, ack_timeout_s: float = 300.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.path = Path(path)
        self.ack_path = Path(f"{path}.ack")
        self.ack_timeout_s = ack_timeout_s
        self.clock = clock
        self.revision = 0
        self.written: tuple[int, int] | None = None
        self.written_at = 0.0

    def acknowledged(self) -> int:
        """The last revision the external system acknowledged (0: none)."""
        try:
            return int(json.loads(self.ack_path.read_text())["revision"])
        except (OSError, ValueError, KeyError, TypeError):
            return 0

    async def apply(self, decision: Decision, obs: Observation) -> list[str]:
        target = (decision.prefill, decision.decode)
        if target == self.written:
            return []
        if self.revision and self.acknowledged() < self.revision:
            waited = self.clock() - self.written_at
            if waited < self.ack_timeout_s:
                return []
            log.warning(
                "decision %d unacknowledged after %.0f s: writing the next", self.revision, waited
            )
        self.revision += 1
        body = {
            "revision": self.revision,
            "prefill": decision.prefill,
            "decode": decision.decode,
            "at": decision.at,
            "reasons": list(decision.reasons),
        }
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(body) + "\n")
        os.replace(tmp, self.path)
        self.written, self.written_at = target, self.clock()
        return [f"wrote revision {self.revision}: prefill={target[0]} decode={target[1]}"]
