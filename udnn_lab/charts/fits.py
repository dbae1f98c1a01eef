"""Will it fit? Peak bytes per configuration, by category, and peak against a size, both against device memories."""

from __future__ import annotations

import altair as alt
import pandas as pd

from udnn_lab.charts.base import byte_unit, category_scale, check_columns, rules
from udnn_lab.vocabulary import CATEGORIES


def breakdown_bars(frame: pd.DataFrame, memories: dict[str, float | None] | None = None, width: int = 560,
                   title: str | None = None) -> alt.LayerChart:
    """One stacked bar per configuration: the bytes of each category at the peak (columns configuration, category,
    bytes; e.g. ``graph.breakdown()["bytes_at_peak"]`` per graph), with ``memories`` (name -> bytes) as rules."""
    check_columns(frame, ["configuration", "category", "bytes"], "a frame of configuration, category and bytes")
    totals = frame.groupby("configuration", sort=False)["bytes"].sum()
    unit, scale = byte_unit(max([totals.max() if len(totals) else 0] + [v or 0 for v in (memories or {}).values()]))
    present = [c for c in CATEGORIES if c in set(frame["category"])]
    data = frame[frame["bytes"] > 0].assign(value=lambda f: f["bytes"] / scale,
                                            rank=lambda f: f["category"].map({c: i for i, c in enumerate(CATEGORIES)}))
    bars = alt.Chart(data).mark_bar().encode(
        y=alt.Y("configuration:N", sort=list(totals.index), title=None),
        x=alt.X("value:Q", stack="zero", title=f"bytes at the peak ({unit})"),
        color=alt.Color("category:N", scale=category_scale(present)), order=alt.Order("rank:Q"),
        tooltip=["configuration:N", "category:N", alt.Tooltip("value:Q", format=",.2f", title=unit)])
    layers: list[alt.Chart | alt.LayerChart | alt.FacetChart] = [bars]
    marks = rules(memories or {}, scale, unit, orient="x")
    if marks is not None:
        layers.append(marks)
    chart = alt.layer(*layers).resolve_scale(color="independent").properties(width=width)
    return chart.properties(title=title) if title else chart


def peak_by_size(frame: pd.DataFrame, x: str = "size", memories: dict[str, float | None] | None = None,
                 x_title: str = "sequence length", width: int = 560, height: int = 300,
                 title: str | None = None) -> alt.LayerChart:
    """Peak bytes against a size, one line per configuration (columns configuration, ``x``, peak_bytes), with
    ``memories`` (name -> bytes) as labelled rules."""
    check_columns(frame, ["configuration", x, "peak_bytes"], f"a frame of configuration, {x} and peak_bytes")
    largest = max([frame["peak_bytes"].max() if len(frame) else 0] + [v or 0 for v in (memories or {}).values()])
    unit, scale = byte_unit(largest)
    data = frame.assign(value=frame["peak_bytes"] / scale)
    tooltip = ["configuration:N", f"{x}:Q", alt.Tooltip("value:Q", format=",.2f", title=unit)]
    encoding = dict(x=alt.X(f"{x}:Q", title=x_title), y=alt.Y("value:Q", title=f"peak ({unit})"),
                    color=alt.Color("configuration:N"), tooltip=tooltip)
    line = alt.Chart(data).mark_line(point=True).encode(**encoding)
    layers: list[alt.Chart | alt.LayerChart | alt.FacetChart] = [line]
    marks = rules(memories or {}, scale, unit)
    if marks is not None:
        layers.append(marks)
    chart = alt.layer(*layers).resolve_scale(color="independent").properties(width=width, height=height)
    return chart.properties(title=title) if title else chart


def by_world_size(frame: pd.DataFrame, memories: dict[str, float | None] | None = None, width: int = 340,
                  height: int = 260, title: str | None = None) -> alt.HConcatChart:
    """Two panels against world size (log scale), one line per setup: each rank's peak, with ``memories`` as
    rules, and the predicted step time (columns world_size, setup, peak_bytes, step_time_s, fits: the rows of
    ``ul.sweep(..., world_sizes=...)`` for one budget). A hollow point does not fit."""
    check_columns(frame, ["world_size", "setup", "peak_bytes", "step_time_s", "fits"],
                  "ul.sweep(..., world_sizes=...)'s rows for one budget")
    largest = max([frame["peak_bytes"].max() if len(frame) else 0] + [v or 0 for v in (memories or {}).values()])
    unit, scale = byte_unit(largest)
    data = frame.assign(value=frame["peak_bytes"] / scale, step_ms=frame["step_time_s"] * 1e3,
                        fitting=frame["fits"].map({True: "fits", False: "does not fit"}))
    x = alt.X("world_size:Q", scale=alt.Scale(type="log", base=2), title="world size (ranks)",
              axis=alt.Axis(values=sorted(set(frame["world_size"])), format="d"))
    setup = alt.Color("setup:N", title="setup")
    filled = alt.Fill("setup:N", legend=None)
    shape = alt.Shape("fitting:N", scale=alt.Scale(domain=["fits", "does not fit"], range=["circle", "square"]),
                      title=None)
    tooltip = ["setup:N", "world_size:Q", alt.Tooltip("value:Q", format=",.2f", title=f"peak ({unit})"),
               alt.Tooltip("step_ms:Q", format=",.1f", title="step (ms)"), "fitting:N"]
    peak = alt.Chart(data).mark_line(point=True).encode(x=x, y=alt.Y("value:Q", title=f"peak per rank ({unit})"),
                                                        color=setup, tooltip=tooltip)
    points = alt.Chart(data).mark_point(size=60).encode(x=x, y="value:Q", color=setup, shape=shape, tooltip=tooltip)
    layers: list[alt.Chart | alt.LayerChart | alt.FacetChart] = [peak, points]
    marks = rules(memories or {}, scale, unit)
    if marks is not None:
        layers.append(marks)
    left = alt.layer(*layers).properties(width=width, height=height, title="memory of one rank")
    timed = data[data["step_ms"].notna()]
    right = alt.Chart(timed).mark_line(point=True).encode(
        x=x, y=alt.Y("step_ms:Q", title="predicted step (ms)"), color=setup, fill=filled, tooltip=tooltip,
    ).properties(width=width, height=height, title="step time of one rank")
    chart = alt.hconcat(left, right).resolve_scale(color="shared", shape="independent")
    return chart.properties(title=title) if title else chart
