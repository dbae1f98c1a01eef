"""Stream timelines -> one tidy frame for the Gantt chart, from a Simulation or from measured events.

A measured training run feeds the same frame: give ``timeline`` a DataFrame of events
with at least ``stream`` ('compute', 'd2h', 'h2d'), ``kind``, ``start_s`` and ``end_s``
(seconds from the step's start), and optionally ``op``, ``name``, ``module``, ``tensor``
and ``nbytes`` (the columns of Simulation.timeline), with ``source='measured'``.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from udnn_lab.simulation.simulator import Simulation
from udnn_lab.vocabulary import STALLS, STREAMS

LANES = STREAMS
STALL_KINDS = STALLS
TIMELINE_FRAME_COLUMNS = ["source", "lane", "kind", "stall", "start_s", "end_s", "op", "last_op", "count", "name",
                          "module", "tensor", "nbytes"]
DEFAULT_MAX_ROWS = 3000
_REQUIRED = ("stream", "kind", "start_s", "end_s")
_OPTIONAL = {"op": -1, "name": "", "module": "", "tensor": "", "nbytes": 0}


def timeline(events: Simulation | pd.DataFrame, source: str | None = None,
             max_rows: int | None = DEFAULT_MAX_ROWS) -> pd.DataFrame:
    """One row per event (or run of events) on the compute, device-to-host and host-to-device lanes.

    Columns TIMELINE_FRAME_COLUMNS: ``source`` ('simulated' for a Simulation, else
    ``source`` or 'measured'), ``lane``, ``kind`` (op, offload, prefetch, recompute,
    stall_*...), ``stall`` (True for compute waiting), times in seconds, the first and last
    op of the row, ``count`` (events merged into the row), names and bytes moved. When there
    are more than ``max_rows`` events, consecutive events of one lane and kind are merged
    (stalls, offloads and prefetches are never merged with each other or with ops).
    """
    if isinstance(events, Simulation):
        frame, source = events.timeline, source or "simulated"
    elif isinstance(events, pd.DataFrame):
        frame, source = events, source or "measured"
    else:
        raise TypeError(f"timeline takes a Simulation or a DataFrame of stream events, got {type(events).__name__}")
    frame = _normalized(frame)
    frame = frame.assign(source=source, lane=frame["stream"], stall=frame["kind"].isin(STALL_KINDS),
                         last_op=frame["op"], count=1)
    frame = frame.sort_values(["lane", "start_s"], kind="stable").reset_index(drop=True)
    if max_rows is not None and len(frame) > max_rows:
        frame = coalesce(frame, max_rows)
    frame = frame.sort_values(["start_s", "lane"], kind="stable").reset_index(drop=True)
    return frame[TIMELINE_FRAME_COLUMNS]


def _normalized(frame: pd.DataFrame) -> pd.DataFrame:
    missing = [c for c in _REQUIRED if c not in frame]
    if missing:
        raise ValueError(f"stream events need the columns {list(_REQUIRED)}; missing {missing}. Give one row per "
                         "op or copy: stream ('compute', 'd2h', 'h2d'), kind, start_s, end_s (seconds)")
    unknown = sorted(set(frame["stream"]) - set(LANES))
    if unknown:
        raise ValueError(f"unknown stream(s) {unknown}: the lanes are {list(LANES)}")
    frame = frame.copy()
    for column, default in _OPTIONAL.items():
        frame[column] = frame[column].fillna(default) if column in frame else default
    frame["op"] = frame["op"].astype("int64")
    frame["nbytes"] = frame["nbytes"].astype("int64")
    return frame


def coalesce(frame: pd.DataFrame, max_rows: int) -> pd.DataFrame:
    """Merge consecutive rows of one lane and kind, ``k`` at a time, doubling ``k`` until at most ``max_rows`` remain.

    A run of one kind is never merged across another kind on its lane, so a stall between
    two ops stays where it was. If alternating kinds alone leave too many rows, runs of a
    lane and kind are merged across the others.
    """
    if max_rows < len(LANES):
        raise ValueError(f"max_rows must be at least {len(LANES)}, got {max_rows}")
    runs = ((frame["lane"] != frame["lane"].shift()) | (frame["kind"] != frame["kind"].shift())).cumsum()
    position = frame.groupby(runs).cumcount()
    k = max(1, math.ceil(len(frame) / max_rows))
    while True:
        keys = [runs.to_numpy(), (position // k).to_numpy()]
        if frame.groupby(keys, sort=False).ngroups <= max_rows or k >= len(frame):
            break
        k *= 2
    merged = _merge(frame, keys)
    if len(merged) > max_rows:  # kinds alternate too often: merge each lane and kind on its own
        lane_kind = frame.groupby(["lane", "kind"], sort=False).cumcount()
        per = max(1, math.ceil(len(frame) / max(1, max_rows - frame.groupby(["lane", "kind"]).ngroups)))
        merged = _merge(frame, [frame["lane"].to_numpy(), frame["kind"].to_numpy(), (lane_kind // per).to_numpy()])
    return merged


def _merge(frame: pd.DataFrame, keys: list[np.ndarray]) -> pd.DataFrame:
    grouped = frame.groupby(keys, sort=False)
    merged = grouped.agg(source=("source", "first"), lane=("lane", "first"), kind=("kind", "first"),
                         stall=("stall", "first"), start_s=("start_s", "min"), end_s=("end_s", "max"),
                         op=("op", "min"), last_op=("last_op", "max"), count=("count", "sum"),
                         name=("name", "first"), last_name=("name", "last"), module=("module", "first"),
                         last_module=("module", "last"), tensor=("tensor", "first"), nbytes=("nbytes", "sum"))
    several = merged["count"] > 1
    merged.loc[several, "name"] = merged.loc[several, "name"] + " … " + merged.loc[several, "last_name"]
    same = merged["module"] == merged["last_module"]
    merged.loc[several & ~same, "module"] = merged.loc[several & ~same, "module"] + " … " + \
        merged.loc[several & ~same, "last_module"]
    merged.loc[several, "tensor"] = ""
    return merged.drop(columns=["last_name", "last_module"]).reset_index(drop=True)
