"""Paged attention in plain torch (CPU, or any device/dtype FlashInfer lacks, e.g. fp32).

`plan` turns the batch's metadata into one page gather index and the masks; every layer's
`forward` reuses them. Per layer, one `index_select` copies the batch's pages out of the strided
HND cache into a scratch buffer laid out [2, Hkv, pages, page_size, D], so each sequence's K/V
is a dense view. Sequences that append one token (decode) then run as one padded batch through
SDPA (`_decode_math`), one path for any number of sequences: each sequence's row comes out the
same bits alone or among others, padded or not (tested); sequences that append a chunk (prefill) run one SDPA call each
(`uniform`, `--deterministic`: each row of a chunk as a decode row instead). SDPA accumulates
bf16/fp16 in fp32 itself.

NOTE: the scratch buffer is kept and reused across layers and steps (it only grows): a fresh
multi-MB tensor per layer costs more in page faults than the gather itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pd.kvcache.paged_metadata import PagedMetadata
from pd.worker.model.attention.base import AttentionBackend, check_plan_args

DecodeInputs = tuple[torch.Tensor, torch.Tensor]  # a pure decode step's (page table, mask)


def paged_decode_attention(
    q: torch.Tensor,  # [B, Hq, D], one new token per seq
    kv_cache: torch.Tensor,  # [N, 2, Hkv, P, D] one layer's strided view
    inputs: DecodeInputs,  # ([B * max_pages] long page ids, [1, B, 1, max_pages * P] mask)
    sm_scale: float,
) -> torch.Tensor:  # [B, Hq, D]
    """Decode attention from tensors alone (shapes give the sizes): what a compiled decode
    step runs, where `TorchAttentionBackend.forward` reads its Python plan."""
    page_table, mask = inputs
    kv = torch.index_select(kv_cache.permute(1, 2, 0, 3, 4), 2, page_table)  # [2, Hkv, G, P, D]
    return _decode_math(q, kv, mask.shape[-1] // kv_cache.shape[3], mask, sm_scale)


@dataclass(frozen=True)
class _DecodeGroup:
    """The seqs with one new token each, padded to the longest one."""

    token_idx: torch.Tensor | None  # [Bd] long: their rows of q; None when they are all of q
    num_seqs: int  # Bd
    max_pages: int  # pages of the longest; shorter rows repeat their last page (masked off)
    mask: torch.Tensor  # [1, Bd, 1, max_pages * page_size] additive: 0 where slot < kv_len


@dataclass(frozen=True)
class _PrefillSeq:
    """One seq appending a chunk of tokens."""

    start: int  # its rows of q are start:end
    end: int
    first_page: int  # its pages are gathered pages first_page:first_page + num_pages
    num_pages: int
    kv_len: int  # num_cached + num_new
    mask: torch.Tensor | None  # [q_len, kv_len] additive, bottom-right causal; None: is_causal
    # `uniform`: its rows in blocks (`_row_blocks`), each block's mask made once a step
    blocks: tuple[_RowBlock, ...] = ()


@dataclass(frozen=True)
class _RowBlock:
    """Rows lo:hi of a chunk run as decode rows over the first `num_keys` keys."""

    lo: int
    hi: int
    num_keys: int  # the pages up to the block's last row's position
    mask: torch.Tensor  # [1, hi - lo, 1, num_keys] additive: 0 where key <= the row's position


@dataclass(frozen=True)
class _Plan:
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype
    num_tokens: int
    gather_idx: torch.Tensor  # [G] long: page ids to copy out per layer, decode group first
    decode: _DecodeGroup | None  # its pages are gathered pages 0:Bd * max_pages
    prefills: list[_PrefillSeq]


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as SDPA's additive float mask (0 / -inf), built once per batch rather than
    converted by SDPA in every layer."""
    zeros = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return zeros.masked_fill_(~allowed, float("-inf"))


