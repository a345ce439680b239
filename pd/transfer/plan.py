"""Read planning: which remote bytes land where, as NIXL-style (addr, len, dev) descriptor arrays.

Pure computation over pool descriptors and slot ids (numpy only), shared by every backend.

Same split on both sides (same TP, or pools without split): one descriptor per slot, and runs of
slots adjacent on both sides coalesce into one descriptor. Different TP: each local rank reads,
from each remote rank holding some of its heads, exactly that head slice of every outer index
(every layer and K/V) of every slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pd.transfer.errors import PoolError
from pd.transfer.pools import PoolDesc


@dataclass(frozen=True)
class Segment:
    """Local rank `local_rank` reads `nbytes` per outer row from remote rank `remote_rank`."""

    local_rank: int
    remote_rank: int
    local_off: int  # byte offset inside one local outer row
    remote_off: int  # byte offset inside one remote outer row
    nbytes: int  # bytes per outer row (the whole slot when `whole`)
    whole: bool  # the segment is the whole slot on both sides


@dataclass
class ReadBatch:
    """Descriptors of one (local memory kind, remote memory kind) pair; rows are (addr, len, dev)."""

    local_kind: str
    remote_kind: str
    local: np.ndarray  # (N, 3) uint64
    remote: np.ndarray  # (N, 3) uint64

    @property
    def nbytes(self) -> int:
        return int(self.local[:, 1].sum())


def rank_segments(local: PoolDesc, remote: PoolDesc) -> list[Segment]:
    """How each local rank's slot is assembled from the remote ranks' slots."""
    if (local.split is None) != (remote.split is None):
        raise PoolError(f"pool {local.name!r}: split on one side only")
    if local.split is None or remote.split is None:
        if local.slot_bytes != remote.slot_bytes:
            raise PoolError(
                f"pool {local.name!r}: slot bytes {local.slot_bytes} != remote {remote.slot_bytes}"
            )
        if local.replicated and remote.replicated:
            pick = lambda d: d % remote.tp_size  # noqa: E731
        elif local.tp_size == remote.tp_size and not (local.replicated or remote.replicated):
            pick = lambda d: d  # noqa: E731
        else:
            raise PoolError(
                f"pool {local.name!r}: per-rank pool needs equal TP (local {local.tp_size}, "
                f"remote {remote.tp_size}) or replicated on both sides"
            )
        n = local.slot_bytes
        return [Segment(d, pick(d), 0, 0, n, True) for d in range(local.tp_size)]

    ls, rs = local.split, remote.split
    if (ls.outer, ls.inner_bytes, ls.total_heads) != (rs.outer, rs.inner_bytes, rs.total_heads):
        raise PoolError(f"pool {local.name!r}: split {ls} incompatible with remote {rs}")
    segments = []
    for d, lr in enumerate(local.ranks):
        h, end = lr.head_start, lr.head_start + ls.heads
        while h < end:
            holders = [
                p
                for p, rr in enumerate(remote.ranks)
                if rr.head_start <= h < rr.head_start + rs.heads
            ]
            if not holders:
                raise PoolError(f"pool {local.name!r}: no remote rank holds head {h}")
            p = holders[d % len(holders)]  # spread replicated heads over their holders
            r_start = remote.ranks[p].head_start
            stop = min(end, r_start + rs.heads)
            whole = h == lr.head_start == r_start and stop - h == ls.heads == rs.heads
            segments.append(
                Segment(
                    local_rank=d,
                    remote_rank=p,
                    local_off=(h - lr.head_start) * ls.inner_bytes,
                    remote_off=(h - r_start) * rs.inner_bytes,
                    nbytes=(ls.outer * ls.heads if whole else stop - h) * ls.inner_bytes,
                    whole=whole,
                )
            )
            h = stop
    return segments


def _runs(
    src: np.ndarray, dst: np.ndarray, max_run: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split (src, dst) into runs adjacent on both sides; returns (src starts, dst starts, lengths)."""
    brk = np.ones(len(src), dtype=bool)
    brk[1:] = (np.diff(src) != 1) | (np.diff(dst) != 1)
    starts = np.flatnonzero(brk)
    lengths = np.diff(np.append(starts, len(src)))
    if max_run and (lengths > max_run).any():  # cut long runs into pieces of at most max_run
        pieces = [
            (s + o, min(max_run, n - o))
            for s, n in zip(starts, lengths)
            for o in range(0, n, max_run)
        ]
        starts = np.array([p[0] for p in pieces], dtype=np.int64)
        lengths = np.array([p[1] for p in pieces], dtype=np.int64)
    return src[starts], dst[starts], lengths


def plan_reads(
    local: PoolDesc,
    remote: PoolDesc,
    src_slots: list[int],
    dst_slots: list[int],
    *,
    max_desc_bytes: int = 0,
) -> list[ReadBatch]:
    """Descriptors that read remote slots `src_slots` into local slots `dst_slots` (same order).

    `max_desc_bytes` caps a coalesced descriptor (0: no cap; never splits a single slot).
    """
    if len(src_slots) != len(dst_slots):
        raise PoolError(
            f"pool {local.name!r}: {len(src_slots)} source vs {len(dst_slots)} dest slots"
        )
    if not src_slots:
        return []
    src = np.asarray(src_slots, dtype=np.int64)
    dst = np.asarray(dst_slots, dtype=np.int64)
    if (
        src.min() < 0
        or src.max() >= remote.num_slots
        or dst.min() < 0
        or dst.max() >= local.num_slots
    ):
        raise PoolError(f"pool {local.name!r}: slot id out of range")
    by_kind: dict[tuple[str, str], list[tuple[np.ndarray, np.ndarray]]] = {}
    for seg in rank_segments(local, remote):
        lr, rr = local.ranks[seg.local_rank], remote.ranks[seg.remote_rank]
        if seg.whole:
            max_run = max_desc_bytes // local.slot_bytes if max_desc_bytes else 0
            s0, d0, n = _runs(src, dst, max_run)
            laddr = lr.base_addr + d0 * local.slot_bytes
            raddr = rr.base_addr + s0 * remote.slot_bytes
            lens = n * local.slot_bytes
        else:
            ls, rs = local.split, remote.split
            assert ls is not None and rs is not None
            outer = np.arange(ls.outer, dtype=np.int64)
            l_row, r_row = ls.heads * ls.inner_bytes, rs.heads * rs.inner_bytes
            laddr = (
                lr.base_addr
                + dst[:, None] * local.slot_bytes
                + outer[None, :] * l_row
                + seg.local_off
            ).ravel()
            raddr = (
                rr.base_addr
                + src[:, None] * remote.slot_bytes
                + outer[None, :] * r_row
                + seg.remote_off
            ).ravel()
            lens = np.full(laddr.shape, seg.nbytes, dtype=np.int64)
        ld = np.stack([laddr, lens, np.full_like(lens, lr.device_id)], axis=1).astype(np.uint64)
        rd = np.stack([raddr, lens, np.full_like(lens, rr.device_id)], axis=1).astype(np.uint64)
        by_kind.setdefault((lr.mem_kind, rr.mem_kind), []).append((ld, rd))
    return [
        ReadBatch(
            lk, rk, np.concatenate([a for a, _ in parts]), np.concatenate([b for _, b in parts])
        )
        for (lk, rk), parts in by_kind.items()
    ]
