"""Where the router's workers come from (`--discovery`): `static` (the --prefill, --decode and
--worker flags, and workers that register themselves), `file` (a file of roles and URLs,
watched: file.py) or `kubernetes` (EndpointSlices, listed and watched: kubernetes.py). A source says which workers should be there; `WorkerSet` applies that to the
registry (sync.py)."""

from pd.router.discovery.file import FileDiscovery, parse_worker_file
from pd.router.discovery.sync import WorkerSet

__all__ = ["FileDiscovery", "WorkerSet", "parse_worker_file"]
