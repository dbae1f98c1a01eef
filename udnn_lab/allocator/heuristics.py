"""Reserved memory and fragmentation of a step under PyTorch's caching allocator, and under alternatives.

``replay(events)`` runs allocation/free events through a model of the CUDA caching
allocator (caching_model.py, NOTE [modelled allocator behaviour]) or through a
plan-aware arena layout (offline.py). ``compare(graph, plan)`` does it for
every heuristic of document 003's comparison, one row each. Events come from
allocator/events.py (NOTE [event order of a step]).

What the numbers mean (bytes):
  live_bytes      requests rounded to 512 B: udnn_lab's ``cuda_live_bytes`` prediction
  allocated_bytes blocks handed out: ``torch.cuda.memory_allocated`` (>= live: a block
                  whose remainder is too small to split is handed out whole)
  reserved_bytes  segments held: ``torch.cuda.memory_reserved``
  fragmentation   1 - live_peak / reserved_peak: the share of the reserved peak that the
                  step's data never needs at once (rounding, unsplit remainders, free
                  holes in segments, segments cached for the other pool)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from udnn_lab.allocator.caching_model import (
    FITS,
    LARGE_ROUNDING_BYTES,
    AllocatorModelError,
    AllocatorOutOfMemory,
    CachingAllocatorModel,
    Placement,
    pool_kind,
    round_request,
    segment_bytes,
)
from udnn_lab.allocator.events import (
    LIFETIMES,
    AllocEvent,
    address_name,
    classify_lifetimes,
    events_from_graph,
    events_from_memory_trace,
    events_from_simulation,
)
from udnn_lab.allocator.offline import ARENA_ORDERS, ArenaLayout, lay_out
from udnn_lab.simulation.simulator import simulate
from udnn_lab.units import format_bytes

__all__ = [
    "ARENA_ORDERS", "CURVE_COLUMNS", "FITS", "HEURISTICS", "LIFETIMES", "AllocEvent", "AllocatorModelError",
    "AllocatorOutOfMemory", "AllocatorReplay", "ArenaLayout", "CachingAllocatorModel", "Heuristic", "Placement",
    "classify_lifetimes", "compare", "events_from_graph", "events_from_memory_trace", "events_from_simulation",
    "heuristic", "heuristics", "lay_out", "model_from_snapshot", "pool_kind", "preallocate_long_lived", "replay",
    "round_request", "segment_bytes",
]

CURVE_COLUMNS = ["index", "action", "block", "op", "lifetime", "nbytes", "block_bytes", "address",
                 "new_segment_bytes", "live_bytes", "allocated_bytes", "reserved_bytes", "inactive_split_bytes",
                 "segments"]


@dataclass(frozen=True)
class Heuristic:
    """One way to place a step's blocks (document 003 compares them)."""

    name: str
    kind: str  # 'caching' (the caching allocator model, online) or 'arena' (plan-aware layout, offline)
    description: str
    fit: str = "best"  # caching: which free block of the pool is taken
    lifetime_pools: bool = False  # caching: long-lived blocks get pools (segments) of their own
    preallocate: bool = False  # caching: long-lived blocks are allocated when the step starts
    arena_order: str = ""  # arena: the order blocks are placed in


HEURISTICS = (
    Heuristic("best-fit", "caching", "PyTorch's CUDA caching allocator as it is: the smallest free block of the "
              "request's pool that fits, events as the step runs"),
    Heuristic("first-fit", "caching", "the same allocator (pools, segments, splitting, merging) taking the "
              "lowest-address free block that fits", fit="first"),
    Heuristic("worst-fit", "caching", "the same allocator taking the largest free block of the pool",
              fit="worst"),
    Heuristic("lifetime-pools", "caching", "best fit, but persistent and forward-to-backward blocks come from "
              "segments of their own, apart from temporaries (a plan-aware runtime can do it with "
              "torch.cuda.MemPool)", lifetime_pools=True),
    Heuristic("preallocate-long-lived", "caching", "best fit, with every long-lived block of the step "
              "(forward-to-backward, and gradients) allocated when the step starts, before any temporary; "
              "each is still freed when the step frees it, so the live peak can rise", preallocate=True),
    Heuristic("arena-step-order", "arena", "one arena laid out ahead, blocks placed in step order at the lowest "
              "offset free during their life", arena_order="step"),
    Heuristic("arena-long-lived-first", "arena", "one arena laid out ahead, long-lived blocks placed first "
              "(packed low), then temporaries in step order", arena_order="long-lived-first"),
    Heuristic("arena-largest-first", "arena", "one arena laid out ahead, blocks placed largest first "
              "(greedy by size)", arena_order="largest-first"),
)


