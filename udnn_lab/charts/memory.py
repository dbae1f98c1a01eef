"""Tidy DataFrames (udnn_lab.frames.memory) -> altair charts, rendered without a CDN.

Charts know DataFrames, not graphs. Bytes and seconds come in; MiB/GiB and ms go out.
Every chart is an ordinary altair chart: display it, ``save(chart, "x.html" | ".png" |
".svg")``, or wrap it in ``alt.JupyterChart`` to update it in place.
"""

from __future__ import annotations

from typing import Literal

import altair as alt
import pandas as pd

from udnn_lab.charts.base import (
    PHASE_COLORS,
    byte_unit,
    category_scale,
    check_columns,
    enable_offline,
    rule_label_room,
    rules,
    save,
)
from udnn_lab.charts.streams import timeline, training
from udnn_lab.charts.sweeps import bandwidth, batch_sweep, budget_sweep, layer_bars, policy_savings, step_times
from udnn_lab.vocabulary import CATEGORIES, PHASES

__all__ = [
    "OP_SELECTION", "bandwidth", "batch_sweep", "budget_sweep", "enable_offline", "layer_bars", "memory_by_category",
    "memory_curve", "memory_curve_layers", "policy_savings", "predicted_vs_measured", "save", "step_times",
    "timeline", "training",
]

# colour, width, opacity, dash of a total line by its series: a measured line is wide and pale and drawn under the
# predicted one, so that where the two coincide both still show (a dark line on a pale band)
_LINE_STYLES: dict[str, tuple[str, float, float, list[int]]] = {
    "predicted": ("#222222", 1.5, 1.0, [1, 0]), "measured": ("#d62728", 5.0, 0.45, [1, 0])}
_OTHER_LINE = ("#7f7f7f", 1.5, 1.0, [2, 2])
Layer = alt.Chart | alt.LayerChart | alt.FacetChart
OP_SELECTION = "drill_op"  # the op picked on a memory curve: a point selection of its ``index``
PHASE_LABEL_ROOM = 24  # pixels kept free of data at the top of the plot, where the phases are named


def memory_curve(frame: pd.DataFrame, budget_bytes: int | None = None, min_budget_bytes: int | None = None,
                 width: int = 720, height: int = 300, title: str | None = None,
                 legends: Literal["right", "bottom"] = "right", select_op: bool = False,
                 picked_op: int | None = None) -> alt.LayerChart:
    """Live memory over the step (from frames.memory_curve): categories stacked, predicted and measured totals
    as lines (named in the legend by the frame's ``line`` column when it has one), forward | backward |
    optimizer shaded and named in a strip the data never reaches, the budget (and the policy's minimum) as
    rules labelled right of the plot. ``legends="bottom"`` puts the legends under the plot, for a narrow
    space. ``select_op=True``: a click picks the op nearest to the pointer (the point selection
    OP_SELECTION, its value the op's ``index``) and a rule marks it; a double click clears it. ``picked_op``:
    the op picked when the chart is drawn."""
    layers = memory_curve_layers(frame, budget_bytes, min_budget_bytes, height, legends, select_op,
                                 picked_op=picked_op)
    chart = alt.layer(*layers).resolve_scale(color="independent").properties(width=width, height=height)
    return chart.properties(title=title) if title else chart


