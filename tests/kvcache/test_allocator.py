import pytest

from pd.kvcache import PageAllocator, PageAllocatorError


def test_allocate_low_ids_first_and_counts() -> None:
    alloc = PageAllocator(8)
    assert (alloc.num_total, alloc.num_free, alloc.num_used) == (8, 8, 0)
    assert alloc.allocate(3) == [0, 1, 2]
    assert alloc.allocate(2) == [3, 4]
    assert (alloc.num_free, alloc.num_used) == (3, 5)
    alloc.free([1, 0])
    assert alloc.allocate(3) == [0, 1, 5]  # freed low ids come back first
    alloc.check_integrity()


def test_can_allocate_and_none_when_full() -> None:
    alloc = PageAllocator(4)
    assert alloc.can_allocate(4) and not alloc.can_allocate(5)
    assert alloc.allocate(5) is None
    assert alloc.num_free == 4  # all-or-nothing: nothing taken
    assert alloc.allocate(4) == [0, 1, 2, 3]
    assert not alloc.can_allocate(1)
    assert alloc.allocate(1) is None
    assert alloc.allocate(0) == []
    alloc.check_integrity()


def test_negative_allocate_raises() -> None:
    with pytest.raises(ValueError):
        PageAllocator(4).allocate(-1)


def test_double_free_and_unknown_page_raise() -> None:
    alloc = PageAllocator(4)
    pages = alloc.allocate(2)
    assert pages is not None
    alloc.free(pages)
    with pytest.raises(PageAllocatorError, match="double free of page 0"):
        alloc.free([0])
    with pytest.raises(PageAllocatorError, match="not in this pool"):
        alloc.free([7])
    with pytest.raises(PageAllocatorError, match="not in this pool"):
        alloc.free([-1])
    alloc.check_integrity()


def test_bad_free_frees_nothing() -> None:
    alloc = PageAllocator(4)
    alloc.allocate(3)
    with pytest.raises(PageAllocatorError, match="twice in one free"):
        alloc.free([0, 1, 0])
    with pytest.raises(PageAllocatorError):
        alloc.free([2, 3])  # 3 was never allocated
    assert alloc.num_used == 3
    alloc.check_integrity()


def test_check_integrity_catches_corruption() -> None:
    alloc = PageAllocator(4)
    alloc.allocate(2)
    alloc._free_heap.append(0)  # a page both free and used
    with pytest.raises(AssertionError, match="both free and used"):
        alloc.check_integrity()


def test_churn_keeps_integrity() -> None:
    alloc = PageAllocator(64)
    held: list[list[int]] = []
    for step in range(200):
        n = (step * 7) % 9
        if step % 3 == 2 and held:
            alloc.free(held.pop(step % len(held)))
        else:
            pages = alloc.allocate(n)
            if pages is not None:
                held.append(pages)
        alloc.check_integrity()
    assert alloc.num_used == sum(len(p) for p in held)
    for pages in held:
        alloc.free(pages)
    assert alloc.num_free == 64
    alloc.check_integrity()
