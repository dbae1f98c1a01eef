"""A model of PyTorch's CUDA caching allocator, and offline allocation heuristics.

May import: the Graph, the Plan IR, units and errors; simulation only to replay a plan's events."""

from udnn_lab.allocator.heuristics import (  # noqa: F401
    ARENA_ORDERS,
    CURVE_COLUMNS,
    FITS,
    HEURISTICS,
    LIFETIMES,
    AllocatorModelError,
    AllocatorOutOfMemory,
    AllocatorReplay,
    AllocEvent,
    ArenaLayout,
    CachingAllocatorModel,
    Heuristic,
    Placement,
    classify_lifetimes,
    compare,
    events_from_graph,
    events_from_memory_trace,
    events_from_simulation,
    heuristic,
    heuristics,
    lay_out,
    model_from_snapshot,
    pool_kind,
    preallocate_long_lived,
    replay,
    round_request,
    segment_bytes,
)

__all__ = [
    "ARENA_ORDERS", "AllocEvent", "AllocatorModelError", "AllocatorOutOfMemory", "AllocatorReplay",
    "ArenaLayout", "CURVE_COLUMNS", "CachingAllocatorModel", "FITS", "HEURISTICS", "Heuristic", "LIFETIMES",
    "Placement", "classify_lifetimes", "compare", "events_from_graph", "events_from_memory_trace",
    "events_from_simulation", "heuristic", "heuristics", "lay_out", "model_from_snapshot", "pool_kind",
    "preallocate_long_lived", "replay", "round_request", "segment_bytes",
]
