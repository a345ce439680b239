"""Where the router's workers come from (`--discovery`): `static` (the --prefill, --decode and
--worker flags, and workers that register themselves), or `file` (a file of roles and URLs,
watched: file.py). A source says which workers should be there; `WorkerSet` applies that to the
registry (sync.py)."""

from pd.router.discovery.file import FileDiscovery, parse_worker_file
from pd.router.discovery.sync import WorkerSet

__all__ = ["FileDiscovery", "WorkerSet", "parse_worker_file"]
