"""The engine: request and batch types, the loop (schedule -> execute -> postprocess), the
scheduler and its page accounting, admission (`AdmitRequest`), and the KV connector through which
KV comes from and goes to other workers. It knows no worker role.

May import: pd.protocol, pd.kvcache, pd.worker.model, pd.worker.text, pd.worker.metrics.
Never pd.transfer (the connectors reach the engine through `KVConnector`, `LentPages` and
`RequestHandle.on_abort`).
"""

from pd.worker.engine.admission import Capacity
from pd.worker.engine.admit_request import AdmitRequest, every_choice
from pd.worker.engine.batch import ScheduledBatch
from pd.worker.engine.connector import FirstToken, KVConnector, LentPages
from pd.worker.engine.engine import Engine
from pd.worker.engine.request import Delta, LogprobEntry, RequestHandle, SeqStatus, Sequence
from pd.worker.engine.scheduler import Scheduler

__all__ = [
    "AdmitRequest",
    "Capacity",
    "Delta",
    "Engine",
    "FirstToken",
    "KVConnector",
    "LentPages",
    "LogprobEntry",
    "RequestHandle",
    "ScheduledBatch",
    "Scheduler",
    "SeqStatus",
    "Sequence",
    "every_choice",
]
