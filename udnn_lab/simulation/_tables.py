"""A simulation's record -> its tables (timeline, memory curve), and the peak without building them.

Planners simulate a plan many times and read only its totals, so the simulator keeps what
happened as plain rows and these functions turn them into DataFrames when someone asks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from udnn_lab.graph.liveness import live_bytes, op_table
from udnn_lab.graph.step_graph import Graph
from udnn_lab.vocabulary import CATEGORIES

TIMELINE_COLUMNS = ["stream", "kind", "start_s", "end_s", "op", "name", "module", "tensor", "nbytes"]
Change = tuple[int, int, int]  # (first op it holds for, +1 back on / -1 off the device, tensor id)


@dataclass(frozen=True)
class StepRecord:
    """What one simulation did, as plain rows: enough to build its tables later."""

    graph: Graph
    rows: tuple[tuple, ...]  # TIMELINE_COLUMNS, in the order they happened
    spans: tuple[tuple[float, float], ...]  # per op: (start, end)
    changes: tuple[Change, ...]


def timeline_frame(record: StepRecord) -> pd.DataFrame:
    frame = pd.DataFrame(list(record.rows), columns=TIMELINE_COLUMNS)
    return frame.sort_values(["start_s", "stream"], kind="stable").reset_index(drop=True)


def compute_time_s(rows: Sequence[tuple]) -> float:
    """Seconds of ops and recomputations, summed as ``timeline_frame``'s rows would be (in its order, by numpy)."""
    work = sorted((row for row in rows if row[0] == "compute" and row[1] in ("op", "recompute")),
                  key=lambda row: row[2])
    return float(np.array([end - start for _, _, start, end, *_ in work], dtype=np.float64).sum())


def counted_peak_bytes(graph: Graph, changes: Sequence[Change], scratch: np.ndarray | None = None) -> int:
    """The most bytes the budget counts at any op (512-byte blocks on CUDA, exact on CPU), before the first op too;
    ``scratch``: bytes each op holds only while it runs (NOTE [simulated streams] 8)."""
    counted, base = counted_by_op(graph, changes, scratch)
    return int(max(base, counted.max() if len(counted) else 0))


def counted_by_op(graph: Graph, changes: Sequence[Change], scratch: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """(the bytes the budget counts while each op runs, those before the first op)."""
    live, table = live_bytes(graph), op_table(graph)
    cuda = graph.device == "cuda"
    size = table.block if cuda else table.exact
    delta = np.zeros(len(graph.ops) + 1, dtype=np.int64)
    for first, sign, tensor in changes:
        delta[first] += sign * size[tensor]
    counted = (live.cuda_total if cuda else live.total) + np.cumsum(delta[:len(graph.ops)])
    if scratch is not None:
        counted = counted + scratch
    return counted, int(live.baseline_cuda if cuda else live.baseline_bytes)


def curve_frame(record: StepRecord) -> pd.DataFrame:
    """The analyzer's curve with each action's changes from the op it takes effect at, and each op's times."""
    curve = record.graph.memory_curve()
    n = len(curve)
    per_category = np.zeros((n + 1, len(CATEGORIES)), dtype=np.int64)
    blocks = np.zeros(n + 1, dtype=np.int64)
    allocated = np.zeros(n + 1, dtype=np.int64)
    released = np.zeros(n + 1, dtype=np.int64)
    static = op_table(record.graph)
    for first, sign, tensor in record.changes:
        per_category[first, static.category[tensor]] += sign * static.exact[tensor]
        blocks[first] += sign * static.block[tensor]
        if sign > 0:
            allocated[first] += static.exact[tensor]
        elif first > 0:
            released[first - 1] += static.exact[tensor]  # gone before op ``first``: released after the one before
    per_category = np.cumsum(per_category[:n], axis=0)
    for j, category in enumerate(CATEGORIES):
        curve[category] = curve[category].to_numpy() + per_category[:, j]
    curve["live_bytes"] = curve[list(CATEGORIES)].sum(axis=1)
    curve["cuda_live_bytes"] = curve["cuda_live_bytes"].to_numpy() + np.cumsum(blocks[:n])
    curve["allocated_bytes"] = curve["allocated_bytes"].to_numpy() + allocated[:n]
    curve["released_bytes"] = curve["released_bytes"].to_numpy() + released[:n]
    curve["start_s"] = [start for start, _ in record.spans]
    curve["end_s"] = [end for _, end in record.spans]
    return curve
