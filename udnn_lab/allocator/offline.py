"""Plan-aware placement: every block's life is known before the step, so one arena is laid out ahead.

This is the alternative to an online allocator that document 003 weighs: a runtime
that knows the whole schedule (a Plan) can reserve one arena and give each block a
fixed offset. Blocks are placed one at a time, in a chosen order, each at the lowest
offset where it overlaps no already placed block that is alive at the same time.
Offsets and sizes are multiples of 512 B (the caching allocator's rounding); the arena
is one cudaMalloc, rounded up to 2 MiB like a large segment.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from udnn_lab.allocator.caching_model import LARGE_ROUNDING_BYTES, AllocatorModelError, round_request
from udnn_lab.allocator.events import AllocEvent

ARENA_ORDERS = ("step", "long-lived-first", "largest-first")


@dataclass(frozen=True)
class _Life:
    block: str
    size: int  # rounded to 512 B
    start: int  # position of its alloc event
    end: int  # position of its free event (len(events) if never freed)
    long_lived: bool


@dataclass(frozen=True)
class ArenaLayout:
    """Offsets of every block life, and per event the live bytes and the arena's high-water mark."""

    order: str
    offsets: dict[str, list[int]]  # block name -> offset of each of its lives, in event order
    live_bytes: np.ndarray  # int64 [events]: rounded bytes live after each event
    high_water_bytes: np.ndarray  # int64 [events]: highest end offset of the blocks allocated so far
    hole_bytes: np.ndarray  # int64 [events]: free bytes below the top of the live blocks
    arena_bytes: int  # the whole arena: the final high-water mark rounded up to 2 MiB


def lay_out(events: Sequence[AllocEvent], order: str = "step") -> ArenaLayout:
    """Place every block of ``events`` in one arena, taking them in ``order``.

    'step': as the step allocates them. 'long-lived-first': persistent and
    forward-to-backward blocks first (in step order), then temporaries (in step order),
    so long-lived data is packed low and temporaries fill the space above and between.
    'largest-first': by decreasing size, ties in step order (greedy by size).
    """
    if order not in ARENA_ORDERS:
        raise ValueError(f"arena order must be one of {ARENA_ORDERS}, got {order!r}")
    lives = _lives(events)
    offsets = _place(lives, _sorted(lives, order))
    live, high, top = _curves(events, lives, offsets)
    arena = -(-int(high.max(initial=0)) // LARGE_ROUNDING_BYTES) * LARGE_ROUNDING_BYTES
    named: dict[str, list[int]] = {}
    for life, offset in zip(lives, offsets):
        named.setdefault(life.block, []).append(int(offset))
    return ArenaLayout(order, named, live, high, top - live, arena)


def _lives(events: Sequence[AllocEvent]) -> list[_Life]:
    open_lives: dict[str, tuple[int, int]] = {}  # block -> (index into lives, position of its alloc)
    lives: list[_Life] = []
    for position, event in enumerate(events):
        if event.action == "alloc":
            if event.block in open_lives:
                raise AllocatorModelError(f"block {event.block!r} is allocated twice without a free in between")
            open_lives[event.block] = (len(lives), position)
            lives.append(_life(event, position, len(events)))
        else:
            if event.block not in open_lives:
                raise AllocatorModelError(f"free of block {event.block!r}, which is not allocated at event "
                                          f"{position}: check that every free follows its alloc")
            index, start = open_lives.pop(event.block)
            lives[index] = _life(events[start], start, position)
    return lives


def _life(alloc: AllocEvent, start: int, end: int) -> _Life:
    return _Life(alloc.block, round_request(alloc.nbytes), start, end, alloc.lifetime != "temporary")


def _sorted(lives: list[_Life], order: str) -> list[int]:
    """Indices of ``lives`` in the order they are placed."""
    if order == "step":
        return list(range(len(lives)))
    if order == "long-lived-first":
        return sorted(range(len(lives)), key=lambda i: (not lives[i].long_lived, i))
    return sorted(range(len(lives)), key=lambda i: (-lives[i].size, i))


def _place(lives: list[_Life], order: list[int]) -> np.ndarray:
    """Offset of each life: the lowest gap among the placed lives that overlap it in time."""
    n = len(lives)
    starts = np.array([life.start for life in lives], dtype=np.int64)
    ends = np.array([life.end for life in lives], dtype=np.int64)
    sizes = np.array([life.size for life in lives], dtype=np.int64)
    offsets = np.full(n, -1, dtype=np.int64)
    placed = np.zeros(n, dtype=bool)
    for i in order:
        if sizes[i] == 0:
            offsets[i], placed[i] = 0, True
            continue
        overlapping = placed & (starts < ends[i]) & (starts[i] < ends)
        taken = sorted(zip(offsets[overlapping].tolist(), sizes[overlapping].tolist()))
        candidate = 0
        for offset, size in taken:
            if offset - candidate >= sizes[i]:
                break
            candidate = max(candidate, offset + size)
        offsets[i], placed[i] = candidate, True
    return offsets


def _curves(events: Sequence[AllocEvent], lives: list[_Life],
            offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per event: live bytes, high-water mark, and the top of the live blocks (holes lie below it)."""
    starting = {life.start: i for i, life in enumerate(lives)}
    ending = {life.end: i for i, life in enumerate(lives)}
    live, high, top = (np.zeros(len(events), dtype=np.int64) for _ in range(3))
    tops: list[tuple[int, int]] = []  # max-heap of (-end offset, life) with lazy deletion
    alive: set[int] = set()
    total = high_water = 0
    for position in range(len(events)):
        if position in starting:
            i = starting[position]
            total += lives[i].size
            high_water = max(high_water, int(offsets[i]) + lives[i].size)
            alive.add(i)
            heapq.heappush(tops, (-(int(offsets[i]) + lives[i].size), i))
        elif position in ending:
            i = ending[position]
            total -= lives[i].size
            alive.discard(i)
        while tops and tops[0][1] not in alive:
            heapq.heappop(tops)
        live[position], high[position] = total, high_water
        top[position] = -tops[0][0] if tops else 0
    return live, high, top
