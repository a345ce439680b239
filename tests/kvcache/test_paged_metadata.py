import pytest
import torch

from pd.kvcache import build_paged_metadata


def ints(t: torch.Tensor) -> list[int]:
    return t.tolist()


def test_mixed_batch_by_hand() -> None:
    page_size = 4
    meta = build_paged_metadata(
        [
            ([5, 2, 9, 1, 0], 16, 1),  # decode: 16 cached fill 4 pages; the new token opens a 5th
            ([7, 8], 0, 4),  # prefill of one exactly full page; page 8 is spare, not used
            ([3, 4, 6], 4, 7),  # chunk after one full page: positions 4..10 on pages 4, 6
        ],
        page_size,
    )
    assert ints(meta.qo_indptr) == [0, 1, 5, 12]
    assert ints(meta.kv_indptr) == [0, 5, 6, 9]
    assert ints(meta.kv_indices) == [5, 2, 9, 1, 0, 7, 3, 4, 6]
    assert ints(meta.kv_last_page_len) == [1, 4, 3]
    assert ints(meta.positions) == [16, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert ints(meta.write_page_ids) == [0, 7, 7, 7, 7, 4, 4, 4, 4, 6, 6, 6]
    assert ints(meta.write_offsets) == [0, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2]
    assert meta.qo_lens == [1, 4, 7]
    assert meta.kv_lens == [17, 4, 11]
    assert (meta.num_tokens, meta.batch_size, meta.is_decode_only) == (12, 3, False)
    assert meta.max_kv_len == 17
    for t in (meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len):
        assert t.dtype == torch.int32
    for t in (meta.positions, meta.write_page_ids, meta.write_offsets):
        assert t.dtype == torch.int64
    assert ints(meta.qo_indptr_host) == [0, 1, 5, 12]
    assert ints(meta.kv_indptr_host) == [0, 5, 6, 9]
    assert ints(meta.kv_last_page_len_host) == [1, 4, 3]


def test_decode_only_and_last_page_exactly_full() -> None:
    meta = build_paged_metadata([([3, 1], 7, 1), ([2], 0, 1), ([0, 4, 5], 9, 1)], page_size=4)
    assert meta.is_decode_only
    # seq 0 fills its 2nd page exactly (8 tokens), seq 1 holds one token, seq 2 10 tokens.
    assert ints(meta.kv_indptr) == [0, 2, 3, 6]
    assert ints(meta.kv_indices) == [3, 1, 2, 0, 4, 5]
    assert ints(meta.kv_last_page_len) == [4, 1, 2]
    assert ints(meta.positions) == [7, 0, 9]
    assert ints(meta.write_page_ids) == [1, 2, 5]
    assert ints(meta.write_offsets) == [3, 0, 1]
    assert meta.kv_lens == [8, 1, 10]


def test_page_size_one() -> None:
    meta = build_paged_metadata([([9, 8, 7], 1, 2)], page_size=1)
    assert ints(meta.kv_indices) == [9, 8, 7]
    assert ints(meta.kv_last_page_len) == [1]
    assert ints(meta.write_page_ids) == [8, 7]
    assert ints(meta.write_offsets) == [0, 0]


def test_empty_batch() -> None:
    meta = build_paged_metadata([], page_size=4)
    assert (meta.batch_size, meta.num_tokens, meta.is_decode_only) == (0, 0, False)
    assert ints(meta.qo_indptr) == [0] and ints(meta.kv_indices) == []


def test_rejects_too_few_pages_and_empty_seq() -> None:
    with pytest.raises(ValueError, match="need 2 pages"):
        build_paged_metadata([([1], 4, 1)], page_size=4)
    with pytest.raises(ValueError, match="num_new >= 1"):
        build_paged_metadata([([1], 2, 0)], page_size=4)


def test_to_another_device_keeps_host_copies() -> None:
    meta = build_paged_metadata([([3, 1], 5, 2)], page_size=4)
    assert meta.to("cpu") is meta and meta.device == torch.device("cpu")
    moved = meta.to("meta")  # torch's data-less device: exercises the move without a GPU
    assert moved.device.type == "meta"
    for name in (
        "qo_indptr",
        "kv_indptr",
        "kv_indices",
        "kv_last_page_len",
        "positions",
        "write_page_ids",
        "write_offsets",
    ):
        t = getattr(moved, name)
        assert t.device.type == "meta" and t.shape == getattr(meta, name).shape, name
    assert moved.kv_indptr_host is meta.kv_indptr_host
    assert (moved.kv_lens, moved.num_tokens, moved.page_size) == ([7], 2, 4)
