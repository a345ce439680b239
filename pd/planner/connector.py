"""What acts on the planner's decisions: a `Connector` is told each decision and the observation
it came from, and brings the cluster towards it.

- `VirtualConnector` (virtual.py) writes the decision for an external system to act on and
  acknowledge, as Dynamo's virtual connector does;
- `LocalConnector` and `SimulatedConnector` (processes.py) start and stop worker processes on
  this host: `pd-worker`, or hosts of `--simulate` workers whose start-up takes their profile's
  time;
- `KubernetesConnector` (kubernetes.py) sets the replicas of the prefill and decode Deployments
  of deploy/kubernetes through their scale subresource, the pod it chose drained first.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from pd.planner.decide import Decision
from pd.planner.signals import Observation


class Connector(ABC):
    name: str = "connector"

    async def start(self) -> None:  # noqa: B027 - optional: most connectors need nothing
        """Before the first decision."""

    @abstractmethod
    async def apply(self, decision: Decision, obs: Observation) -> list[str]:
        """Act towards `decision`; returns what it did (one line each, for the log)."""

    def pending(self) -> dict[str, dict[str, int]]:
        """Per role, workers on their way: {"starting": n, "leaving": n} (for the metrics)."""
        return {}

    async def close(self) -> None:  # noqa: B027 - optional
        """The planner stops: leave the cluster as it is, or stop what it started."""
