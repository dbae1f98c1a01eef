"""The memory curve (op axis) over the stream timeline (time axis), linked both ways in one chart.

Drag across the curve to select a range of ops: the timeline fades every bar outside it.
Drag across the timeline to select a span of time: the curve marks the ops that start in it.
Click the curve to pick one op (memory_curve's OP_SELECTION): frames.live_tensors lists
what is live there.
"""

from __future__ import annotations

from typing import Literal

import altair as alt
import pandas as pd

from udnn_lab.charts.base import check_columns, titled
from udnn_lab.charts.memory import memory_curve_layers
from udnn_lab.charts.streams import timeline_layers

__all__ = ["OP_RANGE", "TIME_RANGE", "linked_memory_and_streams"]

OP_RANGE = "op_range"  # interval selection over the curve's op index
TIME_RANGE = "time_range"  # interval selection over the timeline's milliseconds


def linked_memory_and_streams(curve: pd.DataFrame, timeline: pd.DataFrame, budget_bytes: int | None = None,
                              min_budget_bytes: int | None = None, width: int = 720, height: int = 260,
                              lane_height: int = 28, title: str | None = None,
                              legends: Literal["right", "bottom"] = "right", picked_op: int | None = None,
                              subtitle: str | list[str] | None = None) -> alt.VConcatChart:
    """frames.memory_curve (with times: of a Simulation) above frames.timeline, each one's range selecting in the
    other. The timeline's bars carry the ops they ran (``op`` to ``last_op``), the curve's rows their start time,
    so the two axes meet without a join. ``legends`` and ``picked_op`` as for memory_curve; ``subtitle``: a line (or
    lines) under the title."""
    check_columns(curve, ["index", "start_s"], "frames.memory_curve of a Simulation")
    check_columns(timeline, ["op", "last_op", "start_s"], "frames.timeline")
    ops = alt.selection_interval(name=OP_RANGE, encodings=["x"])
    span = alt.selection_interval(name=TIME_RANGE, encodings=["x"])
    layers = memory_curve_layers(curve, budget_bytes, min_budget_bytes, height, legends, select_op=True,
                                 pointer_params=(ops,), picked_op=picked_op)
    starts = curve[curve["category"] == "total"].assign(time_ms=curve["start_s"] * 1e3)
    in_span = (f"isValid({TIME_RANGE}.start_ms) && datum.time_ms >= {TIME_RANGE}.start_ms[0] && "
               f"datum.time_ms <= {TIME_RANGE}.start_ms[1]")
    layers.append(alt.Chart(starts).mark_rule(color="#ff7f0e", opacity=0.35).encode(
        x=alt.X("index:Q"), tooltip=["index:Q", "op:N", alt.Tooltip("time_ms:Q", format=",.3f")],
    ).transform_filter(in_span))
    memory = alt.layer(*layers).resolve_scale(color="independent").properties(width=width, height=height)
    streams, tracks = timeline_layers(timeline, lane_height, op_range=OP_RANGE, time_range=span)
    below = alt.layer(*streams).properties(width=width, height=max(lane_height * tracks, 60))
    # the total lines' legend stays with the curve: every channel it is drawn from is the curve's own
    chart = alt.vconcat(memory, below).resolve_scale(color="independent", stroke="independent",
                                                     strokeWidth="independent", strokeOpacity="independent",
                                                     strokeDash="independent")
    return titled(chart, title, subtitle)

