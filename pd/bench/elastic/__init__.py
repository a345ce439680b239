"""`pd-bench elastic` (issue 43): the planner against a fixed split and HPA v2, on a simulated
GPU cluster under a changing load (run.py)."""

from pd.bench.elastic.run import add_arguments, run

__all__ = ["add_arguments", "run"]
