"""The internal wire between router and workers: `WorkerLoad` (a worker's `/health` load) and
`KVTransferParams` (what P returns and D consumes, DESIGN.md §3), versioned and checked.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any

from pd.protocol.errors import bad_request, clip
from pd.protocol.options import MAX_N, MAX_TOKEN_ID, MAX_TOP_LOGPROBS, is_int, is_token_ids


@dataclass
class WorkerLoad:
    """The load a worker reports in `/health` (and the router's policies read)."""

    role: str  # "prefill" | "decode" | "both"
    running: int  # requests in the running batch
    waiting: int  # requests queued for admission
    queued_prefill_tokens: int  # prompt tokens not yet prefilled (waiting + partially prefilled)
    kv_pages_total: int
    kv_pages_free: int  # what an allocation can have: free plus evictable
    inflight_transfers: int = 0  # P: pinned for D; D: pulling or waiting for pages
    kv_pages_held: int = 0  # pages of those transfers (P: pinned; D: reserved for the pull)
    kv_pages_cached: int = 0  # pages whose KV the prefix cache can match (referenced or not)
    kv_pages_evictable: int = 0  # cached pages nobody holds (counted in kv_pages_free)
    kv_page_size: int = 0  # tokens per page (0: not reported); sizes the router's prefix index
    kv_pages_pinned: int = 0  # P: pages pinned for decode workers to pull
    kv_pages_reserved: int = 0  # D: pages reserved for pulls (transferring, or quarantined)
    waiting_for_pages: int = 0  # D: pulled requests queued until their pages fit

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.kv_pages_free / self.kv_pages_total if self.kv_pages_total else 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WorkerLoad:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


# --------------------------------------------------------------------- kv_transfer_params


def _copied(v: Any) -> Any:
    """A list or dict of lists copied (the values inside them shared: numbers, strings, and the
    logprobs' small lists, which nobody changes)."""
    if isinstance(v, list):
        return list(v)
    if isinstance(v, dict):
        return {k: list(x) if isinstance(x, list) else x for k, x in v.items()}
    return v


PD_VERSION = 1


@dataclass(frozen=True)
class TransferParams:
    """The transfer part of `kv_transfer_params`: what D needs to find and pull a request's
    slots (pd.transfer's sender makes it, its receiver takes it)."""

    remote_host: str  # P's bootstrap host
    remote_port: int  # P's bootstrap port
    remote_engine_id: str  # P's engine id (changes when P restarts)
    transfer_id: str
    page_ids: dict[str, list[int]]  # pool name -> P's slot ids
    lease_ttl_s: float

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON values, each list and dict copied one level down
        (`dataclasses.asdict` copies every element one by one: 4 ms for a 4000-token prompt's
        ids, on the event loop of every prefill)."""
        return {f.name: _copied(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TransferParams:
        """The transfer part of params (a ValueError when it is malformed)."""
        try:
            p = TransferParams(
                remote_host=str(d["remote_host"]),
                remote_port=int(d["remote_port"]),
                remote_engine_id=str(d["remote_engine_id"]),
                transfer_id=str(d["transfer_id"]),
                page_ids={str(k): [int(i) for i in v] for k, v in dict(d["page_ids"]).items()},
                lease_ttl_s=float(d["lease_ttl_s"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"invalid transfer params: {e!r}") from None
        if not (0 < p.remote_port < 65536) or p.lease_ttl_s <= 0 or not p.transfer_id:
            raise ValueError("invalid transfer params: port, lease or transfer id out of range")
        return p


@dataclass(frozen=True)
class KVTransferParams(TransferParams):
    """What P answers in `kv_transfer_params` and D consumes (DESIGN.md §3): the transfer part
    and the request's (its ids, its first token, the KV's shape)."""

    prompt_token_ids: list[int]
    first_token_id: int
    num_tokens: int  # tokens whose KV P holds (the prompt, and a continuation's output ids)
    page_size: int
    tp_size: int
    kv_layout: str
    dtype: str
    model_fingerprint: str
    # [logprob, [[token id, logprob], ...]] of the first token when the request asked for them
    first_token_logprobs: list | None = None
    # With n > 1: every choice's first token (first_token_id is the first), all sampled by P from
    # the prompt's last logits, and their logprobs entries (as first_token_logprobs) when asked.
    first_token_ids: list[int] | None = None
    first_tokens_logprobs: list | None = None
    cached_tokens: int = 0  # prompt tokens P's prefix cache served (D reports them in usage)
    # When the request asked for the prompt's logprobs (P computes them as it prefills, D
    # answers them): per prompt token after the first, [logprob, rank, [[token id, logprob],
    # ...]] (that token's logprob and rank at its position, then the most likely alternatives).
    prompt_logprobs: list | None = None
    # A continuation (docs/migration.md §3): the output ids P prefilled after the prompt (its
    # KV covers prompt + these: num_tokens); D's request starts with them as its output.
    output_token_ids: list[int] | None = None
    do_remote_prefill: bool = True
    pd_version: int = PD_VERSION

    @classmethod
    def extending(cls, transfer: TransferParams, **request: Any) -> KVTransferParams:
        """P's params: the sender's transfer part and the request's fields."""
        return cls(**{f.name: getattr(transfer, f.name) for f in fields(TransferParams)}, **request)

    @classmethod
    def from_dict(cls, d: Any) -> KVTransferParams:
        """Parse params as D receives them: every field type- and range-checked like a client's
        input (they come in a request body), a 400 on anything else. Whether they fit this worker
        (vocabulary, context, model) is the decode side's check."""
        if not isinstance(d, dict):
            raise bad_request("'kv_transfer_params' must be an object", "kv_transfer_params")
        if d.get("pd_version") != PD_VERSION:
            raise bad_request(
                f"unsupported kv_transfer_params pd_version {d.get('pd_version')!r} "
                f"(this worker speaks {PD_VERSION})",
                "kv_transfer_params",
            )
        names = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING}
        missing = [n for n in required if n not in d]
        if missing:
            raise bad_request(
                f"kv_transfer_params lacks {', '.join(sorted(missing))}", "kv_transfer_params"
            )
        values = {k: d[k] for k in names if k in d}
        for name, value in values.items():
            check, wants = _KV_FIELDS[name]
            if not check(value):
                raise bad_request(
                    f"kv_transfer_params.{name} is not {wants}: {clip(value)}",
                    "kv_transfer_params",
                )
        return cls(**values)


