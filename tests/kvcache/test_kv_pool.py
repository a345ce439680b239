import pytest
import torch
from torch._inductor.utils import run_and_get_code

from pd.kvcache import KVPool, build_paged_metadata, bytes_per_page, pages_for_budget

N, L, H, P, D = 6, 3, 2, 4, 8


def make_pool(dtype: torch.dtype = torch.float32) -> KVPool:
    return KVPool(N, L, H, P, D, dtype, "cpu")


def test_layout_and_strides() -> None:
    pool = make_pool(torch.bfloat16)
    assert pool.shape == (N, L, 2, H, P, D)
    assert pool.buffer.is_contiguous()
    assert pool.page_bytes == L * 2 * H * P * D * 2
    assert pool.layer_bytes == 2 * H * P * D * 2
    assert pool.head_bytes == P * D * 2
    assert pool.nbytes == N * pool.page_bytes
    assert pool.page_addr(3) == pool.data_ptr() + 3 * pool.page_bytes
    cache = pool.layer_cache(1)
    assert cache.shape == (N, 2, H, P, D)
    # A strided view: the page stride spans all layers, the rest is dense HND.
    assert cache.stride() == (L * 2 * H * P * D, H * P * D, P * D, D, 1)
    assert not cache.is_contiguous()
    assert cache.data_ptr() == pool.data_ptr() + pool.layer_bytes


def test_sizing_helpers() -> None:
    per_page = bytes_per_page(L, H, P, D, torch.float16)
    assert per_page == L * 2 * H * P * D * 2
    assert pages_for_budget(10 * per_page + per_page - 1, L, H, P, D, torch.float16) == 10
    assert pages_for_budget(0, L, H, P, D, torch.float16) == 0


def test_rejects_bad_shape() -> None:
    with pytest.raises(ValueError, match="page_size"):
        KVPool(N, L, H, 0, D, torch.float32, "cpu")


def test_write_then_read_back() -> None:
    pool = make_pool()
    meta = build_paged_metadata([([4, 1], 2, 3), ([5], 0, 2)], P)  # tokens 2..4 and 0..1
    T = meta.num_tokens
    k = torch.randn(T, H, D)  # [T, H, D]
    v = torch.randn(T, H, D)  # [T, H, D]
    pool.write(2, torch.stack((k, v), dim=1), pool.rows_of(meta.write_page_ids, meta.write_offsets))
    cache = pool.layer_cache(2)
    # seq 0: positions 2, 3 land in page 4 slots 2, 3; position 4 in page 1 slot 0.
    torch.testing.assert_close(cache[4, 0, :, 2], k[0])
    torch.testing.assert_close(cache[4, 1, :, 3], v[1])
    torch.testing.assert_close(cache[1, 0, :, 0], k[2])
    torch.testing.assert_close(cache[5, 1, :, 1], v[4])
    # In the raw buffer too, and nothing else moved.
    torch.testing.assert_close(pool.buffer[1, 2, 1, :, 0], v[2])
    assert pool.buffer[:, :2].abs().sum() == 0  # other layers untouched
    assert pool.buffer.abs().gt(0).sum() == 2 * T * H * D


def test_compiled_step_writes_the_pool_in_place() -> None:
    """A compiled step that writes and reads every layer's K/V (as a decode step does) stores
    the new rows into the pool and nothing else: no kernel spans the whole pool. A view of the
    pool taken inside the graph (`buffer.view(-1, D).index_put_`) was functionalized into a
    copy of all of it (its element count shows in the code). Same pool as eager's after, same
    result."""
    meta = build_paged_metadata([([4, 1], 2, 3), ([5], 0, 2)], P)
    rows = make_pool().rows_of(meta.write_page_ids, meta.write_offsets)
    kv = torch.randn(meta.num_tokens, 2, H, D)
    pages = torch.tensor([4, 1, 5])

    def step(pool: KVPool, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(())
        for layer in range(L):
            pool.write(layer, x + layer, r)
            out = out + pool.layer_cache(layer).index_select(0, pages).sum()
        return out

    eager, compiled = make_pool(), make_pool()
    with torch.inference_mode():
        want = step(eager, kv, rows)
        got, codes = run_and_get_code(
            torch.compile(lambda x, r: step(compiled, x, r), fullgraph=True), kv, rows
        )
    assert f"{compiled.buffer.numel()}L" not in "\n".join(codes)
    assert torch.equal(compiled.buffer, eager.buffer)
    torch.testing.assert_close(got, want)
