import pytest

from udnn_lab.runtime.pinned_pool import HostMemoryError, HostPool, available_host_bytes
from udnn_lab.units import cuda_block_bytes


def test_slices_are_aligned_reused_and_coalesced():
    pool = HostPool(4096, pinned=False)
    a_offset, a = pool.take(1000)
    b_offset, b = pool.take(1000)
    assert a.numel() == 1000 and b_offset == 1024 and a_offset == 0
    pool.give_back(a_offset)
    c_offset, _ = pool.take(512)
    assert c_offset == 0  # first fit reuses the freed space
    pool.give_back(c_offset)
    pool.give_back(b_offset)
    whole, view = pool.take(4096)  # both neighbours coalesced back into one free range
    assert whole == 0 and view.numel() == 4096
    assert pool.stats().peak_in_use_bytes == 4096


def test_the_pool_grows_only_when_empty_and_says_why_otherwise():
    pool = HostPool(1024, pinned=False)
    offset, _ = pool.take(2048)  # nothing in use: it grows
    assert pool.capacity_bytes >= 2048 and pool.stats().grown == 1
    with pytest.raises(HostMemoryError, match="pinned_pool_bytes"):
        pool.take(pool.capacity_bytes)
    pool.reset()
    assert pool.stats().in_use_bytes == 0


def test_the_cap_is_checked_before_allocating():
    with pytest.raises(HostMemoryError, match="available"):
        HostPool(10 * 2**20, pinned=False, cap_bytes=2**20)
    assert available_host_bytes() > 0


def test_an_empty_storage_takes_no_room_as_the_plan_sizes_it():
    # cuDNN's batch norm saves an empty storage; Plan.host_pool_bytes counts it as no CUDA block (a CUDA probe's
    # pool, sized for its offloads, was full by exactly the 512 bytes such a slice took)
    sizes = [512, 0, 512]
    pool = HostPool(sum(cuda_block_bytes(n) for n in sizes), pinned=False)
    taken = [pool.take(n) for n in sizes]
    assert [view.numel() for _, view in taken] == sizes
    assert pool.stats().in_use_bytes == 1024 and pool.stats().grown == 0
    for offset, _ in taken:
        pool.give_back(offset)
    assert pool.stats().in_use_bytes == 0 and pool.take(1024)[0] == 0
