"""A CUDA caching-allocator snapshot from any run, read safely: what was allocated at its peak, and from where.

``torch.cuda.memory._dump_snapshot`` (with ``_record_memory_history`` on) writes a pickle of plain
values: the segments, and per device the history of allocations and frees with their stack frames.
A pickle from elsewhere can run code when it is loaded, so this reads one with an unpickler that
admits only what such a file holds (dicts, lists, strings, numbers, booleans, None) and refuses
anything that names a class or function, in one line, before it runs. Gzip'd files are read too.
``Snapshot.peak`` replays the first device's history: the most bytes allocated at once, and the
blocks alive then, each with the innermost frame of the model's or a library's code that asked for it.
``Snapshot.replay`` counts what was held before the history began too (the segments say what is held at the
end): allocated and reserved bytes after each event, and the peak as the device held it.
"""

from __future__ import annotations

import gzip
import io
import pickle
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from udnn_lab.errors import SnapshotError

# frames of these files say how memory was reached, not which part of the model asked for it
PLUMBING = ("/copy.py", "/torch/nn/modules/module.py", "/torch/autograd/", "/torch/utils/_contextlib.py",
            "/torch/_tensor.py", "/torch/utils/hooks.py", "gpu_corpus.py", "/torch/optim/optimizer.py",
            "/torch/amp/", "/torch/overrides.py", "/torch/utils/_python_dispatch.py", "/torch/_ops.py",
            "udnn_lab/runtime/offload.py", "/torch/_dynamo/", "/torch/_compile.py")
NO_FRAME = "(no Python frame: allocated by a C++ library, or before the history began)"
HELD_BEFORE = "(held before the history began)"
SEGMENT_SIGNS = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
_FREES = ("free_requested", "free_completed")


@dataclass(frozen=True)
class Block:
    """One allocation alive at the peak."""

    size: int
    where: str  # the innermost frame that is not plumbing, as 'dir/file.py:line function'
    order: int  # its place among the history's allocations


@dataclass(frozen=True)
class Peak:
    """The most bytes the history held allocated at once, above where it began, and the blocks alive then."""

    allocated_bytes: int
    blocks: tuple[Block, ...]  # the last is the allocation that made the peak

    def by_place(self) -> pd.DataFrame:
        """Bytes and blocks alive at the peak per place in the code that allocated them, largest first."""
        grouped: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for block in self.blocks:
            grouped[block.where][0] += block.size
            grouped[block.where][1] += 1
        frame = pd.DataFrame([(place, total, count) for place, (total, count) in grouped.items()],
                             columns=["where", "bytes", "blocks"])
        return frame.sort_values("bytes", ascending=False, kind="stable").reset_index(drop=True)


@dataclass(frozen=True)
class Replay:
    """The first device's history replayed from what was held when it began, not from zero.

    Held at the start: blocks the history frees without having allocated them, and blocks the segments hold at
    the end that the history never allocated (parameters, optimizer state made before recording began). The
    reserved bytes count segments (the caching allocator's cudaMalloc'd memory); they are known only where the
    history records segment events, and are None otherwise (a CPU run's history has none).
    """

    actions: tuple[str, ...]  # each event's action, in order
    allocated_bytes: tuple[int, ...]  # allocated right after each event
    reserved_bytes: tuple[int, ...] | None  # reserved right after each event; None: not recorded
    start_bytes: int  # allocated before the first event
    peak: Peak  # the most allocated at once, counting what was held at the start, and the blocks alive then
    peak_event: int  # the event that made the peak; -1: the start itself


