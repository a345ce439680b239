"""The virtual connector (pd/planner/virtual.py): the decision written atomically with a revision,
a new one only when the target changes and the last was acknowledged (or its ack timed out)."""

from __future__ import annotations

import json

from pd.planner import Decision, Observation
from pd.planner.virtual import VirtualConnector

OBS = Observation(0.0, ())


def decision(prefill: int, decode: int) -> Decision:
    return Decision(0.0, prefill, decode, ("test",))


async def test_revisions_wait_for_their_acknowledgement(tmp_path):
    now = [0.0]
    path = tmp_path / "plan.json"
    c = VirtualConnector(str(path), ack_timeout_s=60, clock=lambda: now[0])
    assert await c.apply(decision(1, 1), OBS) == ["wrote revision 1: prefill=1 decode=1"]
    assert json.loads(path.read_text()) == {
        "revision": 1, "prefill": 1, "decode": 1, "at": 0.0, "reasons": ["test"],
    }  # fmt: skip
    assert await c.apply(decision(1, 1), OBS) == []  # unchanged: nothing written
    assert await c.apply(decision(1, 2), OBS) == []  # changed, but 1 is not acknowledged
    assert json.loads(path.read_text())["revision"] == 1
    (tmp_path / "plan.json.ack").write_text('{"revision": 1}')
    assert await c.apply(decision(1, 2), OBS) == ["wrote revision 2: prefill=1 decode=2"]
    now[0] = 61.0  # never acknowledged: after the timeout the next goes out anyway
    assert await c.apply(decision(2, 2), OBS) == ["wrote revision 3: prefill=2 decode=2"]
    assert not list(tmp_path.glob("*.tmp"))
