"""pd.transfer: the data plane of PD disaggregation (see docs/transfer.md).

The decode side pulls a request's slots (KV pages, and any other pool) from the prefill side with
one-sided reads; `done`, `abort` and lease renewals travel on a ZMQ bootstrap channel that both
sides authenticate with the cluster token.

Prefill (P)::

    mgr = create_manager(TransferConfig(backend="nixl", bootstrap_port=0))
    await mgr.start()
    mgr.register_pool(kv_pool_from_tensors("kv", kv_tensors_per_rank, total_kv_heads))
    sender = mgr.create_sender({"kv": page_ids}, on_release=lambda s, reason: free(page_ids))
    answer["kv_transfer_params"] = sender.params().to_dict()   # + model fields from the worker

Decode (D)::

    rx = mgr.create_receiver(TransferParams.from_dict(kv_transfer_params))  # starts handshake
    rx.init({"kv": my_preallocated_page_ids})                               # when pages exist
    if await rx.wait() is KVPoll.Failed: raise ... rx.failure_reason
"""

from pd.protocol.wire import TransferParams
from pd.transfer.base import KVBootstrapServer, KVManager, KVReceiver, KVSender, SlotIds
from pd.transfer.config import TransferConfig
from pd.transfer.errors import (
    AuthError,
    BackendUnavailable,
    ContractMismatch,
    HandshakeError,
    PeerLostError,
    PoolError,
    ProtocolError,
    TransferError,
    TransferFailed,
)
from pd.transfer.factory import BACKENDS, create_manager, make_backend
from pd.transfer.manager import ManagerState, TransferManager
from pd.transfer.nixl_compat import import_nixl, nixl_available
from pd.transfer.poll import KVPoll
from pd.transfer.pools import (
    PoolDesc,
    RankRegion,
    TpSplit,
    kv_pool_from_tensors,
    whole_pool_from_tensors,
)

__all__ = [
    "AuthError",
    "BACKENDS",
    "BackendUnavailable",
    "ContractMismatch",
    "HandshakeError",
    "KVBootstrapServer",
    "KVManager",
    "KVPoll",
    "KVReceiver",
    "KVSender",
    "ManagerState",
    "PeerLostError",
    "PoolDesc",
    "PoolError",
    "ProtocolError",
    "RankRegion",
    "SlotIds",
    "TpSplit",
    "TransferConfig",
    "TransferError",
    "TransferFailed",
    "TransferManager",
    "TransferParams",
    "create_manager",
    "import_nixl",
    "kv_pool_from_tensors",
    "make_backend",
    "nixl_available",
    "whole_pool_from_tensors",
]