def memory_curve_layers(frame: pd.DataFrame, budget_bytes: int | None = None, min_budget_bytes: int | None = None,
                        height: int = 300, legends: Literal["right", "bottom"] = "right",
                        select_op: bool = False, pointer_params: tuple[alt.Parameter, ...] = (),
                        picked_op: int | None = None) -> list[Layer]:
    """memory_curve's layers, for charts that add their own (charts.linked); ``pointer_params`` (selections) go
    on the one layer that takes the pointer: the invisible points that pick an op with ``select_op``, else the
    total lines.

    One layer, because altair (6.3) gives a selection of a layered chart inside a concatenation every
    layer of it that has a selection as its views, and two views of one interval selection are two
    definitions of its signals (vega: "Duplicate signal name").
    """
    check_columns(frame, ["index", "phase", "module", "op", "series", "category", "bytes"], "frames.memory_curve")
    largest = max([frame["bytes"].max() if len(frame) else 0, budget_bytes or 0, min_budget_bytes or 0])
    unit, scale = byte_unit(largest)
    data = frame.assign(value=frame["bytes"] / scale, time_ms=frame.get("start_s", float("nan")) * 1e3)
    if "line" not in data:
        data = data.assign(line=data["series"])
    x = alt.X("index:Q", title="op of the step (forward | backward | optimizer)", scale=alt.Scale(nice=False))
    top = largest / scale * height / max(height - PHASE_LABEL_ROOM, 1) if largest else 1.0
    y_scale = alt.Scale(domain=[0, top], nice=False)
    y_title = f"live {unit}"
    marks: dict[str, float | None] = {"budget": budget_bytes, "minimum feasible": min_budget_bytes}
    legend = alt.Legend(offset=rule_label_room(marks), labelLimit=400) if legends == "right" else \
        alt.Legend(orient="bottom", direction="horizontal", columns=4, labelLimit=400)
    layers: list[Layer] = [_phase_bands(data)]
    stacked = data[(data["series"] == "predicted") & (data["category"] != "total")]
    present = [c for c in CATEGORIES if c in set(stacked["category"])]
    stacked = stacked.assign(rank=stacked["category"].map({c: i for i, c in enumerate(CATEGORIES)}))
    tooltip = ["index:Q", "phase:N", "module:N", "op:N", alt.Tooltip("value:Q", title=unit, format=",.1f")]
    layers.append(alt.Chart(stacked).mark_area(interpolate="step-after", opacity=0.85).encode(
        x, alt.Y("value:Q", stack="zero", title=y_title, scale=y_scale),
        color=alt.Color("category:N", scale=category_scale(present), title="category", legend=legend),
        order=alt.Order("rank:Q"), tooltip=tooltip[:4] + ["category:N"] + tooltip[4:] +
        [alt.Tooltip("time_ms:Q", title="starts at ms", format=",.2f")]))
    totals = data[data["category"] == "total"]
    total_lines = series_lines(totals, "line", x, alt.Y("value:Q", stack=None, title=y_title, scale=y_scale),
                               legend, tooltip + ["line:N"], title="total")
    if pointer_params and not select_op:  # on one layer only (see above)
        total_lines[-1] = total_lines[-1].add_params(*pointer_params)
    layers.extend(total_lines)
    if select_op:  # vega-lite finds the nearest point only for point marks: invisible ones on the totals
        picked = alt.selection_point(name=OP_SELECTION, fields=["index"], nearest=True, on="click", empty=False,
                                     value=alt.Undefined if picked_op is None else [{"index": picked_op}])
        layers.append(alt.Chart(totals).mark_point(opacity=0).encode(
            x, alt.Y("value:Q", stack=None, title=y_title, scale=y_scale), tooltip=tooltip + ["line:N"],
        ).add_params(picked, *pointer_params))
        layers.append(alt.Chart(totals).mark_rule(color="#333333", strokeDash=[4, 2]).encode(
            x, tooltip=tooltip + ["line:N"]).transform_filter(picked))
    rule_marks = rules(marks, scale, unit)
    if rule_marks is not None:
        layers.append(rule_marks)
    return layers


def _phase_bands(data: pd.DataFrame) -> alt.LayerChart | alt.FacetChart:
    spans = data.groupby("phase", sort=False)["index"].agg(["min", "max"]).reset_index()
    spans = spans.rename(columns={"min": "start", "max": "end"})
    spans["end"] = spans["end"] + 1
    domain = [p for p in PHASES if p in set(spans["phase"])]
    colors = alt.Scale(domain=domain, range=[PHASE_COLORS[p] for p in domain])
    band = alt.Chart(spans).mark_rect(opacity=0.6).encode(
        x="start:Q", x2="end:Q", color=alt.Color("phase:N", scale=colors, legend=None),
        tooltip=["phase:N", alt.Tooltip("start:Q", title="first op"), alt.Tooltip("end:Q", title="ends before op")])
    wide = spans[(spans["end"] - spans["start"]) >= 0.06 * max(spans["end"].max(), 1)]
    label = alt.Chart(wide).mark_text(align="left", baseline="top", dx=3, dy=3, color="#555555").encode(
        x="start:Q", y=alt.value(0), text="phase:N")
    return alt.layer(band, label)


