"""Per-batch paged-attention metadata in FlashInfer's format, built once per engine step.

Each sequence of the batch is `(page_ids, num_cached, num_new)`: it already holds `num_cached`
tokens in its pages, and this step appends `num_new` tokens (1 for decode, a chunk for prefill)
whose K/V the model writes first. Attention then runs over all `num_cached + num_new` tokens,
the new query i of a sequence sitting at position `num_cached + i`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

SeqSpec = tuple[Sequence[int], int, int]  # (page_ids, num_cached, num_new)


@dataclass(frozen=True)
class PagedMetadata:
    # [B+1] int32: new tokens of seq b are q rows qo_indptr[b]:qo_indptr[b+1].
    qo_indptr: torch.Tensor
    # [B+1] int32: pages of seq b are kv_indices[kv_indptr[b]:kv_indptr[b+1]].
    kv_indptr: torch.Tensor
    # [nnz_pages] int32: page ids, only the pages that hold the num_cached + num_new tokens.
    kv_indices: torch.Tensor
    # [B] int32: tokens in each seq's last used page, in 1..page_size.
    kv_last_page_len: torch.Tensor
    # [T] long: absolute position of each new token (num_cached + i), for RoPE.
    positions: torch.Tensor
    # [T] long: page that receives each new token's K/V.
    write_page_ids: torch.Tensor
    # [T] long: slot within that page (position % page_size).
    write_offsets: torch.Tensor
    # CPU copies of qo_indptr, kv_indptr, kv_last_page_len (FlashInfer plans from host
    # indptrs); the very same tensors when device is CPU.
    qo_indptr_host: torch.Tensor
    kv_indptr_host: torch.Tensor
    kv_last_page_len_host: torch.Tensor
    # New tokens per seq (num_new), as Python ints.
    qo_lens: list[int]
    # Tokens attended per seq (num_cached + num_new), as Python ints.
    kv_lens: list[int]
    # T = sum(qo_lens): rows of q this step.
    num_tokens: int
    # B: sequences in the batch.
    batch_size: int
    # Tokens per page.
    page_size: int
    # Every seq appends exactly one token (a pure decode step).
    is_decode_only: bool

    @property
    def max_kv_len(self) -> int:
        return max(self.kv_lens, default=0)

    @property
    def device(self) -> torch.device:
        return self.kv_indices.device

    def to(self, device: torch.device | str) -> PagedMetadata:
        """The same metadata on another device (another TP rank's); host copies are shared."""
        device = torch.device(device)
        if self.device == device:
            return self

        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=True)

        return replace(
            self,
            qo_indptr=move(self.qo_indptr),
            kv_indptr=move(self.kv_indptr),
            kv_indices=move(self.kv_indices),
            kv_last_page_len=move(self.kv_last_page_len),
            positions=move(self.positions),
            write_page_ids=move(self.write_page_ids),
            write_offsets=move(self.write_offsets),
        )


def build_paged_metadata(
    seqs: Sequence[SeqSpec], page_size: int, device: torch.device | str = "cpu"
) -> PagedMetadata:
    """Build the metadata of one batch from plain lists; two tensors, then views.

    Every seq needs num_new >= 1 and enough pages for num_cached + num_new tokens
    (extra pages, reserved for growth, are allowed and left out of kv_indices).
    """
    if page_size <= 0:
        raise ValueError(f"page_size must be > 0, got {page_size}")
    device = torch.device(device)
    qo_indptr = [0]
    kv_indptr = [0]
    kv_indices: list[int] = []
    last_page_len: list[int] = []
    positions: list[int] = []
    write_pages: list[int] = []
    write_offsets: list[int] = []
    qo_lens: list[int] = []
    kv_lens: list[int] = []
    for b, (page_ids, num_cached, num_new) in enumerate(seqs):
        if num_new < 1 or num_cached < 0:
            raise ValueError(
                f"seq {b}: need num_new >= 1 and num_cached >= 0, got "
                f"num_cached={num_cached}, num_new={num_new}"
            )
        kv_len = num_cached + num_new
        num_pages = (kv_len + page_size - 1) // page_size
        if len(page_ids) < num_pages:
            raise ValueError(
                f"seq {b}: {kv_len} tokens need {num_pages} pages of "
                f"{page_size}, got {len(page_ids)}"
            )
        kv_indices.extend(page_ids[:num_pages])
        kv_indptr.append(len(kv_indices))
        last_page_len.append(kv_len - (num_pages - 1) * page_size)
        qo_indptr.append(qo_indptr[-1] + num_new)
        qo_lens.append(num_new)
        kv_lens.append(kv_len)
        new_positions = range(num_cached, kv_len)
        positions.extend(new_positions)
        write_pages.extend([page_ids[p // page_size] for p in new_positions])
        write_offsets.extend([p % page_size for p in new_positions])

    B = len(qo_lens)
    T = qo_indptr[-1]
    nnz = len(kv_indices)
    # One int32 and one int64 tensor (one host-to-device copy each); fields are slices.
    pin = device.type == "cuda"  # pinned host memory makes the copies truly asynchronous
    ints = torch.tensor(
        qo_indptr + kv_indptr + kv_indices + last_page_len, dtype=torch.int32, pin_memory=pin
    )
    longs = torch.tensor(positions + write_pages + write_offsets, dtype=torch.int64, pin_memory=pin)
    ints_host = ints
    if device.type != "cpu":
        ints = ints.to(device, non_blocking=True)
        longs = longs.to(device, non_blocking=True)

    i0, i1, i2, i3 = B + 1, 2 * (B + 1), 2 * (B + 1) + nnz, 2 * (B + 1) + nnz + B
    return PagedMetadata(
        qo_indptr=ints[:i0],
        kv_indptr=ints[i0:i1],
        kv_indices=ints[i1:i2],
        kv_last_page_len=ints[i2:i3],
        positions=longs[:T],
        write_page_ids=longs[T : 2 * T],
        write_offsets=longs[2 * T :],
        qo_indptr_host=ints_host[:i0],
        kv_indptr_host=ints_host[i0:i1],
        kv_last_page_len_host=ints_host[i2:i3],
        qo_lens=qo_lens,
        kv_lens=kv_lens,
        num_tokens=T,
        batch_size=B,
        page_size=page_size,
        is_decode_only=B > 0 and all(n == 1 for n in qo_lens),
    )
