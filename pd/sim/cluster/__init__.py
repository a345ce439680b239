"""The planner's in-process discrete-event model of a pd cluster (`pd-bench plan`): workers
running pd's scheduler over page counts in the cost model's time, a router, KV pulls.

May import: pd.sim. Never pd.bench (which builds its jobs) or the worker.
"""

from pd.sim.cluster.des import ClusterSim, SimResult, simulate
from pd.sim.cluster.requests import RequestTiming, Segment, SimJob, SimTurn
from pd.sim.cluster.spec import POLICIES, ClusterSpec, Limits, Pool

__all__ = [
    "POLICIES",
    "ClusterSim",
    "ClusterSpec",
    "Limits",
    "Pool",
    "RequestTiming",
    "Segment",
    "SimJob",
    "SimResult",
    "SimTurn",
    "simulate",
]