class TorchAttentionBackend(AttentionBackend):
    """`uniform` (`--deterministic`): every row of a chunk runs as a decode row does (its own
    SDPA batch entry over its sequence's keys, masked past its position), so a token's attention
    comes out the same bits in a prefill chunk of any size, at any offset, or as a decode step,
    alone or among others: what makes an answer independent of chunking, of prefix-cache hits
    and of migration."""

    def __init__(self, uniform: bool = False) -> None:
        self.uniform = uniform
        self._plan: _Plan | None = None
        self._scratch: torch.Tensor | None = None  # flat; reused by every layer's gather
        self._graph_inputs: dict[int, DecodeInputs] = {}  # by batch size, for `plan_graph`

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

        gather: list[torch.Tensor] = []
        num_gathered = 0
        decode = None
        decode_seqs = [b for b in range(meta.batch_size) if meta.qo_lens[b] == 1]
        if decode_seqs:
            decode, page_table = self._plan_decode(
                meta, decode_seqs, qo_indptr, kv_indptr, kv_indices, dtype
            )
            gather.append(page_table.reshape(-1))
            num_gathered = decode.num_seqs * decode.max_pages

        prefills = []
        for b in range(meta.batch_size):
            q_len, kv_len = meta.qo_lens[b], meta.kv_lens[b]
            if q_len == 1:
                continue
            num_cached = kv_len - q_len
            mask: torch.Tensor | None = None
            blocks: tuple[_RowBlock, ...] = ()
            if self.uniform:
                blocks = _row_blocks(num_cached, q_len, meta.page_size, dtype, device)
            elif num_cached > 0:
                query_pos = torch.arange(num_cached, kv_len, device=device)  # [q_len]
                key_pos = torch.arange(kv_len, device=device)  # [kv_len]
                mask = _additive(key_pos[None, :] <= query_pos[:, None], dtype)  # [q_len, L]
            num_pages = kv_indptr[b + 1] - kv_indptr[b]
            gather.append(kv_indices[kv_indptr[b] : kv_indptr[b + 1]])
            prefills.append(
                _PrefillSeq(
                    qo_indptr[b], qo_indptr[b + 1], num_gathered, num_pages, kv_len, mask, blocks
                )
            )
            num_gathered += num_pages

        self._plan = _Plan(
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            page_size=page_size,
            dtype=dtype,
            num_tokens=meta.num_tokens,
            gather_idx=torch.cat(gather) if gather else kv_indices,
            decode=decode,
            prefills=prefills,
        )

    @staticmethod
    def _plan_decode(
        meta: PagedMetadata,
        seqs: list[int],
        qo_indptr: list[int],
        kv_indptr: list[int],
        kv_indices: torch.Tensor,
        dtype: torch.dtype,
    ) -> tuple[_DecodeGroup, torch.Tensor]:
        """The decode group and its padded page table [Bd, max_pages]."""
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
        mask = _additive(slots[None, :] < kv_lens[:, None], dtype)[None, :, None, :]
        # mask: [1, Bd, 1, Lmax]
        token_idx = None
        if len(seqs) != meta.batch_size:
            token_idx = torch.tensor([qo_indptr[b] for b in seqs], device=device)  # [Bd]
        return _DecodeGroup(token_idx, len(seqs), max_pages, mask), page_table

    def _gather(self, kv_cache: torch.Tensor, plan: _Plan) -> torch.Tensor:
        """Copy the planned pages of one layer into [2, Hkv, G, page_size, D] scratch."""
        _, _, hkv, page_size, d = kv_cache.shape
        shape = (2, hkv, plan.gather_idx.shape[0], page_size, d)
        numel = math.prod(shape)
        scratch = self._scratch
        if (
            scratch is None
            or scratch.numel() < numel
            or scratch.dtype != kv_cache.dtype
            or scratch.device != kv_cache.device
        ):
            scratch = self._scratch = torch.empty(
                numel, dtype=kv_cache.dtype, device=kv_cache.device
            )
        out = scratch[:numel].view(shape)  # [2, Hkv, G, P, D]
        kv_by_head = kv_cache.permute(1, 2, 0, 3, 4)  # [2, Hkv, N, P, D] (a view)
        return torch.index_select(kv_by_head, 2, plan.gather_idx, out=out)

    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, sm_scale: float) -> torch.Tensor:
        plan = self._plan
        assert plan is not None, "plan() must run before forward()"
        hq, hkv, d, page_size = plan.num_qo_heads, plan.num_kv_heads, plan.head_dim, plan.page_size
        assert q.shape == (plan.num_tokens, hq, d), (
            f"q shape {tuple(q.shape)} != planned {(plan.num_tokens, hq, d)}"
        )
        assert kv_cache.shape[1:] == (2, hkv, page_size, d), (
            f"kv_cache shape {tuple(kv_cache.shape)} does not match the plan"
        )
        assert q.dtype == kv_cache.dtype, f"q dtype {q.dtype} != kv_cache dtype {kv_cache.dtype}"
        kv = self._gather(kv_cache, plan)  # [2, Hkv, G, P, D]

        dec = plan.decode
        if dec is not None and dec.token_idx is None and not plan.prefills:
            return self._decode(q, kv, dec, sm_scale)  # [T, Hq, D]
        if dec is None and len(plan.prefills) == 1:
            return self._prefill(q, kv, plan.prefills[0], plan, sm_scale)  # [T, Hq, D]
        out = torch.empty_like(q)  # [T, Hq, D]
        if dec is not None:
            # NOTE: index_select/index_copy_, not q[idx]/out[idx] = ...: advanced indexing
            # runs a parallel region even for a few rows, which stalls on a busy CPU.
            assert dec.token_idx is not None  # None only when the decodes are all of q
            q_dec = q.index_select(0, dec.token_idx)  # [Bd, Hq, D]
            out.index_copy_(0, dec.token_idx, self._decode(q_dec, kv, dec, sm_scale))
        for seq in plan.prefills:
            out[seq.start : seq.end] = self._prefill(q, kv, seq, plan, sm_scale)
        return out

    def _prefill(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        kv: torch.Tensor,  # [2, Hkv, G, P, D] gathered pages
        seq: _PrefillSeq,
        plan: _Plan,
        sm_scale: float,
    ) -> torch.Tensor:  # [q_len, Hq, D]
        if self.uniform:
            return _rows_as_decodes(q, kv, seq, plan, sm_scale)
        return _prefill_chunk(q, kv, seq, plan, sm_scale)

    @staticmethod
    def _decode(
        q: torch.Tensor,  # [Bd, Hq, D]
        kv: torch.Tensor,  # [2, Hkv, G, P, D] gathered pages, the decode group's first
        dec: _DecodeGroup,
        sm_scale: float,
    ) -> torch.Tensor:
        return _decode_math(q, kv, dec.max_pages, dec.mask, sm_scale)

    def decode_inputs(self, min_pages: int = 1) -> DecodeInputs:
        """The planned pure decode step's page table and mask, for `paged_decode_attention`,
        padded to at least `min_pages` pages per sequence (masked off)."""
        plan = self._plan
        assert plan is not None and plan.decode is not None and not plan.prefills
        dec = plan.decode
        assert dec.token_idx is None
        pages, mask = plan.gather_idx, dec.mask
        if dec.max_pages < min_pages:
            extra = min_pages - dec.max_pages
            table = pages.view(dec.num_seqs, dec.max_pages)
            pages = torch.cat([table, table[:, -1:].expand(-1, extra)], dim=1).reshape(-1)
            off = mask.new_full((*mask.shape[:3], extra * plan.page_size), float("-inf"))
            mask = torch.cat([mask, off], dim=3)
        return pages, mask

    def plan_graph(self, max_pages: int, sm_scale: float) -> DecodeInputs:
        """The planned step's page table and mask, every row padded to `max_pages` pages,
        copied into this batch size's buffers (the graph reads those; `sm_scale` is passed to
        `paged_decode_attention` by the model). What the CPU tests run without a capture; a
        worker refuses CUDA graphs on this backend (every row padded to the whole context would
        gather far more than eager)."""
        plan = self._plan
        assert plan is not None and plan.decode is not None
        batch = plan.decode.num_seqs
        pages, mask = self.decode_inputs(min_pages=max_pages)
        if pages.numel() != batch * max_pages:
            raise ValueError(f"a sequence of this step holds more than {max_pages} pages")
        buffers = self._graph_inputs.get(batch)
        if buffers is None or buffers[1].dtype != mask.dtype:
            buffers = self._graph_inputs[batch] = (pages.clone(), mask.clone())
        else:
            buffers[0].copy_(pages)
            buffers[1].copy_(mask)
        return buffers


