"""Paged attention backends vs a naive dense causal attention over the full sequence."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from pd.kvcache import KVPool, build_paged_metadata
from pd.kvcache.paged_metadata import PagedMetadata
from pd.worker.model.attention import (
    AttentionBackend,
    FlashInferAttentionBackend,
    TorchAttentionBackend,
    select_attention_backend,
)

LAYER = 1  # a middle layer of a 3-layer pool: the per-layer view is strided


@dataclass
class Seq:
    k: torch.Tensor  # [L, Hkv, D] the whole sequence's keys
    v: torch.Tensor  # [L, Hkv, D]
    q: torch.Tensor  # [L, Hq, D] queries for every position (a step uses its new rows)
    pages: list[int]


def naive_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Dense causal attention of one whole sequence in fp64. q [L, Hq, D], k/v [L, Hkv, D]."""
    group = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double(), v.double()
    k = k.repeat_interleave(group, dim=1)  # [L, Hq, D]
    v = v.repeat_interleave(group, dim=1)  # [L, Hq, D]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [Hq, L, L]
    n = q.shape[0]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)  # [L, Hq, D]


class Harness:
    """A pool with random sequences on shuffled pages; runs steps and checks them."""

    def __init__(
        self,
        seq_lens: list[int],
        hq: int = 6,
        hkv: int = 2,
        head_dim: int = 16,
        page_size: int = 4,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.hq, self.hkv, self.head_dim, self.page_size = hq, hkv, head_dim, page_size
        self.dtype, self.device = dtype, device
        self.scale = 1.0 / math.sqrt(head_dim)
        need = [-(-n // page_size) + 1 for n in seq_lens]  # one spare page each
        num_pages = sum(need) + 3
        self.pool = KVPool(num_pages, 3, hkv, page_size, head_dim, dtype, device)
        # Garbage everywhere, so a read of a wrong page, slot or layer shows up.
        self.pool.buffer.copy_(torch.randn(self.pool.shape, generator=gen).to(dtype) * 10)
        perm = torch.randperm(num_pages, generator=gen).tolist()  # non-contiguous page ids
        self.seqs: list[Seq] = []
        for n, n_pages in zip(seq_lens, need):
            pages, perm = perm[:n_pages], perm[n_pages:]
            rand = lambda h, n=n: torch.randn(n, h, head_dim, generator=gen).to(dtype)  # noqa: E731
            self.seqs.append(Seq(rand(hkv), rand(hkv), rand(hq), pages))

    def step(
        self, backend: AttentionBackend, chunks: list[tuple[int, int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One step: chunks[i] = (num_cached, num_new) of seq i. Writes the new K/V, runs
        attention; returns (paged output, naive reference), both [T, Hq, D] in fp32."""
        meta = build_paged_metadata(
            [(s.pages, c, n) for s, (c, n) in zip(self.seqs, chunks)], self.page_size, self.device
        )
        new = [slice(c, c + n) for c, n in chunks]
        k = torch.cat([s.k[sl] for s, sl in zip(self.seqs, new)]).to(self.device)  # [T, Hkv, D]
        v = torch.cat([s.v[sl] for s, sl in zip(self.seqs, new)]).to(self.device)  # [T, Hkv, D]
        q = torch.cat([s.q[sl] for s, sl in zip(self.seqs, new)]).to(self.device)  # [T, Hq, D]
        self.pool.write(
            LAYER,
            torch.stack((k, v), dim=1),
            self.pool.rows_of(meta.write_page_ids, meta.write_offsets),
        )
        out = self.run(backend, meta, q)
        ref = torch.cat(
            [
                naive_attention(s.q[: c + n], s.k[: c + n], s.v[: c + n], self.scale)[c:]
                for s, (c, n) in zip(self.seqs, chunks)
            ]
        )  # [T, Hq, D]
        return out.float().cpu(), ref.float()

    def run(self, backend: AttentionBackend, meta: PagedMetadata, q: torch.Tensor) -> torch.Tensor:
        backend.plan(meta, self.hq, self.hkv, self.head_dim, self.page_size, self.dtype)
        return backend.forward(q, self.pool.layer_cache(LAYER), self.scale)

    def fill(self, cached: list[int]) -> None:
        """Write the first cached[i] tokens of each seq, as earlier steps would have."""
        specs = [(s.pages, 0, c) for s, c in zip(self.seqs, cached) if c > 0]
        rows = [(s, c) for s, c in zip(self.seqs, cached) if c > 0]
        meta = build_paged_metadata(specs, self.page_size, self.device)
        k = torch.cat([s.k[:c] for s, c in rows]).to(self.device)
        v = torch.cat([s.v[:c] for s, c in rows]).to(self.device)
        self.pool.write(
            LAYER,
            torch.stack((k, v), dim=1),
            self.pool.rows_of(meta.write_page_ids, meta.write_offsets),
        )


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str) -> None:
    diff = (out - ref).abs().max().item()
    print(f"{what}: max |paged - naive| = {diff:.3g} (tol {tol})")
    assert diff <= tol, f"{what}: max diff {diff:.3g} > {tol}"


FP32_TOL = 2e-5
BF16_TOL = 3e-2


@pytest.mark.parametrize("hq,hkv", [(6, 2), (4, 4)])
def test_pure_prefill(hq: int, hkv: int) -> None:
    h = Harness([13, 8, 1, 21], hq=hq, hkv=hkv)
    out, ref = h.step(TorchAttentionBackend(), [(0, 13), (0, 8), (0, 1), (0, 21)])
    assert_close(out, ref, FP32_TOL, f"prefill hq={hq} hkv={hkv}")


def test_chunked_prefill_chunks_of_7() -> None:
    n = 30
    h = Harness([n])
    backend = TorchAttentionBackend()
    for start in range(0, n, 7):
        out, ref = h.step(backend, [(start, min(7, n - start))])
        assert_close(out, ref, FP32_TOL, f"chunk at {start}")


def test_chunk_after_cached_prefix_two_seqs() -> None:
    h = Harness([19, 16])
    h.fill([12, 8])  # 8 cached: a page boundary (page_size 4)
    out, ref = h.step(TorchAttentionBackend(), [(12, 7), (8, 7)])
    assert_close(out, ref, FP32_TOL, "chunks after prefixes")


def test_pure_decode_different_lengths() -> None:
    lens = [1, 4, 5, 17, 33]  # 4: last page exactly full
    h = Harness(lens)
    h.fill([n - 1 for n in lens])
    out, ref = h.step(TorchAttentionBackend(), [(n - 1, 1) for n in lens])
    assert_close(out, ref, FP32_TOL, "decode")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decoding_sequence_gets_the_same_bits_alone_and_among_any_number(dtype) -> None:
    """One path for every batch (`_decode_math`): a stream's attention does not change when
    others join it, longer ones (its row padded) or shorter."""
    lens = [23, 5, 70, 1, 40, 9, 12, 64, 3, 33] * 4  # the model's GQA group of 3, D 64
    h = Harness(lens, hq=9, hkv=3, head_dim=64, page_size=16, dtype=dtype)
    h.fill([n - 1 for n in lens])
    decode = [(n - 1, 1) for n in lens]
    alone, ref = h.step(TorchAttentionBackend(), decode[:1])
    assert_close(alone, ref, FP32_TOL if dtype == torch.float32 else BF16_TOL, "alone")
    for n in (2, 7, 8, 9, 16, 17, 33, 40):
        out, _ = h.step(TorchAttentionBackend(), decode[:n])
        assert torch.equal(out[:1], alone), f"the first sequence differs among {n}"


def test_mixed_batch() -> None:
    lens = [9, 22, 3, 14, 8]
    chunks = [(8, 1), (15, 7), (0, 3), (13, 1), (4, 4)]  # decode, chunk, prefill, decode, chunk
    h = Harness(lens)
    h.fill([c for c, _ in chunks])
    out, ref = h.step(TorchAttentionBackend(), chunks)
    assert_close(out, ref, FP32_TOL, "mixed")


def test_plan_reused_across_layers() -> None:
    h = Harness([10, 6])
    h.fill([9, 0])
    meta = build_paged_metadata([(h.seqs[0].pages, 9, 1), (h.seqs[1].pages, 0, 6)], h.page_size)
    backend = TorchAttentionBackend()
    backend.plan(meta, h.hq, h.hkv, h.head_dim, h.page_size, h.dtype)
    q = torch.randn(meta.num_tokens, h.hq, h.head_dim)  # [T, Hq, D]
    out0 = backend.forward(q, h.pool.layer_cache(0), h.scale)
    out2 = backend.forward(q, h.pool.layer_cache(2), h.scale)
    again0 = backend.forward(q, h.pool.layer_cache(0), h.scale)
    assert torch.equal(out0, again0)
    assert not torch.allclose(out0, out2)  # each layer reads its own K/V


def test_bf16_mixed_and_decode() -> None:
    lens = [9, 22, 3, 14]
    chunks = [(8, 1), (15, 7), (0, 3), (13, 1)]
    h = Harness(lens, dtype=torch.bfloat16)
    h.fill([c for c, _ in chunks])
    out, ref = h.step(TorchAttentionBackend(), chunks)
    assert out.isfinite().all()
    assert_close(out, ref, BF16_TOL, "bf16 mixed")
    # Next step: decode the last token of each seq (its earlier tokens are all written now).
    out, ref = h.step(TorchAttentionBackend(), [(n - 1, 1) for n in lens])
    assert_close(out, ref, BF16_TOL, "bf16 decode")


def test_select_attention_backend_on_cpu() -> None:
    assert isinstance(select_attention_backend("cpu", torch.bfloat16), TorchAttentionBackend)
    assert isinstance(select_attention_backend("cpu", torch.float32), TorchAttentionBackend)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashInfer kernels need a CUDA device")
@pytest.mark.parametrize(
    "chunks",
    [
        [(8, 1), (15, 7), (0, 3), (13, 1), (4, 4)],  # mixed: the prefill wrapper
        [(8, 1), (21, 1), (2, 1), (13, 1), (7, 1)],  # decode only: the decode wrapper
    ],
    ids=["mixed", "decode"],
)
@pytest.mark.parametrize("hq,hkv", [(8, 2), (8, 8)])
def test_flashinfer_matches_torch_bf16(chunks: list[tuple[int, int]], hq: int, hkv: int) -> None:
    lens = [c + n for c, n in chunks]
    h = Harness(
        lens, hq=hq, hkv=hkv, head_dim=64, page_size=16, dtype=torch.bfloat16, device="cuda"
    )
    h.fill([c for c, _ in chunks])
    backend = select_attention_backend("cuda", torch.bfloat16)
    assert isinstance(backend, FlashInferAttentionBackend)
    out, ref = h.step(backend, chunks)
    meta = build_paged_metadata(
        [(s.pages, c, n) for s, (c, n) in zip(h.seqs, chunks)], h.page_size, "cuda"
    )
    q = torch.cat([s.q[c : c + n] for s, (c, n) in zip(h.seqs, chunks)]).cuda()
    torch_out = h.run(TorchAttentionBackend(), meta, q).float().cpu()
    assert_close(out, torch_out, BF16_TOL, "flashinfer vs torch")
    assert_close(out, ref, BF16_TOL, "flashinfer vs naive")


def test_select_attention_backend_cuda_fp32_uses_torch() -> None:
    # FlashInfer has no fp32 kernels; this needs no GPU (nothing is allocated).
    assert isinstance(select_attention_backend("cuda", torch.float32), TorchAttentionBackend)


def test_flashinfer_backend_rejects_cpu() -> None:
    pytest.importorskip("flashinfer")
    with pytest.raises(ValueError, match="CUDA"):
        FlashInferAttentionBackend("cpu")


def test_flashinfer_api_takes_our_arguments() -> None:
    """Guards the plan/run keywords we pass against the installed FlashInfer (no GPU needed)."""
    import inspect

    flashinfer = pytest.importorskip("flashinfer")
    prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper
    decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper
    prefill_plan = inspect.signature(prefill.plan).parameters
    for name in ("causal", "sm_scale", "q_data_type", "kv_data_type"):
        assert name in prefill_plan, name
    # 0.7 routes decode plan keywords through **kwargs to _plan_impl; older versions name them.
    decode_plan = inspect.signature(getattr(decode, "_plan_impl", decode.plan)).parameters
    for name in ("pos_encoding_mode", "sm_scale", "q_data_type", "kv_data_type"):
        assert name in decode_plan, name
    for cls in (prefill, decode):
        assert "kv_layout" in inspect.signature(cls.__init__).parameters
        assert list(inspect.signature(cls.run).parameters)[1:3] == ["q", "paged_kv_cache"]
    assert "use_tensor_cores" in inspect.signature(decode.__init__).parameters
    graph_args = ("use_cuda_graph", "paged_kv_indptr_buffer", "paged_kv_indices_buffer",
                  "paged_kv_last_page_len_buffer")  # fmt: skip
    for name in graph_args:  # FlashInferAttentionBackend.plan_graph's wrappers
        assert name in inspect.signature(decode.__init__).parameters, name


def test_asking_for_flashinfer_where_it_cannot_run_is_an_error_not_a_fallback() -> None:
    with pytest.raises(ValueError, match="needs --device cuda"):
        select_attention_backend("cpu", torch.bfloat16, "flashinfer")
    assert isinstance(
        select_attention_backend("cpu", torch.bfloat16, "torch"), TorchAttentionBackend
    )
