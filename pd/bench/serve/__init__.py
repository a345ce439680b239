"""`pd-bench serve`: open-loop serving benchmark (workloads, traces, arrivals, a streaming client,
goodput and SLO metrics, CSV and plots). See cli.py and docs/BENCHMARKS.md."""

from pd.bench.serve.cli import add_arguments, run

__all__ = ["add_arguments", "run"]
