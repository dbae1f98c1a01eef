"""A memory snapshot of a real run laid over the prediction of the same step: curves, peaks, and what differs.

The two sides share no clock: the prediction counts ops, the snapshot's history counts allocator events (with
host times, which run ahead of a GPU). What both have is allocations, made in the step's order, so both
curves are drawn against the fraction of the step's allocations made so far: an op sits where the allocations
up to and including its own have been made, an event where the history's allocations up to it have. Each side
keeps one point per allocation: the most it held from that allocation until the next (frees between ops, and
ops that allocate nothing, only lower it until then). Only the two ends are sure to line up; between them a
point drifts by as many allocations as one side has and the other not (a cuDNN workspace, a history that also
holds a copy of the model). Record exactly the step predicted.

At the peaks, the two sides name things differently (the prediction by category, module and op; the snapshot
by the code that asked), so no block is matched to a tensor by name. What they share is sizes: the
differences table puts the blocks and tensors of each size side by side, with what each side says they are,
and says 'unmatched' where a size is on one side only. Sizes are counted as the prediction counts them: on a
CUDA step, in the caching allocator's 512-byte blocks.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from udnn_lab.frames.drill import live_tensors
from udnn_lab.frames.memory import DEFAULT_POINTS, downsample
from udnn_lab.graph.step_graph import Graph
from udnn_lab.measurement.snapshot import Replay, Snapshot
from udnn_lab.simulation.simulator import Simulation
from udnn_lab.units import cuda_block_bytes

__all__ = ["DIFFERENCE_COLUMNS", "PEAK_PART_COLUMNS", "SNAPSHOT_TIMELINE_COLUMNS", "SnapshotOverlay",
           "snapshot_overlay"]

SNAPSHOT_TIMELINE_COLUMNS = ["step_fraction", "series", "line", "bytes", "index", "at"]
PEAK_PART_COLUMNS = ["side", "part", "bytes", "count"]
DIFFERENCE_COLUMNS = ["size_bytes", "predicted_count", "measured_count", "predicted_bytes", "measured_bytes",
                      "difference_bytes", "match", "predicted_as", "measured_at"]
_NAMED = 3  # what each side says a size is: its this many largest parts


@dataclass(frozen=True)
class SnapshotOverlay:
    """A snapshot and the prediction of the same step, compared (``snapshot_overlay`` makes one)."""

    source: str  # the snapshot's file
    model_name: str
    device: str  # the prediction's: sizes are counted as it counts them
    policy: str  # the plan the prediction is under ('keep-all': the graph alone)
    predicted_peak_bytes: int
    predicted_peak_op: int
    measured_peak_bytes: int  # counting what was held before the history began
    measured_peak_event: int  # -1: what was held before the first event was the most
    measured_start_bytes: int  # held before the history's first event
    measured_reserved_peak_bytes: int | None  # None: the history records no segments
    replay: Replay = field(repr=False, compare=False)
    predicted_curve: pd.DataFrame = field(repr=False, compare=False)  # index, phase, module, op, step_fraction, bytes
    predicted_at_peak: pd.DataFrame = field(repr=False, compare=False)  # frames.live_tensors at the predicted peak

    @property
    def difference_bytes(self) -> int:
        """Measured peak less predicted peak: more than 0 when the run held more than predicted."""
        return self.measured_peak_bytes - self.predicted_peak_bytes

    def timeline(self, points: int | None = DEFAULT_POINTS) -> pd.DataFrame:
        """Both curves on the step's allocations (SNAPSHOT_TIMELINE_COLUMNS), at most about ``points`` rows each.

        ``series``: 'predicted', 'measured' (allocated) or 'reserved' (the snapshot's segments, where recorded);
        ``line`` names it for a legend; ``index`` is the op or the history's event that held the most from one
        allocation to the next, ``at`` what it was.
        """
        predicted = downsample(_most_per_allocation(self.predicted_curve), points, "bytes")
        parts = [pd.DataFrame({"step_fraction": predicted["step_fraction"], "series": "predicted",
                               "line": f"predicted allocated ({self.device}, {self.policy})",
                               "bytes": predicted["bytes"], "index": predicted["index"],
                               "at": predicted["op"] + " in " + predicted["module"].replace("", "(model)")})]
        replay = self.replay
        fraction = _allocation_fraction(np.array([action == "alloc" for action in replay.actions]))
        events = pd.DataFrame({"step_fraction": fraction, "index": np.arange(len(fraction)),
                               "at": list(replay.actions)})
        curves = [("measured", "measured allocated (snapshot)", replay.allocated_bytes),
                  ("reserved", "measured reserved (snapshot)", replay.reserved_bytes)]
        for series, line, values in curves:
            if values is not None:
                held = _most_per_allocation(events.assign(bytes=np.array(values, dtype=np.int64)))
                sampled = downsample(held, points, "bytes")
                parts.append(sampled.assign(series=series, line=line))
        frame = pd.concat(parts, ignore_index=True)[SNAPSHOT_TIMELINE_COLUMNS]
        frame["bytes"] = frame["bytes"].astype("int64")
        frame.attrs.update(self._summary())
        return frame

    def peak_parts(self) -> pd.DataFrame:
        """The two peaks side by side (PEAK_PART_COLUMNS), each side's parts largest first: the prediction's by
        category, module and op, the snapshot's by the place in the code that allocated each block."""
        at_peak = self.predicted_at_peak.assign(part=_predicted_names(self.predicted_at_peak),
                                                size=self._predicted_sizes())
        predicted = at_peak.groupby("part", sort=False).agg(bytes=("size", "sum"), count=("size", "size"))
        measured = self.replay.peak.by_place().rename(columns={"where": "part", "blocks": "count"}).set_index("part")
        frame = pd.concat([predicted.reset_index().assign(side="predicted"),
                           measured.reset_index().assign(side="measured")], ignore_index=True)
        frame = frame.sort_values(["side", "bytes"], ascending=[False, False], kind="stable")
        frame = frame[PEAK_PART_COLUMNS].reset_index(drop=True)
        frame.attrs.update(self._summary())
        return frame

    def differences(self, top: int | None = None) -> pd.DataFrame:
        """What the measured peak held against the predicted peak, by size (DIFFERENCE_COLUMNS), the largest
        difference first; ``top``: only that many rows. Columns sum to the two peaks and their difference.

        ``match``: 'same count' (as many of that size on both sides), 'more measured' / 'fewer measured' (the
        size is on both sides, in other numbers), 'unmatched: measured only' / 'unmatched: predicted only'.
        ``predicted_as`` and ``measured_at``: what each side says that size is, its largest parts, with counts.
        """
        at_peak = self.predicted_at_peak
        predicted = _by_size(self._predicted_sizes(), _predicted_names(at_peak))
        blocks = self.replay.peak.blocks
        measured = _by_size(np.array([b.size for b in blocks], dtype=np.int64), [b.where for b in blocks])
        frame = predicted.merge(measured, how="outer", left_index=True, right_index=True,
                                suffixes=("_predicted", "_measured"))
        frame = frame.rename(columns={"count_predicted": "predicted_count", "count_measured": "measured_count",
                                      "bytes_predicted": "predicted_bytes", "bytes_measured": "measured_bytes",
                                      "names_predicted": "predicted_as", "names_measured": "measured_at"})
        for column in ("predicted_count", "measured_count", "predicted_bytes", "measured_bytes"):
            frame[column] = frame[column].fillna(0).astype("int64")
        frame[["predicted_as", "measured_at"]] = frame[["predicted_as", "measured_at"]].fillna("")
        frame["difference_bytes"] = frame["measured_bytes"] - frame["predicted_bytes"]
        frame["match"] = [_match(p, m) for p, m in zip(frame["predicted_count"], frame["measured_count"])]
        frame = frame.reset_index(names="size_bytes")
        order = np.lexsort((-frame["size_bytes"].to_numpy(), -frame["difference_bytes"].abs().to_numpy()))
        frame = frame.iloc[order][DIFFERENCE_COLUMNS].reset_index(drop=True)
        frame.attrs.update(self._summary())
        return frame if top is None else frame.head(top)

    def _predicted_sizes(self) -> np.ndarray:
        column = "cuda_nbytes" if self.device == "cuda" else "nbytes"
        return self.predicted_at_peak[column].to_numpy(dtype=np.int64)

    def _summary(self) -> dict:
        return {"source": self.source, "model": self.model_name, "device": self.device, "policy": self.policy,
                "predicted_peak_bytes": self.predicted_peak_bytes, "measured_peak_bytes": self.measured_peak_bytes,
                "measured_start_bytes": self.measured_start_bytes,
                "measured_reserved_peak_bytes": self.measured_reserved_peak_bytes}


def snapshot_overlay(snapshot: Snapshot, graph: Graph, simulation: Simulation | None = None) -> SnapshotOverlay:
    """``snapshot`` (``ul.load_snapshot``) over the prediction of the same step: ``graph``, or ``simulation``'s
    plan of it. The measured side counts what was held before the history began (Snapshot.replay)."""
    if simulation is not None and simulation.model_name != graph.model_name:
        raise ValueError(f"the simulation is of {simulation.model_name} and the graph of {graph.model_name}: give "
                         "the simulation of this graph's step")
    replay = snapshot.replay(cuda_block_bytes if graph.device == "cuda" else int)
    curve = simulation.memory_curve() if simulation is not None else graph.memory_curve()
    counted = curve["cuda_live_bytes" if graph.device == "cuda" else "live_bytes"].to_numpy(dtype=np.int64)
    peak_op = int(counted.argmax()) if len(counted) else 0
    predicted = curve[["index", "phase", "module", "op"]].assign(
        step_fraction=_allocation_fraction(_allocations_per_op(graph, simulation)), bytes=counted)
    at_peak = live_tensors(graph, peak_op, simulation) if len(counted) else pd.DataFrame()
    at_peak = at_peak[at_peak["on_device"]].reset_index(drop=True) if len(at_peak) else at_peak
    reserved = max(replay.reserved_bytes) if replay.reserved_bytes else None
    return SnapshotOverlay(snapshot.source, graph.model_name, graph.device,
                           simulation.policy if simulation is not None else "keep-all",
                           int(counted[peak_op]) if len(counted) else 0, peak_op, replay.peak.allocated_bytes,
                           replay.peak_event, replay.start_bytes, reserved, replay, predicted, at_peak)


def _allocations_per_op(graph: Graph, simulation: Simulation | None) -> np.ndarray:
    """How many device allocations each op makes: the tensors it produces, and under a plan those it brings back."""
    made = np.zeros(len(graph.ops), dtype=np.int64)
    for t in graph.tensors:
        if t.alloc_step >= 0 and graph.on_device(t) and t.nbytes > 0:
            made[t.alloc_step] += 1
    for first, sign, _ in simulation.device_changes if simulation is not None else ():
        if sign > 0 and 0 <= first < len(made):
            made[first] += 1
    return made


def _allocation_fraction(made: np.ndarray) -> np.ndarray:
    """Per point, the share of all allocations made up to and including it (by position when there are none)."""
    total = int(made.sum())
    if total == 0:
        return np.arange(1, len(made) + 1) / max(len(made), 1)
    return np.cumsum(made) / total


def _most_per_allocation(curve: pd.DataFrame) -> pd.DataFrame:
    """One row per allocation (rows that share a step_fraction): the one that held the most."""
    if curve.empty:
        return curve
    return curve.loc[curve.groupby("step_fraction", sort=False)["bytes"].idxmax()].reset_index(drop=True)


def _predicted_names(at_peak: pd.DataFrame) -> list[str]:
    if at_peak.empty:
        return []
    modules = at_peak["module"].replace("", "(model)")
    return [f"{category} (held before the step)" if producer < 0 else f"{category} · {module} · {op}"
            for category, module, op, producer in
            zip(at_peak["category"], modules, at_peak["producer_op"], at_peak["producer"])]


def _by_size(sizes: np.ndarray, names: list[str]) -> pd.DataFrame:
    """Per size: how many, their bytes, and the largest parts of that size by name (with counts)."""
    rows = {}
    for size in np.unique(sizes):
        chosen = sizes == size
        named = Counter(name for name, keep in zip(names, chosen) if keep)
        rows[int(size)] = {"count": int(chosen.sum()), "bytes": int(sizes[chosen].sum()),
                           "names": "; ".join(f"{name} ×{count}" for name, count in named.most_common(_NAMED))
                           + ("; …" if len(named) > _NAMED else "")}
    return pd.DataFrame.from_dict(rows, orient="index", columns=["count", "bytes", "names"])


def _match(predicted: int, measured: int) -> str:
    if predicted == measured:
        return "same count"
    if predicted == 0:
        return "unmatched: measured only"
    if measured == 0:
        return "unmatched: predicted only"
    return "more measured" if measured > predicted else "fewer measured"
