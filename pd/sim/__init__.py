"""The simulated GPU cluster: profiles (a model's shape on a GPU's datasheet), the cost model
every simulated part shares, and what runs on it (see docs/simulation.md).

The profile and the cost model are pure Python (the planner imports nothing else). pd/sim is a
library below the worker: it imports nothing from pd.worker, pd.router or pd.bench; the simulated
runner and the host of several simulated workers in one process live in the worker
(pd/worker/simulated/).
"""

from pd.sim.cost import CostModel, StepCost
from pd.sim.profile import (
    DeviceSpec,
    LinkSpec,
    ModelSpec,
    Profile,
    list_presets,
    parse_profile,
)

__all__ = [
    "CostModel",
    "DeviceSpec",
    "LinkSpec",
    "ModelSpec",
    "Profile",
    "StepCost",
    "list_presets",
    "parse_profile",
]
