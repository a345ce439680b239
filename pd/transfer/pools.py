"""Pools of fixed-size slots: the only thing the transfer layer knows about memory.

A pool is one region per TP rank, split into `num_slots` slots of `slot_bytes` each; slot `i` of
rank `r` starts at `ranks[r].base_addr + i * slot_bytes`. KV pages are one pool; recurrent state
or a sliding-window pool is another one, with its own slot size, moved by the same code.

How a slot splits across TP ranks is described by `TpSplit`: the slot is `[outer, heads,
inner_bytes]` in row-major order (for a page-major KV buffer `[pages, layers, 2, heads, page_size,
head_dim]`: outer = layers * 2, heads = the rank's KV heads, inner = page_size * head_dim * itemsize),
and rank `r` holds the global heads `[head_start, head_start + heads)`. A pool without a split is
either `replicated` (every rank holds the same bytes) or per-rank-whole (rank i of one side maps to
rank i of the other; both sides then need the same TP size).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class TpSplit:
    outer: int  # product of the dimensions before the head dimension
    heads: int  # heads held by one rank
    inner_bytes: int  # bytes of one head inside one outer index
    total_heads: int  # heads of the whole model (all ranks together)

    def __post_init__(self) -> None:
        if min(self.outer, self.heads, self.inner_bytes, self.total_heads) <= 0:
            raise ValueError(f"TpSplit fields must be positive: {self}")
        if self.heads > self.total_heads:
            raise ValueError(f"a rank cannot hold {self.heads} of {self.total_heads} heads")

    @property
    def slot_bytes(self) -> int:
        return self.outer * self.heads * self.inner_bytes


@dataclass(frozen=True)
class RankRegion:
    base_addr: int  # address of slot 0 on this rank
    device: str = "cpu"  # "cpu" (DRAM) or "cuda:<i>" (VRAM)
    head_start: int = 0  # first global head held by this rank (pools with a TpSplit only)

    @property
    def mem_kind(self) -> str:
        return "DRAM" if self.device == "cpu" else "VRAM"

    @property
    def device_id(self) -> int:
        return 0 if self.device == "cpu" else int(self.device.split(":", 1)[1] or 0)

    def __post_init__(self) -> None:
        if self.device != "cpu" and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'cpu' or 'cuda:<i>', got {self.device!r}")


@dataclass(frozen=True)
class PoolDesc:
    name: str
    num_slots: int
    slot_bytes: int
    ranks: tuple[RankRegion, ...]  # one per TP rank, in rank order
    split: TpSplit | None = None
    replicated: bool = False  # only without a split: every rank holds identical bytes
    meta: dict[str, Any] = field(default_factory=dict, compare=False)  # free-form, e.g. dtype

    def __post_init__(self) -> None:
        if not self.name or self.num_slots <= 0 or self.slot_bytes <= 0 or not self.ranks:
            raise ValueError(f"invalid pool {self.name!r}: needs a name, slots, bytes and ranks")
        if self.split is not None:
            if self.replicated:
                raise ValueError(f"pool {self.name!r}: a split pool cannot be replicated")
            if self.split.slot_bytes != self.slot_bytes:
                raise ValueError(
                    f"pool {self.name!r}: split gives {self.split.slot_bytes} bytes per slot, "
                    f"slot_bytes is {self.slot_bytes}"
                )
            for r in self.ranks:
                if r.head_start < 0 or r.head_start + self.split.heads > self.split.total_heads:
                    raise ValueError(f"pool {self.name!r}: rank heads out of range: {r}")

    @property
    def tp_size(self) -> int:
        return len(self.ranks)

    @property
    def region_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "num_slots": self.num_slots,
            "slot_bytes": self.slot_bytes,
            "ranks": [[r.base_addr, r.device, r.head_start] for r in self.ranks],
            "split": None
            if self.split is None
            else [
                self.split.outer,
                self.split.heads,
                self.split.inner_bytes,
                self.split.total_heads,
            ],
            "replicated": self.replicated,
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PoolDesc:
        split = d.get("split")
        return cls(
            name=str(d["name"]),
            num_slots=int(d["num_slots"]),
            slot_bytes=int(d["slot_bytes"]),
            ranks=tuple(RankRegion(int(a), str(dev), int(h)) for a, dev, h in d["ranks"]),
            split=None if split is None else TpSplit(*(int(x) for x in split)),
            replicated=bool(d.get("replicated", False)),
            meta=dict(d.get("meta") or {}),
        )


class _TensorLike(Protocol):
    shape: Any
    device: Any

    def data_ptr(self) -> int: ...
    def element_size(self) -> int: ...
    def is_contiguous(self) -> bool: ...


def _device_str(t: _TensorLike) -> str:
    dev = t.device
    return "cpu" if dev.type == "cpu" else f"cuda:{dev.index or 0}"


def kv_pool_from_tensors(
    name: str, tensors: Sequence[_TensorLike], total_kv_heads: int
) -> PoolDesc:
    """A KV pool from one page-major tensor per TP rank:
    `[num_pages, num_layers, 2, kv_heads_of_rank, page_size, head_dim]` (HND inside a page).

    With more ranks than KV heads, heads are replicated: consecutive ranks share the same heads.
    """
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) != 1 or len(next(iter(shapes))) != 6:
        raise ValueError(f"pool {name!r}: need equal 6-d tensors per rank, got {shapes}")
    num_pages, layers, two, heads, page_size, head_dim = next(iter(shapes))
    if two != 2 or not all(t.is_contiguous() for t in tensors):
        raise ValueError(f"pool {name!r}: tensors must be contiguous with a K/V dimension of 2")
    itemsize = tensors[0].element_size()
    tp = len(tensors)
    if (heads * tp) % total_kv_heads:
        raise ValueError(f"pool {name!r}: {tp} ranks x {heads} heads vs {total_kv_heads} heads")
    group = heads * tp // total_kv_heads  # ranks holding the same heads
    split = TpSplit(layers * 2, heads, page_size * head_dim * itemsize, total_kv_heads)
    ranks = tuple(
        RankRegion(t.data_ptr(), _device_str(t), (r // group) * heads)
        for r, t in enumerate(tensors)
    )
    return PoolDesc(name, num_pages, split.slot_bytes, ranks, split=split)


def whole_pool_from_tensors(
    name: str, tensors: Sequence[_TensorLike], *, replicated: bool = False
) -> PoolDesc:
    """A pool without TP split from one contiguous `[num_slots, ...]` tensor per rank."""
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) != 1 or not all(t.is_contiguous() for t in tensors):
        raise ValueError(f"pool {name!r}: need equal contiguous tensors per rank, got {shapes}")
    shape = next(iter(shapes))
    slot_bytes = tensors[0].element_size()
    for d in shape[1:]:
        slot_bytes *= d
    ranks = tuple(RankRegion(t.data_ptr(), _device_str(t)) for t in tensors)
    return PoolDesc(name, shape[0], slot_bytes, ranks, replicated=replicated)