def _prefill_chunk(
    q: torch.Tensor,  # [T, Hq, D]
    kv: torch.Tensor,  # [2, Hkv, G, P, D] gathered pages
    seq: _PrefillSeq,
    plan: _Plan,
    sm_scale: float,
) -> torch.Tensor:  # [q_len, Hq, D]
    """A chunk's rows in one causal SDPA call (its kernel blocks the rows: a row's bits depend
    on the chunk it comes in)."""
    hkv, d, page_size = plan.num_kv_heads, plan.head_dim, plan.page_size
    pages = kv[:, :, seq.first_page : seq.first_page + seq.num_pages]  # [2, Hkv, n, P, D]
    kv_seq = pages.reshape(2, hkv, seq.num_pages * page_size, d)[:, :, : seq.kv_len]
    q_seq = q[seq.start : seq.end].transpose(0, 1)[None]  # [1, Hq, q_len, D]
    o = F.scaled_dot_product_attention(
        q_seq,
        kv_seq[0][None],  # [1, Hkv, L, D]
        kv_seq[1][None],  # [1, Hkv, L, D]
        attn_mask=seq.mask,
        is_causal=seq.mask is None,
        scale=sm_scale,
        enable_gqa=plan.num_qo_heads != hkv,
    )  # [1, Hq, q_len, D], laid out like q_seq: the transpose back is dense
    return o[0].transpose(0, 1).contiguous()  # [q_len, Hq, D]


