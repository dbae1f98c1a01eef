"""What was alive at a GPU step's peak, by where it was allocated: from the GPU corpus's allocator histories.

Reads the gzip'd ``torch.cuda.memory._snapshot()`` pickles that ``benchmarks/gpu_corpus.py`` saves for a run
over budget or off its simulated peak (from a directory, or a ``.tgz`` of one), replays each history's
allocations and frees, finds the peak of allocated bytes, and prints the blocks alive there grouped by
the innermost frame of model or library code that allocated them (the copy made before the step, and
blocks a C++ library allocated, are named as such), largest first, then the largest allocations freed at
once (a kernel's workspace); with the step's own
records (``gpu_corpus*.jsonl`` beside them) it prints the simulated peak and the difference to explain.
Works on any machine: it reads files, nothing runs on a GPU.

    python benchmarks/gpu_diagnose.py data/benchmarks/gpu/<run>/diagnostics-1.tgz [--top 12] [--match vgg16]
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import pickle
import tarfile
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

MIB = 2**20
# frames of these files say how memory was reached, not which part of the model asked for it
PLUMBING = ("/copy.py", "/torch/nn/modules/module.py", "/torch/autograd/", "/torch/utils/_contextlib.py",
            "/torch/_tensor.py", "/torch/utils/hooks.py", "gpu_corpus.py", "/torch/optim/optimizer.py",
            "/torch/amp/", "/torch/overrides.py", "/torch/utils/_python_dispatch.py", "/torch/_ops.py",
            "udnn_lab/runtime/offload.py", "/torch/_dynamo/", "/torch/_compile.py")


@dataclass(frozen=True)
class Block:
    size: int
    where: str  # the innermost frame that is not plumbing, as 'file:line function'
    order: int  # its place among the history's allocations


def snapshots(source: Path) -> Iterator[tuple[str, dict]]:
    """(name, snapshot) for each ``*-snapshot.pickle.gz`` in a directory or a .tgz."""
    if source.is_dir():
        for path in sorted(source.rglob("*-snapshot.pickle.gz")):
            with gzip.open(path, "rb") as file:
                yield path.name, pickle.load(file)
        return
    with tarfile.open(source) as archive:
        for member in sorted(archive.getmembers(), key=lambda m: m.name):
            if member.name.endswith("-snapshot.pickle.gz"):
                data = archive.extractfile(member).read()
                yield Path(member.name).name, pickle.load(gzip.open(io.BytesIO(data)))


def where(frames: list[dict]) -> str:
    if any(frame.get("filename", "").endswith("/copy.py") for frame in frames):
        return "(the copy of the model and optimizer made before the step)"
    for frame in frames:
        name = frame.get("filename", "")
        if not any(part in name for part in PLUMBING):
            short = "/".join(name.split("/")[-2:])
            return f"{short}:{frame.get('line')} {frame.get('name')}"
    return "(no Python frame: allocated by a C++ library or before the history began)"


def live_at_peak(snapshot: dict) -> tuple[int, list[Block], int]:
    """(peak bytes above the history's start, the blocks alive then, allocations before the step's first op)."""
    live: dict[int, Block] = {}
    current = peak = 0
    at_peak: list[Block] = []
    order = 0
    for event in snapshot["device_traces"][0] if snapshot["device_traces"] else []:
        if event["action"] == "alloc":
            order += 1
            live[event["addr"]] = Block(event["size"], where(event.get("frames", [])), order)
            current += event["size"]
            if current > peak:
                peak, at_peak = current, list(live.values())  # the last one is the allocation that made the peak
        elif event["action"] == "free_completed" and event["addr"] in live:
            current -= live.pop(event["addr"]).size
    return peak, at_peak, order


def transients(snapshot: dict, top: int) -> list[tuple[int, str]]:
    """The largest allocations freed before anything else was allocated (a kernel's workspace), with where."""
    events = snapshot["device_traces"][0] if snapshot["device_traces"] else []
    found = []
    for position, event in enumerate(events):
        if event["action"] != "alloc":
            continue
        for later in events[position + 1:position + 6]:
            if later["action"] == "alloc":
                break
            if later["action"] == "free_requested" and later["addr"] == event["addr"]:
                found.append((event["size"], where(event.get("frames", []))))
                break
    return sorted(found, key=lambda item: -item[0])[:top]


def table(blocks: list[Block], top: int) -> list[tuple[str, int, int]]:
    grouped: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for block in blocks:
        grouped[block.where][0] += block.size
        grouped[block.where][1] += 1
    rows = sorted(((place, total, count) for place, (total, count) in grouped.items()), key=lambda r: -r[1])
    return rows[:top]


def _records(source: Path) -> dict[tuple[str, str, str], dict]:
    folder = source if source.is_dir() else source.parent
    found = {}
    for path in folder.glob("gpu_corpus*.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if row.get("policy"):
                found[(row["model"], row["policy"], str(row.get("budget_kind")))] = row
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="a directory of snapshots or a .tgz of one")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--match", default="", help="only snapshots whose name holds this")
    args = parser.parse_args()
    records = _records(args.source)
    for name, snapshot in snapshots(args.source):
        if args.match not in name:
            continue
        peak, blocks, _ = live_at_peak(snapshot)
        copied = sum(b.size for b in blocks if b.where.startswith("(the copy"))
        print(f"\n{name}: {peak / MIB:,.1f} MiB allocated at the peak of the history, {copied / MIB:,.1f} MiB of "
              f"it the copy made before the step, so {(peak - copied) / MIB:,.1f} MiB by the step")
        for (row_model, policy, kind), row in records.items():
            if name.startswith(f"{row_model}-{policy}-{kind}-snapshot"):
                print(f"  simulated peak {row['simulated_peak_bytes'] / MIB:,.1f} MiB, measured (first step) "
                      f"{row['measured_peaks'][0] / MIB:,.1f} MiB, budget "
                      f"{(row.get('budget_bytes') or 0) / MIB:,.1f} MiB")
        if blocks:
            last = max(blocks, key=lambda block: block.order)
            print(f"  the peak came with an allocation of {last.size / MIB:,.1f} MiB at {last.where}")
        for place, total, count in table(blocks, args.top):
            print(f"  {total / MIB:10,.1f} MiB  {count:5d} blocks  {place}")
        largest = transients(snapshot, 5)
        if largest:
            print("  largest allocations freed at once (workspaces): "
                  + ", ".join(f"{size / MIB:,.1f} MiB {place}" for size, place in largest))


if __name__ == "__main__":
    main()
