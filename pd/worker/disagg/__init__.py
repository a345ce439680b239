"""The roles: each one's entry point for the HTTP handler (`Role.admit`: co-located, prefill,
decode), and the PD sides over pd.transfer: the prefill side (pin and hand off a prefilled
request's KV) and the decode side (validate the params, wait for pages in its own queue, pull
the KV, decode from there).

May import: pd.transfer, pd.worker.engine (its hooks and request types), pd.worker.model.
"""

from pd.worker.disagg.contract import KV_LAYOUT, KV_POOL, KVContract, TransferRole
from pd.worker.disagg.decode_side import DecodeSide
from pd.worker.disagg.page_wait import PageWaitQueue
from pd.worker.disagg.prefill_side import PrefillSide
from pd.worker.disagg.roles import CoLocated, Decode, Prefill, Role

__all__ = [
    "KV_LAYOUT",
    "KV_POOL",
    "CoLocated",
    "Decode",
    "DecodeSide",
    "KVContract",
    "PageWaitQueue",
    "Prefill",
    "PrefillSide",
    "Role",
    "TransferRole",
]
