"""Paged attention in plain torch (CPU, or any device/dtype FlashInfer lacks, e.g. fp32).

`plan` turns the batch's metadata into gather indices and masks once; every layer's `forward`
reuses them. Sequences that append one token (decode) run as one padded batched SDPA call;
sequences that append a chunk (prefill) run one SDPA call each. Both read K/V straight out of
the strided HND cache with one gather per call; SDPA accumulates bf16/fp16 in fp32 itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pd.kvcache.paged_metadata import PagedMetadata
from pd.worker.attention.base import AttentionBackend, check_plan_args


@dataclass(frozen=True)
class _DecodeGroup:
    """The seqs with one new token each, padded to the longest one."""

    token_idx: torch.Tensor | None  # [Bd] long: their rows of q; None when they are all of q
    page_table: torch.Tensor  # [Bd, max_pages] long; short rows repeat their last page
    mask: torch.Tensor  # [1, Bd, 1, max_pages * page_size] bool: key slot < kv_len


@dataclass(frozen=True)
class _PrefillSeq:
    """One seq appending a chunk of tokens."""

    start: int  # its rows of q are start:end
    end: int
    pages: torch.Tensor  # [num_pages] long
    kv_len: int  # num_cached + num_new
    mask: torch.Tensor | None  # [q_len, kv_len] bool (bottom-right causal); None: plain causal


@dataclass(frozen=True)
class _Plan:
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype
    num_tokens: int
    decode: _DecodeGroup | None
    prefills: list[_PrefillSeq]


class TorchAttentionBackend(AttentionBackend):
    def __init__(self) -> None:
        self._plan: _Plan | None = None

    def plan(
        self,
        meta: PagedMetadata,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        dtype: torch.dtype,
    ) -> None:
        check_plan_args(num_qo_heads, num_kv_heads, head_dim, page_size)
        if meta.page_size != page_size:
            raise ValueError(f"metadata page_size {meta.page_size} != plan page_size {page_size}")
        device = meta.kv_indices.device
        kv_indices = meta.kv_indices.long()  # [nnz]
        qo_indptr = meta.qo_indptr_host.tolist()
        kv_indptr = meta.kv_indptr_host.tolist()

        decode_seqs = [b for b in range(meta.batch_size) if meta.qo_lens[b] == 1]
        decode = None
        if decode_seqs:
            decode = self._plan_decode(meta, decode_seqs, qo_indptr, kv_indptr, kv_indices)

        prefills = []
        for b in range(meta.batch_size):
            q_len, kv_len = meta.qo_lens[b], meta.kv_lens[b]
            if q_len == 1:
                continue
            num_cached = kv_len - q_len
            mask = None
            if num_cached > 0:
                query_pos = torch.arange(num_cached, kv_len, device=device)  # [q_len]
                key_pos = torch.arange(kv_len, device=device)  # [kv_len]
                mask = key_pos[None, :] <= query_pos[:, None]  # [q_len, kv_len]
            pages = kv_indices[kv_indptr[b] : kv_indptr[b + 1]]  # [num_pages]
            prefills.append(_PrefillSeq(qo_indptr[b], qo_indptr[b + 1], pages, kv_len, mask))

        self._plan = _Plan(
            num_qo_heads, num_kv_heads, head_dim, page_size, dtype,
            meta.num_tokens, decode, prefills,
        )

    @staticmethod
    def _plan_decode(
        meta: PagedMetadata,
        seqs: list[int],
        qo_indptr: list[int],
        kv_indptr: list[int],
        kv_indices: torch.Tensor,
    ) -> _DecodeGroup:
        device = kv_indices.device
        page_size = meta.page_size
        starts = [kv_indptr[b] for b in seqs]
        counts = [kv_indptr[b + 1] - kv_indptr[b] for b in seqs]
        max_pages = max(counts)
        starts_t = torch.tensor(starts, device=device)  # [Bd]
        counts_t = torch.tensor(counts, device=device)  # [Bd]
        cols = torch.arange(max_pages, device=device)  # [max_pages]
        flat = starts_t[:, None] + torch.minimum(cols[None, :], counts_t[:, None] - 1)
        page_table = kv_indices[flat]  # [Bd, max_pages]
        kv_lens = torch.tensor([meta.kv_lens[b] for b in seqs], device=device)  # [Bd]
        slots = torch.arange(max_pages * page_size, device=device)  # [Lmax]
        mask = (slots[None, :] < kv_lens[:, None])[None, :, None, :]  # [1, Bd, 1, Lmax]
        token_idx = None
        if len(seqs) != meta.batch_size:
            token_idx = torch.tensor([qo_indptr[b] for b in seqs], device=device)  # [Bd]
        return _DecodeGroup(token_idx, page_table, mask)

    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, sm_scale: float) -> torch.Tensor:
        plan = self._plan
        assert plan is not None, "plan() must run before forward()"
        hq, hkv, d = plan.num_qo_heads, plan.num_kv_heads, plan.head_dim
        assert q.shape == (plan.num_tokens, hq, d), (
            f"q shape {tuple(q.shape)} != planned {(plan.num_tokens, hq, d)}"
        )
        assert kv_cache.shape[1:] == (2, hkv, plan.page_size, d), (
            f"kv_cache shape {tuple(kv_cache.shape)} does not match the plan"
        )
        assert q.dtype == kv_cache.dtype, f"q dtype {q.dtype} != kv_cache dtype {kv_cache.dtype}"
        kv_by_head = kv_cache.permute(1, 2, 0, 3, 4)  # [2, Hkv, N, P, D] (a view)

        dec = plan.decode
        if dec is not None and dec.token_idx is None and not plan.prefills:
            return self._decode(q, kv_by_head, dec, hkv, sm_scale)  # [T, Hq, D]
        out = torch.empty_like(q)  # [T, Hq, D]
        if dec is not None:
            q_dec = q[dec.token_idx]  # [Bd, Hq, D]
            out[dec.token_idx] = self._decode(q_dec, kv_by_head, dec, hkv, sm_scale)
        for seq in plan.prefills:
            n_pages = seq.pages.shape[0]
            kv = kv_by_head[:, :, seq.pages].reshape(2, hkv, n_pages * plan.page_size, d)
            kv = kv[:, :, : seq.kv_len]  # [2, Hkv, L, D]
            q_seq = q[seq.start : seq.end].transpose(0, 1)[None]  # [1, Hq, q_len, D]
            o = F.scaled_dot_product_attention(
                q_seq,
                kv[0][None],  # [1, Hkv, L, D]
                kv[1][None],  # [1, Hkv, L, D]
                attn_mask=seq.mask,
                is_causal=seq.mask is None,
                scale=sm_scale,
                enable_gqa=hq != hkv,
            )  # [1, Hq, q_len, D]
            out[seq.start : seq.end] = o[0].transpose(0, 1)
        return out

    @staticmethod
    def _decode(
        q: torch.Tensor,  # [Bd, Hq, D]
        kv_by_head: torch.Tensor,  # [2, Hkv, N, P, D]
        dec: _DecodeGroup,
        hkv: int,
        sm_scale: float,
    ) -> torch.Tensor:
        bd, hq, d = q.shape
        group = hq // hkv
        _, max_pages = dec.page_table.shape
        page_size = kv_by_head.shape[3]
        # One gather straight into [2, Hkv, Bd, max_pages, P, D]; merging (max_pages, P) is free.
        kv = kv_by_head[:, :, dec.page_table].reshape(2, hkv, bd, max_pages * page_size, d)
        # The G query heads sharing a KV head become G query rows: no K/V repeat for GQA.
        q_g = q.view(bd, hkv, group, d).permute(1, 0, 2, 3)  # [Hkv, Bd, G, D]
        o = F.scaled_dot_product_attention(
            q_g, kv[0], kv[1], attn_mask=dec.mask, scale=sm_scale
        )  # [Hkv, Bd, G, D]
        return o.permute(1, 0, 2, 3).reshape(bd, hq, d)
