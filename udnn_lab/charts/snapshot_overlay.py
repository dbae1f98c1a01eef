"""A snapshot of a real run over the prediction of its step (from frames.snapshot_overlay): two curves on the
step's allocations, and the two peaks side by side, each stacked by what it held."""

from __future__ import annotations

import altair as alt
import pandas as pd

from udnn_lab.charts.base import byte_unit, check_columns, titled
from udnn_lab.units import format_bytes

__all__ = ["snapshot_overlay"]

_SIDE_COLORS = alt.Scale(domain=["predicted", "measured"], range=["#555555", "#d62728"])
# colour, width, opacity, dash per series, as the memory curve draws predicted and measured lines
_LINE_STYLES = {"predicted": ("#222222", 1.5, 1.0, [1, 0]), "measured": ("#d62728", 5.0, 0.45, [1, 0]),
                "reserved": ("#7f7f7f", 1.5, 1.0, [4, 3])}
_PARTS_SHOWN = 12  # per side; the rest are summed as one part


def snapshot_overlay(timeline: pd.DataFrame, peak_parts: pd.DataFrame, width: int = 560, height: int = 260,
                     title: str | None = None) -> alt.HConcatChart:
    """Left: predicted and measured allocated bytes (and the snapshot's reserved bytes, where it has them)
    against the fraction of the step's allocations made; each curve's peak marked. Right: each peak as a bar
    stacked by its parts, largest at the bottom (hover a part for what it is: category · module · op on the
    predicted bar, the place in the code on the measured one)."""
    check_columns(timeline, ["step_fraction", "series", "line", "bytes", "index", "at"],
                  "SnapshotOverlay.timeline()")
    check_columns(peak_parts, ["side", "part", "bytes", "count"], "SnapshotOverlay.peak_parts()")
    largest = max(int(timeline["bytes"].max()) if len(timeline) else 0,
                  int(peak_parts.groupby("side")["bytes"].sum().max()) if len(peak_parts) else 0)
    unit, scale = byte_unit(largest)
    y = alt.Y("value:Q", title=f"allocated {unit}", scale=alt.Scale(domain=[0, largest / scale * 1.05 or 1]))
    curves = alt.layer(*_curves(timeline.assign(value=timeline["bytes"] / scale), y, unit)).properties(
        width=width, height=height, title="over the step")
    bars = _peak_bars(peak_parts, scale, unit, y, height)
    chart = alt.hconcat(curves, bars).resolve_scale(color="independent")
    attrs = timeline.attrs
    subtitle = None
    if "predicted_peak_bytes" in attrs:
        difference = attrs["measured_peak_bytes"] - attrs["predicted_peak_bytes"]
        subtitle = (f"peak predicted {format_bytes(attrs['predicted_peak_bytes'])}, measured "
                    f"{format_bytes(attrs['measured_peak_bytes'])} ({'+' if difference >= 0 else '-'}"
                    f"{format_bytes(abs(difference))}); x: the share of the step's allocations made so far")
    return titled(chart, title, subtitle)


def _curves(data: pd.DataFrame, y: alt.Y, unit: str) -> list[alt.Chart]:
    """A step line per curve, drawn in the frame's row order (points share an x where nothing is allocated: a
    free, an op that allocates nothing), the measured one wide and pale under the predicted one."""
    x = alt.X("step_fraction:Q", title="share of the step's allocations made", scale=alt.Scale(domain=[0, 1]),
              axis=alt.Axis(format="%"))
    tooltip = ["line:N", "index:Q", "at:N", alt.Tooltip("value:Q", title=unit, format=",.2f"),
               alt.Tooltip("step_fraction:Q", title="share", format=".1%")]
    lines = list(dict.fromkeys(data["line"]))
    styles = [_LINE_STYLES[series] for series in dict.fromkeys(data["series"])]
    color = alt.Color("line:N", title=None, scale=alt.Scale(domain=lines, range=[style[0] for style in styles]),
                      legend=alt.Legend(orient="bottom", direction="vertical", labelLimit=400))
    data = data.assign(position=range(len(data)))
    drawn = []
    for series in ("measured", "reserved", "predicted"):  # the measured line under the others
        part = data[data["series"] == series]
        if len(part):
            _, width, opacity, dash = _LINE_STYLES[series]
            drawn.append(alt.Chart(part).mark_line(interpolate="step-after", strokeWidth=width, opacity=opacity,
                                                   strokeDash=dash).encode(
                x, y, color=color, order=alt.Order("position:Q"), tooltip=tooltip))
    peaks = data.loc[data.groupby("line")["value"].idxmax()] if len(data) else data
    drawn.append(alt.Chart(peaks).mark_point(shape="triangle-down", size=90, filled=True, opacity=1).encode(
        x, y, color=color, tooltip=tooltip))
    return drawn


def _peak_bars(parts: pd.DataFrame, scale: int, unit: str, y: alt.Y, height: int) -> alt.Chart:
    """A bar per side, stacked by its largest parts (the rest summed as one part)."""
    shown = []
    for side, group in parts.groupby("side", sort=False):
        group = group.sort_values("bytes", ascending=False, kind="stable")
        kept, rest = group.head(_PARTS_SHOWN), group.iloc[_PARTS_SHOWN:]
        if len(rest):
            kept = pd.concat([kept, pd.DataFrame([{"side": side, "part": f"{len(rest)} other parts",
                                                   "bytes": int(rest["bytes"].sum()),
                                                   "count": int(rest["count"].sum())}])], ignore_index=True)
        shown.append(kept.assign(rank=range(len(kept))))
    data = pd.concat(shown, ignore_index=True) if shown else parts.assign(rank=0)
    data = data.assign(value=data["bytes"] / scale, size=[format_bytes(int(b)) for b in data["bytes"]])
    return alt.Chart(data).mark_bar(stroke="white", strokeWidth=1).encode(
        x=alt.X("side:N", title="at the peak", sort=["predicted", "measured"]), y=y,
        color=alt.Color("side:N", scale=_SIDE_COLORS, legend=None), order=alt.Order("rank:Q"),
        opacity=alt.Opacity("rank:Q", scale=alt.Scale(range=[1.0, 0.45]), legend=None),
        tooltip=["side:N", "part:N", "size:N", alt.Tooltip("count:Q", title="tensors or blocks")],
    ).properties(width=120, height=height, title="at the peak")
