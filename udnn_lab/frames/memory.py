"""Graphs, measurements and simulations -> tidy DataFrames for charts (one row per observation).

Bytes stay bytes and seconds stay seconds here; charts convert for display.

Big models have thousands of ops (DenseNet-201: ~5,500; ResNet-1001: ~8,700) and altair
refuses more than 5,000 rows per dataset. Curves are therefore downsampled on purpose:
``points`` buckets of consecutive ops, each bucket keeping the op where the bytes peak, so
the step's peak is always kept. Timelines coalesce consecutive events of a lane
(see streams.py).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from udnn_lab.cost.profiling import Profile
from udnn_lab.frames.runs import TRAINING_COLUMNS, training
from udnn_lab.frames.streams import LANES, STALL_KINDS, TIMELINE_FRAME_COLUMNS, timeline
from udnn_lab.frames.sweeps import bandwidth, budget_sweep, savings, simulations
from udnn_lab.graph.step_graph import Graph
from udnn_lab.measurement.measuring import Measurement
from udnn_lab.simulation.simulator import Simulation
from udnn_lab.vocabulary import CATEGORIES

__all__ = [
    "DEFAULT_POINTS", "LANES", "STALL_KINDS", "TIMELINE_FRAME_COLUMNS", "bandwidth", "budget_sweep", "downsample",
    "layers", "memory_by_category", "memory_curve", "predicted_vs_measured", "savings", "simulations", "timeline",
    "TRAINING_COLUMNS", "training",
]

DEFAULT_POINTS = 400  # x 8 categories + 2 totals stays under altair's 5,000 rows
_KEYS = ["index", "phase", "module", "op"]


def downsample(curve: pd.DataFrame, points: int | None = DEFAULT_POINTS, value: str = "live_bytes") -> pd.DataFrame:
    """At most about ``points`` rows of a per-op curve: per bucket of consecutive ops, the row where ``value`` peaks.

    Buckets never straddle a change of phase, so forward/backward boundaries survive (the
    result may hold a few rows more than ``points``, one per phase change). The global
    peak is always kept. ``points=None`` keeps every row.
    """
    frame = curve.reset_index(drop=True)
    if points is None or len(frame) <= points:
        return frame
    if points < 1:
        raise ValueError(f"points must be a positive number of rows (or None for all), got {points}")
    bucket = np.arange(len(frame)) * points // len(frame)
    run = (frame["phase"] != frame["phase"].shift()).cumsum().to_numpy() if "phase" in frame else np.zeros(len(frame))
    keep = frame.groupby([run, bucket], sort=False)[value].idxmax().to_numpy()
    return frame.loc[np.sort(keep)].reset_index(drop=True)


def memory_curve(graph: Graph, simulation: Simulation | None = None, measurement: Measurement | None = None,
                 measured_graph: Graph | Simulation | None = None,
                 points: int | None = DEFAULT_POINTS) -> pd.DataFrame:
    """Live bytes over the step, tidy: columns index, phase, module, op, series, line, category, bytes, start_s,
    end_s.

    ``series='predicted'``: the graph's curve, or ``simulation``'s (under its plan), one row
    per category present plus ``category='total'`` (bytes as the budget counts them: 512-byte
    blocks on CUDA). ``series='measured'``: ``measurement``'s total, compared against
    ``measured_graph`` (default ``graph``: the traced graph of the measured step, or the
    Simulation of the plan it ran under). ``line`` names each total for a legend: the
    series, the device and the plan's policy, e.g. ``'measured (cpu, vdnn++)'``. Times are
    NaN without a simulation.
    """
    curve = simulation.memory_curve() if simulation is not None else graph.memory_curve()
    counted = "cuda_live_bytes" if graph.device == "cuda" else "live_bytes"
    present = [c for c in CATEGORIES if curve[c].any()]
    sampled = downsample(curve, points, counted)
    if "start_s" not in sampled:
        sampled = sampled.assign(start_s=np.nan, end_s=np.nan)
    keys = _KEYS + ["start_s", "end_s"]
    stacked = sampled.melt(id_vars=keys, value_vars=present, var_name="category", value_name="bytes")
    total = sampled[keys].assign(category="total", bytes=sampled[counted])
    predicted = f"predicted ({graph.device}, {_policy(simulation)})"
    parts = [stacked.assign(series="predicted", line=predicted), total.assign(series="predicted", line=predicted)]
    if measurement is not None:
        against = measured_graph or graph
        compared = downsample(measurement.compare(against), points, "measured_bytes")
        measured = f"measured ({measurement.device}, {_policy(against)})"
        parts.append(compared[_KEYS].assign(start_s=np.nan, end_s=np.nan, category="total", series="measured",
                                            line=measured, bytes=compared["measured_bytes"]))
    frame = pd.concat(parts, ignore_index=True)
    frame["bytes"] = frame["bytes"].astype("int64")
    frame = frame[_KEYS + ["series", "line", "category", "bytes", "start_s", "end_s"]]
    frame.attrs.update(model=graph.model_name, device=graph.device, ops=len(curve),
                       peak_bytes=int(curve[counted].max()) if len(curve) else 0)
    return frame


def _policy(prediction: Graph | Simulation | None) -> str:
    """The plan a prediction is under: a Graph alone keeps every tensor."""
    return prediction.policy if isinstance(prediction, Simulation) else "keep-all"


def memory_by_category(graph: Graph, points: int | None = DEFAULT_POINTS) -> pd.DataFrame:
    """Predicted live bytes per op and category: columns index, phase, module, op, category, bytes."""
    curve = graph.memory_curve()
    present = [c for c in CATEGORIES if curve[c].any()]
    sampled = downsample(curve, points, "live_bytes")
    return sampled.melt(id_vars=_KEYS, value_vars=present, var_name="category", value_name="bytes")


def predicted_vs_measured(graph: Graph, measurement: Measurement, points: int | None = DEFAULT_POINTS) -> pd.DataFrame:
    """Predicted and measured live bytes per op: columns index, phase, module, op, series, bytes."""
    compared = measurement.compare(graph)
    compared = compared.assign(top=compared[["predicted_bytes", "measured_bytes"]].max(axis=1))
    frame = downsample(compared, points, "top").rename(columns={"predicted_bytes": "predicted",
                                                              "measured_bytes": "measured"})
    return frame.melt(id_vars=_KEYS, value_vars=["predicted", "measured"], var_name="series", value_name="bytes")


def layers(graph: Graph, simulation: Simulation | None = None, profile: Profile | None = None,
           top: int | None = None) -> pd.DataFrame:
    """One row per module that runs ops of its own (its children's are theirs), in execution order.

    Columns: module, type, order, depth, saved_bytes (saved for backward by its own ops),
    output_bytes, parameter_bytes (its own), forward_flops, backward_flops, flops, time_s
    (from ``profile`` if given, else the ``simulation``'s op times, else NaN),
    offloaded_bytes and recomputed_bytes (by the simulation's plan; 0 without one).
    ``top``: keep the ``top`` modules with most saved bytes (still in execution order).
    """
    table = graph.layers()
    table = table[(table["forward_ops"] + table["backward_ops"]) > 0].copy()
    own = _own_per_module(graph)
    for column in ("saved_bytes", "parameter_bytes", "forward_flops", "backward_flops"):
        table[column] = table["module"].map(own[column]).fillna(0).astype("int64")
    table["flops"] = table["forward_flops"] + table["backward_flops"]
    table["time_s"] = table["module"].map(_time_per_module(simulation, profile)).astype(float)
    moved = _moved_per_module(simulation)
    for column in ("offloaded_bytes", "recomputed_bytes"):
        table[column] = table["module"].map(moved[column]).fillna(0).astype("int64")
    if top is not None:
        table = table.nlargest(top, "saved_bytes").sort_values("order", kind="stable")
    columns = ["module", "type", "order", "depth", "saved_bytes", "output_bytes", "parameter_bytes", "forward_flops",
               "backward_flops", "flops", "time_s", "offloaded_bytes", "recomputed_bytes"]
    return table[columns].reset_index(drop=True)


def _own_per_module(graph: Graph) -> dict[str, dict[str, int]]:
    own: dict[str, dict[str, int]] = {k: {} for k in ("saved_bytes", "parameter_bytes", "forward_flops",
                                                      "backward_flops")}
    for t in graph.tensors:
        if t.saved and t.saved_by and t.category not in ("parameter", "buffer") and graph.on_device(t):
            module = graph.ops[t.saved_by[0]].module
            own["saved_bytes"][module] = own["saved_bytes"].get(module, 0) + t.nbytes
        if t.category == "parameter":
            module = t.name.rpartition(".")[0]
            own["parameter_bytes"][module] = own["parameter_bytes"].get(module, 0) + t.nbytes
    for op in graph.ops:
        if op.phase in ("forward", "backward"):
            key = f"{op.phase}_flops"
            own[key][op.module] = own[key].get(op.module, 0) + op.flops
    return own


def _time_per_module(simulation: Simulation | None, profile: Profile | None) -> pd.Series:
    if profile is not None:
        frame = profile.frame()
        return frame.groupby("module")["time_s"].sum()
    if simulation is not None:
        ops = simulation.timeline[simulation.timeline["kind"] == "op"]
        return (ops["end_s"] - ops["start_s"]).groupby(ops["module"]).sum()
    return pd.Series(dtype=float)


def _moved_per_module(simulation: Simulation | None) -> dict[str, pd.Series]:
    if simulation is None:
        return {"offloaded_bytes": pd.Series(dtype="int64"), "recomputed_bytes": pd.Series(dtype="int64")}
    events = simulation.timeline
    offloads = events[events["kind"] == "offload"]
    recomputes = events[events["kind"] == "recompute"]
    return {"offloaded_bytes": offloads.groupby("module")["nbytes"].sum(),
            "recomputed_bytes": recomputes.groupby("module")["nbytes"].sum()}
