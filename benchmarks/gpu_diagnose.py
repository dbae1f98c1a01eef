"""What was alive at a GPU step's peak, by where it was allocated: from the GPU corpus's allocator histories.

Reads the gzip'd ``torch.cuda.memory._snapshot()`` pickles that ``benchmarks/gpu_corpus.py`` saves for a run
over budget or off its simulated peak (from a directory, or a ``.tgz`` of one), replays each history's
allocations and frees (read safely: ``ul.load_snapshot``, measurement/snapshot.py), finds the peak of
allocated bytes, and prints the blocks alive there grouped by
the innermost frame of model or library code that allocated them (the copy made before the step, and
blocks a C++ library allocated, are named as such), largest first, then the largest allocations freed at
once (a kernel's workspace); with the step's own
records (``gpu_corpus*.jsonl`` beside them) it prints the simulated peak and the difference to explain.
Works on any machine: it reads files, nothing runs on a GPU.

    python benchmarks/gpu_diagnose.py data/benchmarks/gpu/<run>/diagnostics-1.tgz [--top 12] [--match vgg16]
"""

from __future__ import annotations

import argparse
import json
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from udnn_lab.measurement.snapshot import Snapshot, load_snapshot, snapshot_from_bytes  # noqa: E402

MIB = 2**20


def snapshots(source: Path) -> Iterator[tuple[str, Snapshot]]:
    """(name, snapshot) for each ``*-snapshot.pickle.gz`` in a directory or a .tgz, read safely (ul.load_snapshot)."""
    if source.is_dir():
        for path in sorted(source.rglob("*-snapshot.pickle.gz")):
            yield path.name, load_snapshot(path)
        return
    with tarfile.open(source) as archive:
        for member in sorted(archive.getmembers(), key=lambda m: m.name):
            if member.name.endswith("-snapshot.pickle.gz"):
                data = archive.extractfile(member).read()
                yield Path(member.name).name, snapshot_from_bytes(data, f"{source}:{member.name}")


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
        peak = snapshot.peak()
        blocks = peak.blocks
        copied = sum(b.size for b in blocks if b.where.startswith("(a copy"))
        print(f"\n{name}: {peak.allocated_bytes / MIB:,.1f} MiB allocated at the peak of the history, "
              f"{copied / MIB:,.1f} MiB of it the copy made before the step, so "
              f"{(peak.allocated_bytes - copied) / MIB:,.1f} MiB by the step")
        for (row_model, policy, kind), row in records.items():
            if name.startswith(f"{row_model}-{policy}-{kind}-snapshot"):
                print(f"  simulated peak {row['simulated_peak_bytes'] / MIB:,.1f} MiB, measured (first step) "
                      f"{row['measured_peaks'][0] / MIB:,.1f} MiB, budget "
                      f"{(row.get('budget_bytes') or 0) / MIB:,.1f} MiB")
        if blocks:
            last = max(blocks, key=lambda block: block.order)
            print(f"  the peak came with an allocation of {last.size / MIB:,.1f} MiB at {last.where}")
        for place, total, count in peak.by_place().head(args.top).itertuples(index=False):
            print(f"  {total / MIB:10,.1f} MiB  {count:5d} blocks  {place}")
        largest = snapshot.transients(5)
        if not largest.empty:
            print("  largest allocations freed at once (workspaces): "
                  + ", ".join(f"{size / MIB:,.1f} MiB {place}" for size, place in largest.itertuples(index=False)))

if __name__ == "__main__":
    main()
