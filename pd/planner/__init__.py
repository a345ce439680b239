"""The planner (issue 43): how many prefill and how many decode workers the cluster needs, from
tokens, not request counts, decided online from what the router and the workers export.

This package is the planner's pure core, torch- and network-free: what it observes
(`signals.py`), what it fits online (`fit.py`: a decode step's time against its rows and KV
tokens, a prefill worker's token rate), and how it decides (`decide.py`: a predictive floor from
the arrival rate and lengths, reactive steps of one worker on top, scale-down only when one worker
fewer still meets the SLOs, after a cool-down; bounds per role and a budget both roles share).
The process that polls the cluster and the connectors that act (local, simulated, virtual) are
the next rooms (docs/planner.md).
"""

from pd.planner.decide import SLO, Bounds, Decision, Planner, PlannerKnobs
from pd.planner.fit import RateFit, StepFit
from pd.planner.signals import Observation, StepSample, WorkerSignals

__all__ = [
    "SLO",
    "Bounds",
    "Decision",
    "Observation",
    "Planner",
    "PlannerKnobs",
    "RateFit",
    "StepFit",
    "StepSample",
    "WorkerSignals",
]
