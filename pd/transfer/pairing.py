"""The pairing check of the handshake: D compares the contract in P's Welcome with its own.

Contracts are opaque string maps to this layer (the worker puts its checkpoint digest and KV
format there: pd/worker/disagg/contract.py); every key of either side must be on both, equal.
The runtime format (quantization, kernels) travels beside it and is only described in logs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pd.transfer.errors import ContractMismatch

MAX_VALUE_CHARS = 200  # of a peer's value quoted in an error or a log line


def _clip(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= MAX_VALUE_CHARS else text[:MAX_VALUE_CHARS] + "..."


def describe(values: Mapping[str, Any] | None) -> str:
    """`a=1 b=2`, or "nothing reported"."""
    if not values:
        return "nothing reported"
    items = sorted(values.items(), key=lambda kv: str(kv[0]))
    return " ".join(f"{k}={str(v)[:MAX_VALUE_CHARS]}" for k, v in items)


def check_contract(
    ours: Mapping[str, str] | None,
    theirs: Any,
    *,
    peer: str,
    me: str,
    peer_runtime: Any = None,
    my_runtime: Mapping[str, str] | None = None,
) -> None:
    """Raise ContractMismatch unless P's contract (`theirs`, from its Welcome) equals ours, in
    every key of either side; the message names P (`peer`) and this side (`me`), and each key
    that differs with both values. `ours` None: nothing is checked."""
    if ours is None:
        return
    if not isinstance(theirs, Mapping):
        theirs = {}
    diffs = []
    for key in sorted(set(ours) | set(theirs)):
        mine, other = ours.get(key), theirs.get(key)
        if mine != other:
            p = "not reported" if other is None else _clip(other)
            d = "not reported" if mine is None else _clip(mine)
            diffs.append(f"{key}: prefill {p}, decode {d}")
    if not diffs:
        return
    raise ContractMismatch(
        f"prefill {peer} and this decode side ({me}) do not pair: {'; '.join(diffs)} "
        f"(prefill runs {describe(peer_runtime if isinstance(peer_runtime, Mapping) else None)}; "
        f"decode runs {describe(my_runtime)})"
    )