def memory_by_category(frame: pd.DataFrame, width: int = 720, height: int = 280) -> alt.Chart:
    """Stacked live bytes over the step, one band per category (from frames.memory_by_category)."""
    check_columns(frame, ["index", "phase", "module", "op", "category", "bytes"], "frames.memory_by_category")
    unit, scale = byte_unit(frame.groupby("index")["bytes"].sum().max() if len(frame) else 0)
    present = [c for c in CATEGORIES if c in set(frame["category"])]
    data = frame.assign(value=frame["bytes"] / scale,
                        rank=frame["category"].map({c: i for i, c in enumerate(CATEGORIES)}))
    return alt.Chart(data).mark_area(interpolate="step-after").encode(
        x=alt.X("index:Q", title="op (forward, backward, optimizer)", scale=alt.Scale(nice=False)),
        y=alt.Y("value:Q", stack="zero", title=f"live {unit}"),
        color=alt.Color("category:N", scale=category_scale(present)),
        order=alt.Order("rank:Q"),
        tooltip=["index:Q", "phase:N", "module:N", "op:N", "category:N",
                 alt.Tooltip("value:Q", title=unit, format=",.1f")],
    ).properties(width=width, height=height)


def predicted_vs_measured(frame: pd.DataFrame, width: int = 720, height: int = 280) -> alt.LayerChart | alt.FacetChart:
    """Predicted against measured live bytes over the step (from frames.predicted_vs_measured)."""
    check_columns(frame, ["index", "phase", "module", "op", "series", "bytes"], "frames.predicted_vs_measured")
    unit, scale = byte_unit(frame["bytes"].max() if len(frame) else 0)
    data = frame.assign(value=frame["bytes"] / scale)
    tooltip = ["index:Q", "phase:N", "module:N", "op:N", "series:N", alt.Tooltip("value:Q", title=unit, format=",.1f")]
    lines = series_lines(data, "series", alt.X("index:Q", title="op", scale=alt.Scale(nice=False)),
                         alt.Y("value:Q", title=f"live {unit}"), alt.Legend(), tooltip, title="series")
    return alt.layer(*lines).properties(width=width, height=height)


def series_lines(data: pd.DataFrame, field: str, x: alt.X, y: alt.Y, legend: alt.Legend, tooltip: list,
                 title: str) -> list[alt.Chart]:
    """A step line per value of ``field`` (each row's ``series`` says whether it is predicted or measured), in one
    legend: measured lines in a layer under the others, wide and pale, so that a line that coincides with the
    predicted one shows as a band around it rather than vanishing behind it."""
    series = data["series"] if "series" in data else data[field]
    series_of = dict(zip(data[field], series))
    names = sorted(series_of, key=lambda name: series_of[name] != "predicted")  # predicted first, in the legend
    styles = [_LINE_STYLES.get(series_of[name], _OTHER_LINE) for name in names]

    def scale(part: int) -> alt.Scale:
        return alt.Scale(domain=names, range=[style[part] for style in styles])
    encoding = dict(stroke=alt.Stroke(f"{field}:N", title=title, scale=scale(0), legend=legend),
                    strokeWidth=alt.StrokeWidth(f"{field}:N", title=title, scale=scale(1), legend=legend),
                    strokeOpacity=alt.StrokeOpacity(f"{field}:N", title=title, scale=scale(2), legend=legend),
                    strokeDash=alt.StrokeDash(f"{field}:N", title=title, scale=scale(3), legend=legend),
                    tooltip=tooltip)
    under = series == "measured"
    parts = [data[under], data[~under]]
    return [alt.Chart(part).mark_line(interpolate="step-after").encode(x, y, **encoding) for part in parts if len(part)]
