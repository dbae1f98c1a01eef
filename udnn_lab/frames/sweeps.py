"""Sweeps -> tidy frames: budget x policy (with the Pareto front), copy bandwidth, many simulations side by side."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import pandas as pd

from udnn_lab.graph.step_graph import Graph
from udnn_lab.hardware.profiles import Hardware
from udnn_lab.simulation.simulator import Simulation
from udnn_lab.vocabulary import DIRECTIONS

MODEL_SIZES = tuple(4096 << i for i in range(19))  # 4 KiB .. 1 GiB, as Hardware.measure sweeps a GPU
_LINK_OF = {"h2d": "h2d", "d2h": "d2h", "memcpy": "h2d"}  # the profile figure each copy follows (CPU: memcpy)


def budget_sweep(sweep: pd.DataFrame, graph: Graph | None = None) -> pd.DataFrame:
    """``ul.sweep``'s frame plus ``pareto`` (no other fitting row has both a smaller budget and a shorter step)
    and ``slowdown`` (step time over the fastest fitting step of the sweep).

    With ``graph``: ``kept_bytes``, the bytes saved for backward that stay on the device
    (what the policy "pins"), i.e. the graph's saved activations less the bytes offloaded.
    """
    missing = [c for c in ("budget_bytes", "policy", "fits", "step_time_s") if c not in sweep]
    if missing:
        raise ValueError(f"expected the frame of ul.sweep(graph, budgets, policies); missing columns {missing}")
    frame = sweep.copy()
    frame["pareto"] = False
    fitting = frame[frame["fits"].astype(bool)].sort_values(["budget_bytes", "step_time_s"], kind="stable")
    best = np.inf
    for label, row in fitting.iterrows():
        if row["step_time_s"] < best:
            frame.loc[label, "pareto"] = True
            best = row["step_time_s"]
    fastest = fitting["step_time_s"].min() if len(fitting) else np.nan
    frame["slowdown"] = frame["step_time_s"] / fastest
    if graph is not None:
        if "d2h_bytes" not in frame:
            raise ValueError("kept_bytes needs the sweep's d2h_bytes column")
        saved = sum(t.nbytes for t in graph.tensors
                    if t.saved and graph.on_device(t) and t.category not in ("parameter", "buffer"))
        frame["saved_bytes"] = saved
        frame["kept_bytes"] = (saved - frame["d2h_bytes"]).clip(lower=0)
    return frame


def bandwidth(sweep: pd.DataFrame | None = None,
              hardware: Hardware | Iterable[Hardware] | None = None) -> pd.DataFrame:
    """Copy bandwidth against copy size: Hardware.measure_with_sweep's sweep and/or the model of hardware profiles.

    Columns: source ('measured' or the profile's name), direction, memory ('pinned' or
    'pageable'), series ('h2d pinned', ...), nbytes, seconds, bytes_per_s. A profile's rows
    follow ``latency + bytes / bandwidth`` at the sweep's sizes (4 KiB..1 GiB without one).
    """
    parts = []
    if sweep is not None and len(sweep):
        missing = [c for c in ("direction", "pinned", "nbytes", "seconds") if c not in sweep]
        if missing:
            raise ValueError(f"expected the sweep frame of ul.Hardware.measure_with_sweep(); missing columns {missing}")
        measured = sweep[["direction", "pinned", "nbytes", "seconds"]].assign(source="measured")
        parts.append(measured)
    profiles = [hardware] if isinstance(hardware, Hardware) else list(hardware or [])
    for hw in profiles:
        parts.append(_modelled(hw, sweep))
    if not parts:
        raise ValueError("give a measured sweep (ul.Hardware.measure_with_sweep()[1]) or hardware profiles to model")
    frame = pd.concat(parts, ignore_index=True)
    frame["pinned"] = frame["pinned"].astype(bool)
    frame["memory"] = np.where(frame["pinned"], "pinned", "pageable")
    frame["series"] = frame["direction"] + " " + frame["memory"]
    frame["bytes_per_s"] = frame["nbytes"] / frame["seconds"].clip(lower=1e-12)
    return frame[["source", "direction", "memory", "series", "nbytes", "seconds", "bytes_per_s"]]


def _modelled(hw: Hardware, sweep: pd.DataFrame | None) -> pd.DataFrame:
    """The profile's copy time at the sweep's sizes: memcpy for a CPU, each link and memory kind for a GPU."""
    sizes = sorted(set(sweep["nbytes"])) if sweep is not None and len(sweep) else list(MODEL_SIZES)
    links = [("memcpy", False)] if hw.device_type == "cpu" else [(d, p) for d in DIRECTIONS for p in (True, False)]
    cases = pd.DataFrame([(d, p, int(n)) for d, p in links for n in sizes], columns=["direction", "pinned", "nbytes"])
    seconds = [hw.transfer_time_s(n, _LINK_OF[d], p) for d, p, n in cases.itertuples(index=False)]
    return cases.assign(seconds=seconds, source=hw.name)


def simulations(items: Mapping[str, Simulation] | Iterable[tuple[Mapping[str, object], Simulation]],
                label: str = "label") -> pd.DataFrame:
    """One row per simulation: the labels given, model, policy, budget_bytes, fits, step_time_s,
    compute_time_s, stall_time_s, peak_bytes, average_bytes (time-weighted), d2h_bytes, h2d_bytes.

    ``items``: ``{name: simulation}`` (the name goes in column ``label``), or pairs of
    (labels dict, simulation), e.g. ``({"hardware": "h100-sxm", "batch": 64}, sim)``.
    """
    pairs = [({label: key}, sim) for key, sim in items.items()] if isinstance(items, Mapping) else list(items)
    rows = []
    for labels, sim in pairs:
        if not isinstance(sim, Simulation):
            raise TypeError(f"expected Simulations (from ul.simulate), got {type(sim).__name__}")
        rows.append({**labels, "model": sim.model_name, "policy": sim.policy, "budget_bytes": sim.budget_bytes,
                     "fits": sim.fits, "step_time_s": sim.step_time_s, "compute_time_s": sim.compute_time_s,
                     "stall_time_s": sim.stall_time_s, "peak_bytes": sim.peak_bytes,
                     "average_bytes": average_bytes(sim), "d2h_bytes": sim.d2h_bytes, "h2d_bytes": sim.h2d_bytes})
    return pd.DataFrame(rows)


def average_bytes(sim: Simulation) -> float:
    """Live bytes averaged over the step's time (each op's bytes held from the previous op's end to its own)."""
    curve = sim.curve
    if not len(curve):
        return 0.0
    counted = curve["cuda_live_bytes"] if sim.device == "cuda" else curve["live_bytes"]
    held = np.diff(curve["end_s"].to_numpy(), prepend=0.0)
    total = held.sum()
    return float((counted.to_numpy() * held).sum() / total) if total > 0 else float(counted.mean())


def savings(frame: pd.DataFrame, baseline: str = "keep-all", by: str | list[str] = "model") -> pd.DataFrame:
    """Add peak_saved, average_saved (fractions of the baseline's bytes) and time_paid (step time over the
    baseline's, less 1) to a ``simulations`` frame, against the row of policy ``baseline`` in each ``by`` group."""
    keys = [by] if isinstance(by, str) else list(by)
    base = frame[frame["policy"] == baseline]
    if base.empty:
        raise ValueError(f"no row of policy {baseline!r} to compare against: simulate the baseline too "
                         f"(policies here: {sorted(set(frame['policy']))})")
    base = base.drop_duplicates(keys)[keys + ["peak_bytes", "average_bytes", "step_time_s"]]
    merged = frame.merge(base, on=keys, how="left", suffixes=("", "_baseline"))
    merged["peak_saved"] = 1 - merged["peak_bytes"] / merged["peak_bytes_baseline"]
    merged["average_saved"] = 1 - merged["average_bytes"] / merged["average_bytes_baseline"]
    merged["time_paid"] = merged["step_time_s"] / merged["step_time_s_baseline"] - 1
    return merged.drop(columns=["peak_bytes_baseline", "average_bytes_baseline", "step_time_s_baseline"])
