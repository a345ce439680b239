"""The simulated worker (`--simulate PROFILE`): a runner that costs each step by pd/sim's cost
model instead of computing it (`SimulatedRunner`), the token picker that stands in for the
model's choices, and a host that serves several simulated workers in one process
(`python -m pd.worker.simulated.host`). pd/sim, the library below, knows nothing of the worker.
"""

from pd.worker.simulated.runner import SimulatedRunner

__all__ = ["SimulatedRunner"]
