"""Host memory for offloaded tensors: one buffer, allocated once, carved up per tensor.

On CUDA the buffer is pinned (page-locked), so device-to-host and host-to-device copies
can run asynchronously on their own streams; on a CPU-only machine it is ordinary memory.
The pool never takes more than its cap (by default half of the host memory available when
it is created) and says so before the machine would swap.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from udnn_lab.devices import HOST_POOL_SHARE, available_host_bytes
from udnn_lab.errors import HostMemoryError
from udnn_lab.units import CUDA_BLOCK_BYTES, format_bytes

_ALIGN = CUDA_BLOCK_BYTES  # every slice starts on a 512-byte boundary, as CUDA copies like
EMPTY = -1  # the offset of an empty slice, which holds no room in the pool


@dataclass(frozen=True)
class PoolStats:
    capacity_bytes: int
    in_use_bytes: int
    peak_in_use_bytes: int
    pinned: bool
    grown: int  # times the pool had to grow after it was first allocated


class HostPool:
    """A first-fit allocator over one host buffer; slices are uint8 views of it."""

    def __init__(self, nbytes: int, pinned: bool, cap_bytes: int | None = None) -> None:
        self.pinned = pinned
        self.cap_bytes = cap_bytes if cap_bytes is not None else int(available_host_bytes() * HOST_POOL_SHARE)
        self._buffer = self._allocate(max(_round(nbytes), _ALIGN))
        self._free: list[tuple[int, int]] = [(0, self._buffer.numel())]  # (offset, size), sorted by offset
        self._used: dict[int, int] = {}  # offset -> size
        self._in_use = self._peak = 0
        self._grown = 0

    def _allocate(self, nbytes: int) -> torch.Tensor:
        if nbytes > self.cap_bytes:
            raise HostMemoryError(
                f"offloading needs {format_bytes(nbytes)} of host memory, more than the pool may take "
                f"({format_bytes(self.cap_bytes)}: {HOST_POOL_SHARE:.0%} of the "
                f"{format_bytes(available_host_bytes())} available now). Raise the budget (offload less), lower the "
                "batch size, or pass a larger host_cap_bytes if the machine really has the memory")
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)

    @property
    def capacity_bytes(self) -> int:
        return self._buffer.numel()

    def stats(self) -> PoolStats:
        return PoolStats(self.capacity_bytes, self._in_use, self._peak, self.pinned, self._grown)

    def take(self, nbytes: int) -> tuple[int, torch.Tensor]:
        """A slice of at least ``nbytes``: (its offset, the uint8 view). An empty storage (cuDNN's batch norm saves
        one) takes no room, as it takes no CUDA block in ``Plan.host_pool_bytes``: its offset is ``EMPTY``."""
        if nbytes == 0:
            return EMPTY, self._buffer[:0]
        size = max(_round(nbytes), _ALIGN)
        for i, (offset, free) in enumerate(self._free):
            if free >= size:
                self._free[i:i + 1] = [(offset + size, free - size)] if free > size else []
                self._used[offset] = size
                self._in_use += size
                self._peak = max(self._peak, self._in_use)
                return offset, self._buffer[offset:offset + nbytes]
        self._grow(size)
        return self.take(nbytes)

    def give_back(self, offset: int) -> None:
        if offset == EMPTY:
            return
        size = self._used.pop(offset)
        self._in_use -= size
        position = bisect.bisect(self._free, (offset, size))
        self._free.insert(position, (offset, size))
        if position + 1 < len(self._free) and offset + size == self._free[position + 1][0]:
            self._free[position:position + 2] = [(offset, size + self._free[position + 1][1])]
        if position > 0 and sum(self._free[position - 1]) == self._free[position][0]:
            self._free[position - 1:position + 1] = [(self._free[position - 1][0],
                                                        self._free[position - 1][1] + self._free[position][1])]

    def reset(self) -> None:
        """Every slice back (between steps, or after a failed one)."""
        self._free = [(0, self.capacity_bytes)]
        self._used.clear()
        self._in_use = 0

    def release(self) -> None:
        """Hand the buffer back to the machine. PyTorch caches freed pinned blocks for reuse, so
        without emptying that cache the memory stays page-locked until the process exits."""
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self._free, self._in_use = [(0, 0)], 0
        self._used.clear()
        if self.pinned:
            empty_pinned_cache()

    def _grow(self, size: int) -> None:
        """A bigger buffer; only when nothing is in use (the plan's pool size was too small)."""
        if self._used:
            raise HostMemoryError(
                f"the host pool ({format_bytes(self.capacity_bytes)}) is full while {format_bytes(self._in_use)} are "
                f"offloaded and {format_bytes(size)} more are needed: the plan's pinned_pool_bytes is too small for "
                "this step; plan again, or give the runtime a larger pool_bytes")
        self._buffer = self._allocate(_round(self.capacity_bytes + size))
        self._free = [(0, self._buffer.numel())]
        self._grown += 1


def empty_pinned_cache() -> None:
    """Return unused pinned blocks that PyTorch's host caching allocator keeps."""
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    (empty or torch._C._host_emptyCache)()


def _round(nbytes: int) -> int:
    return ((nbytes + _ALIGN - 1) // _ALIGN) * _ALIGN