def _is_str(v: Any) -> bool:
    return isinstance(v, str) and 0 < len(v) <= 256


def _is_logprob(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_first_logprobs(v: Any) -> bool:  # [logprob, [[token id, logprob], ...]]
    if v is None:
        return True
    if not (isinstance(v, list) and len(v) == 2 and _is_logprob(v[0])):
        return False
    top = v[1]
    return top is None or (
        isinstance(top, list)
        and len(top) <= MAX_TOP_LOGPROBS
        and all(
            isinstance(e, list) and len(e) == 2 and is_int(e[0]) and _is_logprob(e[1]) for e in top
        )
    )


def _is_prompt_logprobs(v: Any) -> bool:  # [[logprob, rank, [[token id, logprob], ...]], ...]
    return v is None or (
        isinstance(v, list)
        and all(
            isinstance(e, list)
            and len(e) == 3
            and _is_logprob(e[0])
            and is_int(e[1], 1)
            and isinstance(e[2], list)
            and len(e[2]) <= MAX_TOP_LOGPROBS
            and all(
                isinstance(t, list) and len(t) == 2 and is_int(t[0]) and _is_logprob(t[1])
                for t in e[2]
            )
            for e in v
        )
    )


# Per field of KVTransferParams: its check, and what it must be (for the 400's message).
_KV_FIELDS: dict[str, tuple[Any, str]] = {
    "remote_engine_id": (_is_str, "a string of 1..256 characters"),
    "remote_host": (_is_str, "a host name or address"),
    "remote_port": (lambda v: is_int(v, 1, 65535), "a port (1..65535)"),
    "transfer_id": (_is_str, "a string of 1..256 characters"),
    "prompt_token_ids": (
        lambda v: is_token_ids(v) and len(v) > 0,
        f"a non-empty list of token ids (0..{MAX_TOKEN_ID})",
    ),
    "first_token_id": (is_int, f"a token id (0..{MAX_TOKEN_ID})"),
    "page_ids": (
        lambda v: (
            isinstance(v, dict)
            and all(isinstance(k, str) and is_token_ids(p) for k, p in v.items())
        ),
        "an object of page id lists",
    ),
    "num_tokens": (lambda v: is_int(v, 1), "a positive integer"),
    "page_size": (lambda v: is_int(v, 1, 1 << 16), "a positive integer"),
    "tp_size": (lambda v: is_int(v, 1, 1 << 10), "a positive integer"),
    "kv_layout": (_is_str, "a string"),
    "dtype": (_is_str, "a string"),
    "model_fingerprint": (_is_str, "a string"),
    "lease_ttl_s": (lambda v: _is_logprob(v) and v > 0, "a positive number"),
    "first_token_logprobs": (_is_first_logprobs, "null or [logprob, [[id, logprob], ...]]"),
    "first_token_ids": (
        lambda v: v is None or (is_token_ids(v) and 1 <= len(v) <= MAX_N),
        f"null or a list of 1..{MAX_N} token ids",
    ),
    "first_tokens_logprobs": (
        lambda v: (
            v is None
            or (isinstance(v, list) and len(v) <= MAX_N and all(map(_is_first_logprobs, v)))
        ),
        "null or a list of first_token_logprobs",
    ),
    "cached_tokens": (is_int, "a non-negative integer"),
    "prompt_logprobs": (
        _is_prompt_logprobs,
        "null or [[logprob, rank, [[id, logprob], ...]], ...]",
    ),
    "output_token_ids": (
        lambda v: v is None or is_token_ids(v),
        f"null or a list of token ids (0..{MAX_TOKEN_ID})",
    ),
    "do_remote_prefill": (lambda v: isinstance(v, bool), "a boolean"),
    "pd_version": (lambda v: v == PD_VERSION, f"{PD_VERSION}"),
}
