"""The transfer part of `kv_transfer_params`: what D needs to find and pull a request's slots."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pd.transfer.errors import ProtocolError


@dataclass(frozen=True)
class TransferParams:
    remote_host: str  # P's bootstrap host
    remote_port: int  # P's bootstrap port
    remote_engine_id: str  # P's engine id (changes when P restarts)
    transfer_id: str
    page_ids: dict[str, list[int]]  # pool name -> P's slot ids
    lease_ttl_s: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "remote_host": self.remote_host,
            "remote_port": self.remote_port,
            "remote_engine_id": self.remote_engine_id,
            "transfer_id": self.transfer_id,
            "page_ids": {k: list(v) for k, v in self.page_ids.items()},
            "lease_ttl_s": self.lease_ttl_s,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TransferParams:
        try:
            p = cls(
                remote_host=str(d["remote_host"]),
                remote_port=int(d["remote_port"]),
                remote_engine_id=str(d["remote_engine_id"]),
                transfer_id=str(d["transfer_id"]),
                page_ids={str(k): [int(i) for i in v] for k, v in dict(d["page_ids"]).items()},
                lease_ttl_s=float(d["lease_ttl_s"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(f"invalid transfer params: {e!r}") from None
        if not (0 < p.remote_port < 65536) or p.lease_ttl_s <= 0 or not p.transfer_id:
            raise ProtocolError("invalid transfer params: port, lease or transfer id out of range")
        return p
