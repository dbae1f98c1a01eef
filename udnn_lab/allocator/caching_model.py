"""A model of PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp, default config).

It replays allocations and frees and says what ``torch.cuda.memory_allocated`` and
``memory_reserved`` would read after each, without a GPU.

NOTE [modelled allocator behaviour]
  Modelled, as the native allocator does it with PYTORCH_CUDA_ALLOC_CONF unset:
  1. A request of n bytes is rounded up to a multiple of 512 (at least 512); n == 0
     takes no block at all.
  2. Rounded sizes <= 1 MiB come from the small pool, larger ones from the large pool;
     a block never moves between pools.
  3. When no cached block fits, a segment is cudaMalloc'ed: 2 MiB for the small pool;
     20 MiB for large requests under 10 MiB; otherwise the request rounded up to 2 MiB.
  4. Best fit: the smallest free block of the pool that fits, the lowest address on ties.
  5. A block larger than the request is split (the request keeps the low addresses) if
     the remainder is >= 512 B in the small pool, > 1 MiB in the large pool; otherwise
     the whole block is handed out, and memory_allocated counts all of it.
  6. A freed block merges with free neighbours of its segment. Segments are never
     returned to the driver (no empty_cache) except when a segment does not fit the
     capacity: then every entirely free segment is released and the cudaMalloc retried
     (release_cached_blocks), and if that fails too, the allocation is out of memory.
  7. allocated = sum of handed-out block sizes; reserved = sum of segment sizes;
     inactive_split = free blocks of segments that are split (torch's inactive_split_bytes).
  Not modelled: several streams (and record_stream's deferred frees), CUDA graph
  pools, expandable_segments, max_split_size_mb (so no oversize blocks),
  garbage_collection_threshold, roundup_power2_divisions, per-process memory fraction,
  and the driver's choice of addresses (new segments here get increasing addresses, which
  decides best-fit ties between equal blocks). The first/worst fits are for comparison
  (document 003) and are not PyTorch's.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass

from udnn_lab.errors import AllocatorModelError, AllocatorOutOfMemory
from udnn_lab.units import CUDA_BLOCK_BYTES, cuda_block_bytes, format_bytes

MIN_BLOCK_BYTES = CUDA_BLOCK_BYTES  # kMinBlockSize
SMALL_REQUEST_BYTES = 1 << 20  # kSmallSize: the largest small-pool request
SMALL_SEGMENT_BYTES = 2 << 20  # kSmallBuffer
LARGE_SEGMENT_BYTES = 20 << 20  # kLargeBuffer
MIN_LARGE_ALLOC_BYTES = 10 << 20  # kMinLargeAlloc
LARGE_ROUNDING_BYTES = 2 << 20  # kRoundLarge
FITS = ("best", "first", "worst")


def round_request(nbytes: int) -> int:
    """Block bytes for a request: a multiple of 512, at least 512 (0 for an empty request)."""
    return cuda_block_bytes(nbytes)


def pool_kind(block_bytes: int) -> str:
    """'small' for rounded sizes up to 1 MiB, else 'large'."""
    return "small" if block_bytes <= SMALL_REQUEST_BYTES else "large"


def segment_bytes(block_bytes: int) -> int:
    """Bytes cudaMalloc'ed for a new segment that serves a rounded request of ``block_bytes``."""
    if block_bytes <= SMALL_REQUEST_BYTES:
        return SMALL_SEGMENT_BYTES
    if block_bytes < MIN_LARGE_ALLOC_BYTES:
        return LARGE_SEGMENT_BYTES
    return -(-block_bytes // LARGE_ROUNDING_BYTES) * LARGE_ROUNDING_BYTES


def should_split(kind: str, remainder_bytes: int) -> bool:
    if kind == "small":
        return remainder_bytes >= MIN_BLOCK_BYTES
    return remainder_bytes > SMALL_REQUEST_BYTES


class _Block:
    """A piece of a segment, free or handed out; neighbours are linked as in the native allocator."""

    __slots__ = ("address", "size", "pool", "allocated", "key", "request", "prev", "next")

    def __init__(self, address: int, size: int, pool: tuple[str, str]) -> None:
        self.address, self.size, self.pool = address, size, pool
        self.allocated, self.key, self.request = False, "", 0
        self.prev: _Block | None = None
        self.next: _Block | None = None

    @property
    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


@dataclass(frozen=True)
class Placement:
    """Where one allocation landed."""

    block: str
    address: int
    block_bytes: int  # handed out (>= the rounded request when the remainder was too small to split)
    new_segment_bytes: int  # cudaMalloc'ed for it (0: served from the cache)
    released_segments: int  # cached segments released before the cudaMalloc succeeded


class CachingAllocatorModel:
    """The allocator's state: segments, free blocks per pool, and the counters torch reports.

    ``fit`` picks the free block ('best' is PyTorch's); ``capacity_bytes`` is what the
    device can give the allocator (None: unlimited). Pools are keyed by (arena, kind):
    one arena, 'default', is PyTorch's; more arenas model separate MemPools.
    """

    def __init__(self, fit: str = "best", capacity_bytes: int | None = None) -> None:
        if fit not in FITS:
            raise ValueError(f"fit must be one of {FITS}, got {fit!r}")
        self.fit, self.capacity_bytes = fit, capacity_bytes
        self.allocated_bytes = 0  # torch.cuda.memory_allocated
        self.reserved_bytes = 0  # torch.cuda.memory_reserved
        self.live_bytes = 0  # requests rounded to 512 B: what udnn_lab's cuda_live_bytes counts
        self.requested_bytes = 0  # exact requests (torch's requested_bytes)
        self.inactive_split_bytes = 0
        self.segments: dict[int, tuple[int, tuple[str, str]]] = {}  # base address -> (bytes, pool)
        self._free: dict[tuple[str, str], list[tuple[int, int]]] = {}  # pool -> sorted (size, address)
        self._blocks: dict[int, _Block] = {}  # address -> every block, free or not
        self._live: dict[str, _Block] = {}  # key -> handed-out block
        self._next_address = 0

    # -- requests ------------------------------------------------------------------------
    def malloc(self, key: str, nbytes: int, arena: str = "default") -> Placement | None:
        """Hand out a block for ``key``; None for an empty request. Raises AllocatorOutOfMemory."""
        if key in self._live:
            raise AllocatorModelError(f"block {key!r} is allocated twice without a free in between; "
                                      "give each allocation its own name or free it first")
        size = round_request(nbytes)
        if size == 0:
            return None
        pool = (arena, pool_kind(size))
        block, new_bytes, released = self._find_free(pool, size), 0, 0
        if block is not None:
            self._unindex(block)
        else:
            new_bytes = segment_bytes(size)
            block, released = self._new_segment(pool, new_bytes, key, nbytes)
        self._hand_out(block, size, key, nbytes)
        return Placement(key, block.address, block.size, new_bytes, released)

    def free(self, key: str) -> int:
        """Return ``key``'s block to its pool, merging free neighbours; the block's bytes."""
        block = self._live.pop(key, None)
        if block is None:
            raise AllocatorModelError(f"free of block {key!r}, which is not allocated (never allocated, or "
                                      "already freed): check that every free follows its alloc")
        freed = block.size
        self.allocated_bytes -= block.size
        self.live_bytes -= round_request(block.request)
        self.requested_bytes -= block.request
        block.allocated, block.key, block.request = False, "", 0
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated:
                self._unindex(neighbour)
                block = self._merge(block, neighbour)
        self._index(block)
        return freed

    def release_cached_segments(self) -> int:
        """Release every entirely free segment (``torch.cuda.empty_cache``); how many were released."""
        free_blocks = [self._blocks[address] for blocks in self._free.values() for _, address in blocks]
        whole = [block for block in free_blocks if not block.is_split]
        for block in whole:
            self._unindex(block)
            del self._blocks[block.address]
            del self.segments[block.address]
            self.reserved_bytes -= block.size
        return len(whole)

    def block_of(self, key: str) -> tuple[int, int]:
        """(address, bytes) of a handed-out block."""
        if key not in self._live:
            raise KeyError(f"no allocated block named {key!r}")
        block = self._live[key]
        return block.address, block.size

    def check_consistency(self) -> None:
        """Raise AssertionError if the blocks, the free index and the counters disagree (for tests)."""
        by_segment: dict[int, int] = {}
        for block in self._blocks.values():
            first = block
            while first.prev is not None:
                first = first.prev
            by_segment[first.address] = by_segment.get(first.address, 0) + block.size
            if block.next is not None:
                assert block.next.address == block.address + block.size, f"gap after block {block.address:#x}"
                assert block.allocated or block.next.allocated, f"adjacent free blocks at {block.address:#x}"
        assert by_segment == {a: size for a, (size, _) in self.segments.items()}, "blocks do not tile the segments"
        assert self.reserved_bytes == sum(size for size, _ in self.segments.values())
        assert self.allocated_bytes == sum(b.size for b in self._live.values())
        free = sorted((b.size, b.address) for b in self._blocks.values() if not b.allocated)
        assert free == sorted(entry for entries in self._free.values() for entry in entries), "free index is stale"
        split = sum(b.size for b in self._blocks.values() if not b.allocated and b.is_split)
        assert self.inactive_split_bytes == split, "inactive_split_bytes is off"

    # -- seeding from a real allocator ---------------------------------------------------
    def add_segment(self, address: int, blocks: list[tuple[int, str | None, int]], kind: str,
                    arena: str = "default") -> None:
        """Add an existing segment: ``blocks`` in address order as (bytes, key or None if free, requested bytes)."""
        if kind not in ("small", "large"):
            raise ValueError(f"a segment's kind is 'small' or 'large', got {kind!r}")
        if address in self.segments:
            raise AllocatorModelError(f"a segment at {address:#x} is already held")
        duplicate = next((key for _, key, _ in blocks if key is not None and key in self._live), None)
        if duplicate is not None:
            raise AllocatorModelError(f"block {duplicate!r} is already allocated in another segment")
        pool, total, previous, cursor = (arena, kind), sum(size for size, _, _ in blocks), None, address
        self.segments[address] = (total, pool)
        self.reserved_bytes += total
        made = []
        for size, key, requested in blocks:
            block = _Block(cursor, size, pool)
            block.prev, cursor = previous, cursor + size
            if previous is not None:
                previous.next = block
            self._blocks[block.address] = previous = block
            made.append((block, key, requested))
        for block, key, requested in made:
            if key is None:
                self._index(block)
            else:
                self._hand_out(block, size=block.size, key=key, nbytes=requested or block.size)
        self._next_address = max(self._next_address, _round_up(cursor, LARGE_ROUNDING_BYTES))

    # -- internals -----------------------------------------------------------------------
    def _find_free(self, pool: tuple[str, str], size: int) -> _Block | None:
        free = self._free.get(pool, [])
        at = bisect_left(free, (size, -1))
        if at == len(free):
            return None
        if self.fit == "best":
            address = free[at][1]
        elif self.fit == "worst":
            address = free[-1][1]
        else:
            address = min(a for _, a in free[at:])
        return self._blocks[address]

    def _new_segment(self, pool: tuple[str, str], nbytes: int, key: str, request: int) -> tuple[_Block, int]:
        released = 0
        if not self._fits_capacity(nbytes):
            released = self.release_cached_segments()
            if not self._fits_capacity(nbytes):
                assert self.capacity_bytes is not None  # without a capacity everything fits
                raise AllocatorOutOfMemory(
                    f"allocating {key!r} ({format_bytes(request)}) needs a new {format_bytes(nbytes)} segment, but "
                    f"{format_bytes(self.reserved_bytes)} is reserved ({format_bytes(self.allocated_bytes)} "
                    f"allocated) of a {format_bytes(self.capacity_bytes)} capacity, even after releasing "
                    f"{released} free cached segments: lower the batch size or plan for a smaller budget")
        address = self._next_address
        self._next_address += _round_up(nbytes, LARGE_ROUNDING_BYTES)
        block = _Block(address, nbytes, pool)
        self._blocks[address] = block
        self.segments[address] = (nbytes, pool)
        self.reserved_bytes += nbytes
        return block, released

    def _fits_capacity(self, nbytes: int) -> bool:
        return self.capacity_bytes is None or self.reserved_bytes + nbytes <= self.capacity_bytes

    def _hand_out(self, block: _Block, size: int, key: str, nbytes: int) -> None:
        remainder = block.size - size
        if remainder > 0 and should_split(block.pool[1], remainder):
            rest = _Block(block.address + size, remainder, block.pool)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._blocks[rest.address] = rest
            self._index(rest)
        block.allocated, block.key, block.request = True, key, nbytes
        self._live[key] = block
        self.allocated_bytes += block.size
        self.live_bytes += round_request(nbytes)
        self.requested_bytes += nbytes

    def _merge(self, block: _Block, neighbour: _Block) -> _Block:
        """Merge two adjacent free blocks into the lower one; returns it."""
        low, high = (neighbour, block) if neighbour.address < block.address else (block, neighbour)
        low.size += high.size
        low.next = high.next
        if high.next is not None:
            high.next.prev = low
        del self._blocks[high.address]
        return low

    def _index(self, block: _Block) -> None:
        insort(self._free.setdefault(block.pool, []), (block.size, block.address))
        if block.is_split:
            self.inactive_split_bytes += block.size

    def _unindex(self, block: _Block) -> None:
        free = self._free[block.pool]
        at = bisect_left(free, (block.size, block.address))
        if at == len(free) or free[at] != (block.size, block.address):
            raise AssertionError(f"free block at {block.address:#x} is missing from its pool's index")
        del free[at]
        if block.is_split:
            self.inactive_split_bytes -= block.size


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
