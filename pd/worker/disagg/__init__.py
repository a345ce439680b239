"""The PD roles: the prefill side (pin and hand off a prefilled request's KV) and the decode
side (validate the params, pull the KV, decode from there), over pd.transfer.

May import: pd.transfer, pd.worker.engine (its hooks and request types), pd.worker.model.
"""

from pd.worker.disagg.contract import KV_LAYOUT, KV_POOL, KVContract, TransferRole
from pd.worker.disagg.decode_side import DecodeSide
from pd.worker.disagg.prefill_side import PrefillSide

__all__ = ["KV_LAYOUT", "KV_POOL", "DecodeSide", "KVContract", "PrefillSide", "TransferRole"]