# Rows of a chunk per SDPA call in `_rows_as_decodes`: each call reads the keys up to its last
# row's position, so smaller blocks skip more of the masked keys (a causal chunk's saving).
UNIFORM_ROWS = 64


def _row_blocks(
    first: int, rows: int, page_size: int, dtype: torch.dtype, device: torch.device
) -> tuple[_RowBlock, ...]:
    """A chunk of `rows` rows from position `first`, in blocks of UNIFORM_ROWS: each reads the
    pages up to its last row's position, padded as a decode step pads a sequence to its batch's
    longest (masked keys add exact zeros). Planned once a step; every layer reuses them."""
    blocks = []
    for lo in range(0, rows, UNIFORM_ROWS):
        hi = min(lo + UNIFORM_ROWS, rows)
        num_keys = -(-(first + hi) // page_size) * page_size
        slots = torch.arange(num_keys, device=device)  # [L]
        pos = torch.arange(first + lo, first + hi, device=device)  # [R]
        mask = _additive(slots[None, :] <= pos[:, None], dtype)[None, :, None, :]
        blocks.append(_RowBlock(lo, hi, num_keys, mask))
    return tuple(blocks)


def _rows_as_decodes(
    q: torch.Tensor,  # [T, Hq, D]
    kv: torch.Tensor,  # [2, Hkv, G, P, D] gathered pages
    seq: _PrefillSeq,
    plan: _Plan,
    sm_scale: float,
) -> torch.Tensor:  # [q_len, Hq, D]
    """A chunk's rows as decode rows: `_decode_math` with each row a sequence of its own, all of
    them reading the chunk's sequence's pages (a stride-0 view, no copy), each masked past its
    own position, block by block (`_row_blocks`)."""
    hkv, d, page_size = plan.num_kv_heads, plan.head_dim, plan.page_size
    pages = kv[:, :, seq.first_page : seq.first_page + seq.num_pages]  # [2, Hkv, n, P, D]
    kv_seq = pages.reshape(2, hkv, 1, seq.num_pages * page_size, d)
    out = torch.empty_like(q[seq.start : seq.end])  # [q_len, Hq, D]
    for b in seq.blocks:
        rows = kv_seq[:, :, :, : b.num_keys].expand(2, hkv, b.hi - b.lo, b.num_keys, d)  # a view
        q_rows = q[seq.start + b.lo : seq.start + b.hi]
        out[b.lo : b.hi] = _decode_rows(q_rows, rows, b.mask, sm_scale)
    return out


def _decode_math(
    q: torch.Tensor,  # [Bd, Hq, D]
    kv: torch.Tensor,  # [2, Hkv, G, P, D] gathered pages, the decode group's first
    max_pages: int,  # rows 0:Bd*max_pages of the gathered pages are the padded page table
    mask: torch.Tensor,  # [1, Bd, 1, max_pages * P] additive
    sm_scale: float,
) -> torch.Tensor:
    bd, _, d = q.shape
    _, hkv, _, page_size, _ = kv.shape
    # Merging (max_pages, P) is a view.
    kv_dec = kv[:, :, : bd * max_pages].reshape(2, hkv, bd, max_pages * page_size, d)
    return _decode_rows(q, kv_dec, mask, sm_scale)


def _decode_rows(
    q: torch.Tensor,  # [Bd, Hq, D]
    kv_dec: torch.Tensor,  # [2, Hkv, Bd, L, D] each row's keys and values
    mask: torch.Tensor,  # [1, Bd, 1, L] additive
    sm_scale: float,
) -> torch.Tensor:  # [Bd, Hq, D]
    bd, hq, d = q.shape
    hkv = kv_dec.shape[1]
    group = hq // hkv
    # The G query heads sharing a KV head become G query rows: no K/V repeat for GQA.
    q_g = q.reshape(bd, hkv, group, d).permute(1, 0, 2, 3)  # [Hkv, Bd, G, D]
    # One path for every batch: a matmul-softmax-matmul path for fp32 from 8 sequences on
    # (faster there under the AVX2 cap: docs/EXPERIMENTS.md §13) rounded otherwise than SDPA,
    # so a stream's tokens changed when an eighth joined it.
    o = F.scaled_dot_product_attention(
        q_g, kv_dec[0], kv_dec[1], attn_mask=mask, scale=sm_scale
    )  # [Hkv, Bd, G, D]
    return o.permute(1, 0, 2, 3).reshape(bd, hq, d)
