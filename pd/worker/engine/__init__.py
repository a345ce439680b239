"""The engine: request and batch types, the loop (schedule -> execute -> postprocess), the
scheduler and its page accounting, admission, and the hooks the PD roles plug into.

May import: pd.protocol, pd.kvcache, pd.worker.model, pd.worker.text, pd.worker.metrics.
Never pd.transfer (the roles reach the engine through `RoleHooks`, `HeldPages`, `PageWaiters`
and `RequestHandle.on_abort`).
"""

from pd.worker.engine.admission import Capacity
from pd.worker.engine.batch import ScheduledBatch
from pd.worker.engine.engine import Engine
from pd.worker.engine.hooks import HeldPages, PageWaiters, RoleHooks
from pd.worker.engine.request import Delta, LogprobEntry, RequestHandle, SeqStatus, Sequence
from pd.worker.engine.scheduler import Scheduler

__all__ = [
    "Capacity",
    "Delta",
    "Engine",
    "HeldPages",
    "LogprobEntry",
    "PageWaiters",
    "RequestHandle",
    "RoleHooks",
    "ScheduledBatch",
    "Scheduler",
    "SeqStatus",
    "Sequence",
]