@dataclass(frozen=True)
class Snapshot:
    """A snapshot as ``torch.cuda.memory._snapshot()`` returns it: ``segments`` and ``device_traces``."""

    source: str
    segments: tuple[dict, ...]
    device_traces: tuple[tuple[dict, ...], ...]  # per device, its history's events in order

    @property
    def events(self) -> tuple[dict, ...]:
        """The first device's history (the one a single-GPU run has)."""
        return self.device_traces[0] if self.device_traces else ()

    def peak(self) -> Peak:
        """Replay the history's allocations and frees (``free_completed``) and keep the most held at once."""
        live: dict[int, Block] = {}
        current = most = order = 0
        at_most: list[Block] = []
        for event in self.events:
            if event.get("action") == "alloc":
                order += 1
                live[event["addr"]] = Block(int(event["size"]), place(event.get("frames") or []), order)
                current += int(event["size"])
                if current > most:
                    most, at_most = current, list(live.values())
            elif event.get("action") == "free_completed" and event.get("addr") in live:
                current -= live.pop(event["addr"]).size
        return Peak(most, tuple(at_most))

    def replay(self, counted: Callable[[int], int] = int) -> Replay:
        """Allocated (and reserved) bytes after each event, counting what was held before the history began.

        The history's sizes are the bytes asked for; ``counted`` says how many each request holds
        (``units.cuda_block_bytes``: the caching allocator's 512-byte blocks, as ``memory_allocated`` counts).
        """
        events = self.events
        held = self._held_at_start()
        live = {addr: Block(counted(size), where, 0) for addr, (size, where) in held.items()}
        current = most = start = sum(block.size for block in live.values())
        at_most, peak_event, allocated, order = list(live.values()), -1, [], 0
        for position, event in enumerate(events):
            if event.get("action") == "alloc":
                order += 1
                block = Block(counted(int(event["size"])), place(event.get("frames") or []), order)
                live[event["addr"]] = block
                current += block.size
                if current > most:
                    most, at_most, peak_event = current, list(live.values()), position
            elif event.get("action") == "free_completed" and event.get("addr") in live:
                current -= live.pop(event["addr"]).size
            allocated.append(current)
        return Replay(tuple(str(event.get("action")) for event in events), tuple(allocated), self._reserved(),
                      start, Peak(most, tuple(at_most)), peak_event)

    def _held_at_start(self) -> dict[int, tuple[int, str]]:
        """Address -> (bytes, where) of the blocks held before the first event."""
        held: dict[int, tuple[int, str]] = {}
        allocated: set[int] = set()
        for event in self.events:
            addr = int(event.get("addr", -1))
            if event.get("action") == "alloc":
                allocated.add(addr)
            elif event.get("action") in _FREES and addr not in allocated and addr not in held:
                held[addr] = (int(event.get("size", 0)), HELD_BEFORE)
        for segment in self.segments:
            for block in segment.get("blocks") or []:
                addr = block.get("address")
                if str(block.get("state", "")).startswith("active") and addr not in allocated and addr not in held:
                    size = int(block.get("requested_size", block.get("size", 0)))  # a request, as the history's
                    held[addr] = (size, place(block["frames"]) if block.get("frames") else HELD_BEFORE)
        return held

    def _reserved(self) -> tuple[int, ...] | None:
        """Reserved bytes after each event, back from the segments held at the end; None without segment events."""
        signs = [SEGMENT_SIGNS.get(str(event.get("action")), 0) * int(event.get("size", 0)) for event in self.events]
        if not any(signs):
            return None
        current = sum(int(segment.get("total_size", 0)) for segment in self.segments) - sum(signs)
        reserved = []
        for change in signs:
            current += change
            reserved.append(current)
        return tuple(reserved)

    def transients(self, top: int = 10) -> pd.DataFrame:
        """The largest allocations freed before anything else was allocated (a kernel's workspace), with where."""
        events = self.events
        found = []
        for position, event in enumerate(events):
            if event.get("action") != "alloc":
                continue
            for later in events[position + 1:position + 6]:
                if later.get("action") == "alloc":
                    break
                if later.get("action") == "free_requested" and later.get("addr") == event["addr"]:
                    found.append((int(event["size"]), place(event.get("frames") or [])))
                    break
        frame = pd.DataFrame(found, columns=["bytes", "where"])
        return frame.sort_values("bytes", ascending=False, kind="stable").head(top).reset_index(drop=True)


def load_snapshot(path: str | Path) -> Snapshot:
    """Read a ``torch.cuda.memory._dump_snapshot`` pickle (gzip'd or not) without running anything it names."""
    source = Path(path)
    try:
        raw = source.read_bytes()
    except FileNotFoundError:
        raise SnapshotError(f"no snapshot at {source}: write one with torch.cuda.memory._dump_snapshot(path) after "
                            "torch.cuda.memory._record_memory_history()") from None
    return snapshot_from_bytes(raw, str(source))


def snapshot_from_bytes(raw: bytes, source: str) -> Snapshot:
    """A snapshot from a file's bytes (gzip'd or not; ``source`` names it in errors), read as ``load_snapshot``."""
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    try:
        value = _PlainUnpickler(io.BytesIO(raw), source).load()
    except SnapshotError:
        raise
    except Exception as err:  # noqa: BLE001 - a truncated or foreign file: say what it is not
        raise SnapshotError(f"{source} is not a memory snapshot ({type(err).__name__}: {err})") from None
    if not isinstance(value, dict) or "segments" not in value:
        raise SnapshotError(f"{source} is not a memory snapshot: it holds no 'segments' (torch.cuda.memory._snapshot"
                            "() returns a dict with them)")
    traces = value.get("device_traces") or []
    return Snapshot(source, tuple(value["segments"]), tuple(tuple(device) for device in traces))


def place(frames: list[dict]) -> str:
    """The innermost frame of a block's stack that is not plumbing, in words."""
    if any(str(frame.get("filename", "")).endswith("/copy.py") for frame in frames):
        return "(a copy.deepcopy: the model and optimizer copied before the step)"
    for frame in frames:
        name = str(frame.get("filename", ""))
        if not any(part in name for part in PLUMBING):
            return f"{'/'.join(name.split('/')[-2:])}:{frame.get('line')} {frame.get('name')}"
    return NO_FRAME


class _PlainUnpickler(pickle.Unpickler):
    """Admits only the values pickle builds without naming a class (NOTE: find_class is how a pickle runs code)."""

    def __init__(self, file: io.BytesIO, source: str) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        raise SnapshotError(f"{self.source} asks to load {module}.{name}; a memory snapshot holds only plain values "
                            "(dicts, lists, strings, numbers), so it was refused unread: do not load it with "
                            "pickle either")

    def persistent_load(self, pid: Any) -> Any:
        raise SnapshotError(f"{self.source} refers to an outside object ({pid!r}); a memory snapshot holds only "
                            "plain values, so it was refused unread")