@dataclass(frozen=True, repr=False)
class AllocatorReplay:
    """One heuristic's run of an event sequence: peaks, fragmentation, and a row per event."""

    heuristic: str
    events: int  # events replayed (up to and including an out-of-memory allocation)
    live_peak_bytes: int  # most rounded request bytes live at once
    allocated_peak_bytes: int  # torch.cuda.max_memory_allocated
    reserved_peak_bytes: int  # torch.cuda.max_memory_reserved
    reserved_end_bytes: int  # memory_reserved after the last event
    segments: int  # most segments held at once (an arena is one)
    inactive_split_peak_bytes: int  # most bytes in free pieces of split segments (arena: holes below live blocks)
    fragmentation: float  # 1 - live_peak / reserved_peak
    fragmentation_at_reserved_peak: float  # 1 - allocated / reserved when reserved first reaches its peak
    released_segments: int  # cached segments released to retry a failed cudaMalloc
    capacity_bytes: int | None  # what the allocator could get from the device (None: unlimited)
    oom_event: int | None  # index of the allocation that did not fit the capacity
    frame: pd.DataFrame = field(compare=False)  # CURVE_COLUMNS, one row per replayed event

    def __repr__(self) -> str:
        oom = f", out of memory at event {self.oom_event}" if self.oom_event is not None else ""
        return (f"AllocatorReplay({self.heuristic}, reserved peak {format_bytes(self.reserved_peak_bytes)}, "
                f"allocated peak {format_bytes(self.allocated_peak_bytes)}, "
                f"fragmentation {self.fragmentation:.1%}{oom})")

    @property
    def fits(self) -> bool:
        return self.oom_event is None

    def curve(self) -> pd.DataFrame:
        """One row per event: what was asked, where it went, and the counters after it."""
        return self.frame.copy()

    def summary(self) -> dict:
        """The scalar fields, for tables and JSON."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "frame"}


def heuristics() -> pd.DataFrame:
    """The heuristics ``compare`` runs, with what each does."""
    return pd.DataFrame([{"heuristic": h.name, "kind": h.kind, "description": h.description} for h in HEURISTICS])


def heuristic(name: str) -> Heuristic:
    for candidate in HEURISTICS:
        if candidate.name == name:
            return candidate
    raise ValueError(f"unknown allocation heuristic {name!r}; the heuristics are: "
                     f"{', '.join(h.name for h in HEURISTICS)}")


def replay(events: Sequence[AllocEvent], heuristic_name: str | Heuristic = "best-fit", *,
           capacity_bytes: int | None = None, allocator: CachingAllocatorModel | None = None) -> AllocatorReplay:
    """Run ``events`` through one heuristic (see ``heuristics()``).

    ``capacity_bytes``: memory the allocator can get from the device; the replay stops at
    the first allocation that does not fit (``oom_event``). ``allocator``: a caching
    allocator model to continue from (e.g. ``model_from_snapshot``), for 'caching'
    heuristics only; it is changed in place.
    """
    chosen = heuristic_name if isinstance(heuristic_name, Heuristic) else heuristic(heuristic_name)
    if chosen.kind == "arena":
        if allocator is not None:
            raise ValueError(f"{chosen.name!r} lays out a fresh arena; an allocator to continue from only works "
                             "with the caching heuristics (best-fit, first-fit, ...)")
        return _replay_arena(list(events), chosen, capacity_bytes)
    if allocator is None:
        allocator = CachingAllocatorModel(chosen.fit, capacity_bytes)
    elif capacity_bytes is not None and allocator.capacity_bytes != capacity_bytes:
        raise ValueError("pass capacity_bytes to the allocator you continue from, not to replay")
    if chosen.preallocate:
        events = preallocate_long_lived(events)
    return _replay_caching(list(events), chosen, allocator)


def _replay_caching(events: list[AllocEvent], chosen: Heuristic, model: CachingAllocatorModel) -> AllocatorReplay:
    initial = (model.live_bytes, model.allocated_bytes, model.reserved_bytes, model.inactive_split_bytes,
               len(model.segments))
    rows, oom, released = [], None, 0
    for index, event in enumerate(events):
        block_bytes, address, new_segment = 0, -1, 0
        if event.action == "alloc":
            arena = "long-lived" if chosen.lifetime_pools and event.lifetime != "temporary" else "default"
            try:
                placed = model.malloc(event.block, event.nbytes, arena)
            except AllocatorOutOfMemory:
                oom = index
                break
            if placed is not None:
                block_bytes, address, new_segment = placed.block_bytes, placed.address, placed.new_segment_bytes
                released += placed.released_segments
        else:
            block_bytes = model.free(event.block)
        rows.append((index, event.action, event.block, event.op, event.lifetime, event.nbytes, block_bytes, address,
                     new_segment, model.live_bytes, model.allocated_bytes, model.reserved_bytes,
                     model.inactive_split_bytes, len(model.segments)))
    frame = pd.DataFrame(rows, columns=CURVE_COLUMNS)
    return _result(chosen.name, frame, initial, released, model.capacity_bytes, oom)


def _replay_arena(events: list[AllocEvent], chosen: Heuristic, capacity_bytes: int | None) -> AllocatorReplay:
    layout = lay_out(events, chosen.arena_order)
    reserved = -(-layout.high_water_bytes // LARGE_ROUNDING_BYTES) * LARGE_ROUNDING_BYTES
    next_life = {block: iter(offsets) for block, offsets in layout.offsets.items()}
    frame = pd.DataFrame({
        "index": np.arange(len(events)), "action": [e.action for e in events], "block": [e.block for e in events],
        "op": [e.op for e in events], "lifetime": [e.lifetime for e in events],
        "nbytes": [e.nbytes for e in events], "block_bytes": [round_request(e.nbytes) for e in events],
        "address": [next(next_life[e.block]) if e.action == "alloc" else -1 for e in events],
        "new_segment_bytes": np.diff(reserved, prepend=0), "live_bytes": layout.live_bytes,
        "allocated_bytes": layout.live_bytes, "reserved_bytes": reserved,
        "inactive_split_bytes": layout.hole_bytes, "segments": (reserved > 0).astype(np.int64),
    }, columns=CURVE_COLUMNS)
    over = np.flatnonzero(reserved > capacity_bytes) if capacity_bytes is not None else np.array([], dtype=int)
    oom = int(over[0]) if len(over) else None
    if oom is not None:
        frame = frame.iloc[:oom].copy()
    return _result(chosen.name, frame, (0, 0, 0, 0, 0), 0, capacity_bytes, oom)


def _result(name: str, frame: pd.DataFrame, initial: tuple[int, ...], released: int, capacity: int | None,
            oom: int | None) -> AllocatorReplay:
    live0, allocated0, reserved0, inactive0, segments0 = initial

    def peak(column: str, start: int) -> int:
        return int(max(start, frame[column].max() if len(frame) else start))

    live, reserved = peak("live_bytes", live0), peak("reserved_bytes", reserved0)
    at_peak = frame.reserved_bytes.idxmax() if len(frame) and frame.reserved_bytes.max() > reserved0 else None
    allocated_then = allocated0 if at_peak is None else int(frame.allocated_bytes[at_peak])
    return AllocatorReplay(
        heuristic=name, events=len(frame) + (oom is not None), live_peak_bytes=live,
        allocated_peak_bytes=peak("allocated_bytes", allocated0), reserved_peak_bytes=reserved,
        reserved_end_bytes=int(frame["reserved_bytes"].iloc[-1]) if len(frame) else reserved0,
        segments=peak("segments", segments0), inactive_split_peak_bytes=peak("inactive_split_bytes", inactive0),
        fragmentation=1.0 - live / reserved if reserved else 0.0,
        fragmentation_at_reserved_peak=1.0 - allocated_then / reserved if reserved else 0.0, released_segments=released,
        capacity_bytes=capacity, oom_event=oom, frame=frame,
    )


def preallocate_long_lived(events: Iterable[AllocEvent]) -> tuple[AllocEvent, ...]:
    """The same events with each step's long-lived allocations moved to the step's start.

    A step starts where events of ops (op >= 0) follow events before the step (op -1).
    Long-lived: lifetime other than 'temporary'. Frees stay where they are.
    """
    result: list[AllocEvent] = []
    step: list[AllocEvent] = []
    for event in events:
        if event.op < 0 and step:
            result += _long_lived_first(step)
            step = []
        (step if event.op >= 0 else result).append(event)
    return tuple(result + _long_lived_first(step))


def _long_lived_first(step: list[AllocEvent]) -> list[AllocEvent]:
    early = [e.action == "alloc" and e.lifetime != "temporary" for e in step]
    return [e for e, move in zip(step, early) if move] + [e for e, move in zip(step, early) if not move]


def compare(graph, plan=None, hardware=None, *, simulation=None, names: Iterable[str] | None = None,
            capacity_bytes: int | None = None, steps: int = 1) -> pd.DataFrame:
    """Reserved peak and fragmentation of one step under each heuristic, one row each.

    Without a plan (or with one that moves nothing) the events are the eager step's
    (``events_from_graph``, ``steps`` times over); with one, the step as ``simulation``
    (default: ``ul.simulate(graph, plan, hardware=hardware)``) runs it. ``names``: the
    heuristics to run (default all, see ``heuristics()``).
    """
    events = _events(graph, plan, hardware, simulation, steps)
    rows = []
    for name in names if names is not None else [h.name for h in HEURISTICS]:
        result = replay(events, name, capacity_bytes=capacity_bytes)
        rows.append({"heuristic": name, "kind": heuristic(name).kind, **{
            k: v for k, v in result.summary().items() if k not in ("heuristic", "capacity_bytes")}})
    frame = pd.DataFrame(rows)
    frame.attrs.update(model=graph.model_name, policy=plan.policy if plan is not None else "keep-all",
                       steps=steps, descriptions={h.name: h.description for h in HEURISTICS})
    return frame


def _events(graph, plan, hardware, simulation, steps: int) -> tuple[AllocEvent, ...]:
    if plan is None or not (plan.offloads or plan.recomputes):
        return events_from_graph(graph, steps=steps)
    if steps != 1:
        raise ValueError("a plan's step is replayed once (steps=1); repeat the eager step with plan=None")
    if simulation is None:
        simulation = simulate(graph, plan, hardware=hardware)
    return events_from_simulation(graph, plan, simulation)


def model_from_snapshot(segments: Iterable[dict], fit: str = "best", capacity_bytes: int | None = None,
                        device: int | None = None) -> CachingAllocatorModel:
    """A caching allocator model holding the segments of ``torch.cuda.memory_snapshot()``.

    Blocks in use are named by address (``0x...``), as ``events_from_memory_trace`` names
    them; blocks waiting on another stream ('active_awaiting_free') count as in use.
    Segments of other memory pools (CUDA graphs, MemPools) are left out, and with
    ``device`` those of other devices.
    """
    model = CachingAllocatorModel(fit, capacity_bytes)
    for segment in sorted(segments, key=lambda s: s["address"]):
        other_device = device is not None and segment.get("device", device) != device
        if other_device or tuple(segment.get("segment_pool_id", (0, 0))) != (0, 0):
            continue
        blocks, cursor = [], segment["address"]
        for block in segment["blocks"]:
            in_use = block["state"] != "inactive"
            address = block.get("address", cursor)
            blocks.append((block["size"], address_name(address) if in_use else None,
                           block.get("requested_size", block["size"]) if in_use else 0))
            cursor = address + block["size"]
        model.add_segment(segment["address"], blocks, segment["segment_type"])
    return model
