"""Per-layer bars and sweeps: budget x policy (Pareto front), copy bandwidth, batch size, hardware, policy savings."""

from __future__ import annotations

import altair as alt
import numpy as np
import pandas as pd

from udnn_lab.charts.base import byte_unit, check_columns, rules

_MEASURES = {  # column -> (title, how to display)
    "saved_bytes": ("saved for backward", "bytes"), "output_bytes": ("output", "bytes"),
    "parameter_bytes": ("parameters", "bytes"), "offloaded_bytes": ("offloaded", "bytes"),
    "recomputed_bytes": ("recomputed", "bytes"), "kept_bytes": ("kept on the device", "bytes"),
    "pinned_bytes": ("pinned host pool", "bytes"), "d2h_bytes": ("copied to host", "bytes"),
    "peak_bytes": ("peak", "bytes"), "min_budget_bytes": ("smallest budget", "bytes"),
    "flops": ("FLOPs", "flops"), "forward_flops": ("forward FLOPs", "flops"),
    "backward_flops": ("backward FLOPs", "flops"), "time_s": ("time", "seconds"),
    "step_time_s": ("step time", "seconds"), "stall_time_s": ("stall time", "seconds"),
}


def _display(frame: pd.DataFrame, column: str) -> tuple[pd.Series, str, float]:
    """A column in display units, its axis title, and the factor from its unit (bytes, s, FLOPs) to the display."""
    title, kind = _MEASURES.get(column, (column, "bytes" if column.endswith("_bytes") else
                                         "seconds" if column.endswith("_s") else "plain"))
    values = frame[column].astype(float)
    if kind == "bytes":
        unit, scale = byte_unit(values.max() if len(values) else 0)
        title, factor = f"{title} ({unit})", 1 / scale
    elif kind == "flops":
        title, factor = f"{title} (GFLOP)", 1e-9
    elif kind == "seconds":
        title, factor = f"{title} (ms)", 1e3
    else:
        factor = 1.0
    return values * factor, title, factor


def layer_bars(frame: pd.DataFrame, measures: tuple[str, ...] = ("saved_bytes", "flops", "time_s"),
               width: int = 720, height: int = 110, max_bars: int = 1000) -> alt.VConcatChart:
    """One bar per module in execution order (from frames.layers), one panel per measure; measures that are
    all missing (time without a profile or simulation) are left out. Saved bytes are split into kept,
    offloaded and recomputed when the frame came with a simulation of a plan. Past ``max_bars`` modules
    (ResNet-1001 has thousands), the ``max_bars`` with most of the first measure are kept, in order."""
    check_columns(frame, ["module", "type", "order"] + list(measures), "frames.layers")
    heading = None
    if len(frame) > max_bars:
        heading = f"the {max_bars} modules with most {_MEASURES.get(measures[0], (measures[0],))[0]} of {len(frame)}"
        frame = frame.nlargest(max_bars, measures[0])
    frame = frame.sort_values("order", kind="stable").assign(
        module=frame["module"].replace("", "(model)"))
    many = len(frame) > 60
    x = alt.X("module:N", sort=list(dict.fromkeys(frame["module"])), title=None,
              axis=alt.Axis(labels=not many, ticks=not many, labelAngle=-60, labelLimit=160))
    panels = []
    for column in measures:
        if frame[column].isna().all():
            continue
        values, title, factor = _display(frame, column)
        data = frame.assign(value=values, fate="")
        if column == "saved_bytes":
            data = _saved_by_fate(frame, factor)
        tooltip = ["module:N", "type:N", alt.Tooltip("value:Q", title=title, format=",.2f")]
        color = alt.Color("fate:N", title="saved tensors", scale=_fates(set(data["fate"]))) \
            if column == "saved_bytes" else alt.value("#4c78a8")
        bars = alt.Chart(data).mark_bar().encode(x, alt.Y("value:Q", title=title, stack="zero"), color=color,
                                                 tooltip=tooltip + (["fate:N"] if column == "saved_bytes" else []))
        panels.append(bars.properties(width=width, height=height))
    if not panels:
        raise ValueError(f"no values to chart: every one of {list(measures)} is missing")
    chart = alt.vconcat(*panels).resolve_scale(x="shared")
    return chart.properties(title=heading) if heading else chart


_FATE_COLORS = {"kept": "#4c78a8", "offloaded": "#e6a700", "recomputed": "#b279a2"}


def _fates(present: set[str]) -> alt.Scale:
    domain = [fate for fate in _FATE_COLORS if fate in present] or ["kept"]
    return alt.Scale(domain=domain, range=[_FATE_COLORS[fate] for fate in domain])


def _saved_by_fate(frame: pd.DataFrame, factor: float) -> pd.DataFrame:
    moved = {fate: frame[f"{fate}_bytes"] if f"{fate}_bytes" in frame else 0 for fate in ("offloaded", "recomputed")}
    kept = (frame["saved_bytes"] - moved["offloaded"] - moved["recomputed"]).clip(lower=0)
    parts = [frame.assign(fate=fate, value=values * factor) for fate, values in
             (("kept", kept), ("offloaded", moved["offloaded"]), ("recomputed", moved["recomputed"]))]
    data = pd.concat(parts, ignore_index=True)
    return data[data["value"] > 0] if (data["value"] > 0).any() else data


def budget_sweep(frame: pd.DataFrame, y: str = "step_time_s", budget_bytes: int | None = None,
                 width: int = 620, height: int = 300, title: str | None = None) -> alt.LayerChart:
    """A measure against the budget, one line per policy (from frames.budget_sweep); for step time the Pareto
    front (no smaller budget gives a faster step) is the thick black line. Rows that do not fit are left out."""
    check_columns(frame, ["budget_bytes", "policy", "fits", y], "frames.budget_sweep")
    unit, scale = byte_unit(frame["budget_bytes"].max() if len(frame) else 0)
    values, y_title, _ = _display(frame, y)
    data = frame.assign(budget=frame["budget_bytes"] / scale, value=values)[frame["fits"].astype(bool)]
    x = alt.X("budget:Q", title=f"budget ({unit})")
    tooltip = ["policy:N", alt.Tooltip("budget:Q", format=",.2f", title=unit), alt.Tooltip("value:Q", title=y_title,
                                                                                           format=",.3f")]
    lines = alt.Chart(data).mark_line(point=True, opacity=0.8).encode(
        x, alt.Y("value:Q", title=y_title), color=alt.Color("policy:N", title="policy"), tooltip=tooltip)
    layers = [lines]
    if y == "step_time_s" and "pareto" in data:
        front = data[data["pareto"]]
        layers.append(alt.Chart(front).mark_line(color="black", strokeWidth=3, interpolate="step-after").encode(
            x, alt.Y("value:Q"), tooltip=tooltip))
        layers.append(alt.Chart(front).mark_point(color="black", size=70, filled=True).encode(
            x, alt.Y("value:Q"), tooltip=tooltip + ["pareto:N"]))
    marks = rules({"budget": budget_bytes}, scale, unit, orient="x")
    if marks is not None:
        layers.append(marks)
    chart = alt.layer(*layers).resolve_scale(color="independent").properties(width=width, height=height)
    return chart.properties(title=title) if title else chart


def bandwidth(frame: pd.DataFrame, width: int = 620, height: int = 300,
              title: str | None = None) -> alt.LayerChart | alt.FacetChart:
    """Copy bandwidth (GB/s) against copy size, log scale (from frames.bandwidth): measured points and lines,
    hardware profiles' models dashed."""
    check_columns(frame, ["source", "series", "nbytes", "bytes_per_s"], "frames.bandwidth")
    data = frame.assign(GB_per_s=frame["bytes_per_s"] / 1e9, KiB=frame["nbytes"] / 2**10)
    sources = ["measured"] + sorted(set(data["source"]) - {"measured"})
    sizes = "datum.value >= 1048576 ? datum.value / 1048576 + ' GiB' : " \
            "datum.value >= 1024 ? datum.value / 1024 + ' MiB' : datum.value + ' KiB'"
    x = alt.X("KiB:Q", scale=alt.Scale(type="log", base=2), title="copy size (log scale)",
              axis=alt.Axis(labelExpr=sizes))
    y = alt.Y("GB_per_s:Q", title="bandwidth (GB/s)")
    tooltip = ["source:N", "series:N", alt.Tooltip("KiB:Q", format=",.0f"), alt.Tooltip("GB_per_s:Q", format=".2f")]
    lines = alt.Chart(data).mark_line().encode(
        x, y, color=alt.Color("series:N", title="copy"),
        strokeDash=alt.StrokeDash("source:N", sort=sources, title="source",
                                  legend=alt.Legend(symbolType="stroke", symbolStrokeColor="#333333")),
        strokeWidth=alt.condition(alt.datum.source == "measured", alt.value(3), alt.value(1.5)), tooltip=tooltip)
    points = alt.Chart(data).mark_point(filled=True, size=40).encode(
        x, y, color=alt.Color("series:N", title="copy"), tooltip=tooltip)
    chart = alt.layer(lines, points).properties(width=width, height=height)
    return chart.properties(title=title) if title else chart


def batch_sweep(frame: pd.DataFrame, y: str = "min_budget_bytes", budget_bytes: int | None = None,
                width: int = 620, height: int = 300, title: str | None = None) -> alt.LayerChart:
    """Bytes needed against batch size, one line per policy (columns batch, policy and ``y``), the budget as a
    rule; batches at or under the budget are filled points."""
    check_columns(frame, ["batch", "policy", y], "a frame of batch, policy and " + y)
    largest = max(frame[y].max() if len(frame) else 0, budget_bytes or 0)
    unit, scale = byte_unit(largest)
    data = frame.assign(value=frame[y] / scale,
                        under=(frame[y] <= budget_bytes) if budget_bytes is not None else True)
    tooltip = ["policy:N", "batch:Q", alt.Tooltip("value:Q", format=",.2f", title=unit), "under:N"]
    line = alt.Chart(data).mark_line().encode(
        x=alt.X("batch:Q", title="batch size"), y=alt.Y("value:Q", title=f"{_MEASURES.get(y, (y,))[0]} ({unit})"),
        color=alt.Color("policy:N"), tooltip=tooltip)
    points = alt.Chart(data).mark_point(size=60).encode(
        x="batch:Q", y="value:Q", color=alt.Color("policy:N", legend=None), tooltip=tooltip,
        fill=alt.condition("datum.under", alt.Color("policy:N", legend=None), alt.value("white")))
    layers = [line, points]
    marks = rules({"budget": budget_bytes}, scale, unit)
    if marks is not None:
        layers.append(marks)
    chart = alt.layer(*layers).resolve_scale(color="independent").properties(width=width, height=height)
    return chart.properties(title=title) if title else chart


def step_times(frame: pd.DataFrame, by: str = "hardware", color: str = "policy", width: int = 620,
               title: str | None = None) -> alt.LayerChart | alt.FacetChart:
    """Predicted step time per ``by`` (e.g. hardware), one bar per ``color`` (e.g. policy), the stalled part dark
    (from frames.simulations)."""
    check_columns(frame, [by, color, "step_time_s", "stall_time_s"], "frames.simulations")
    data = frame.assign(step_ms=frame["step_time_s"] * 1e3, stall_ms=frame["stall_time_s"] * 1e3)
    y = alt.Y(f"{by}:N", title=by, sort=None)
    offset = alt.YOffset(f"{color}:N")
    tooltip = [f"{by}:N", f"{color}:N", alt.Tooltip("step_ms:Q", format=",.2f"),
               alt.Tooltip("stall_ms:Q", format=",.2f")]
    bars = alt.Chart(data).mark_bar().encode(x=alt.X("step_ms:Q", title="step time (ms)"), y=y, yOffset=offset,
                                             color=alt.Color(f"{color}:N"), tooltip=tooltip)
    stalled = alt.Scale(domain=["stalled (waiting on copies)"], range=["#000000"])
    stalls = alt.Chart(data.assign(part=stalled.domain[0])).mark_bar(opacity=0.45).encode(
        x="stall_ms:Q", y=y, yOffset=offset, tooltip=tooltip,
        color=alt.Color("part:N", scale=stalled, title="of which"))
    rows = data[[by, color]].drop_duplicates().shape[0]
    chart = alt.layer(bars, stalls).resolve_scale(color="independent").properties(width=width,
                                                                                   height=max(16 * rows, 80))
    return chart.properties(title=title) if title else chart


_DASHES = [[4, 2], [8, 3], [2, 2], [10, 2, 2, 2]]


def policy_savings(frame: pd.DataFrame, measure: str = "average_saved", published: pd.DataFrame | None = None,
                   width: int = 200, height: int = 220, title: str | None = None) -> alt.FacetChart:
    """A fraction per policy, one panel per model (from frames.savings: peak_saved, average_saved, time_paid);
    ``published`` (columns model, value and label) adds the papers' figures as dashed rules, named in a
    legend under the panels (a label on the panel would sit on the bars)."""
    check_columns(frame, ["model", "policy", measure], "frames.savings")
    titles = {"average_saved": "average memory saved", "peak_saved": "peak memory saved",
              "time_paid": "time paid (slower than keep-all)", "pinned_saved": "pinned host memory saved",
              "speedup": "faster by"}
    policies, models = list(dict.fromkeys(frame["policy"])), list(dict.fromkeys(frame["model"]))
    ours = frame[["model", "policy", measure]].rename(columns={measure: "value"}).assign(kind="predicted", label="")
    parts = [ours]
    if published is not None and len(published):
        check_columns(published, ["model", "value", "label"], "a frame of model, value and label")
        parts.append(published[["model", "value", "label"]].assign(policy="", kind="published"))
    data = pd.concat(parts, ignore_index=True)
    data["value"] = data["value"].astype(float).replace([np.inf, -np.inf], np.nan)
    y_title = titles.get(measure, measure)
    bars = alt.Chart().mark_bar().encode(
        x=alt.X("policy:N", title=None, sort=policies, axis=alt.Axis(labelAngle=-40)),
        y=alt.Y("value:Q", axis=alt.Axis(format="%"), title=y_title),
        color=alt.Color("policy:N", sort=policies, legend=None),
        tooltip=["model:N", "policy:N", alt.Tooltip("value:Q", format=".1%")]).transform_filter(
        alt.datum.kind == "predicted")
    layers: list[alt.Chart] = [bars]
    labels = list(dict.fromkeys(data.loc[data["kind"] == "published", "label"]))
    dashes = alt.Scale(domain=labels, range=[_DASHES[i % len(_DASHES)] for i in range(len(labels))])
    layers += [alt.Chart().mark_rule(color="black", strokeWidth=2).encode(
        y="value:Q", strokeDash=alt.StrokeDash("label:N", scale=dashes, title="published",
                                               legend=alt.Legend(orient="bottom", direction="vertical",
                                                                 labelLimit=500, symbolStrokeColor="black")),
        tooltip=["label:N", alt.Tooltip("value:Q", format=".0%")]).transform_filter(
        alt.datum.kind == "published")] if labels else []
    chart = alt.layer(*layers, data=data).properties(width=width, height=height).facet(
        column=alt.Column("model:N", title=None, sort=models))
    return chart.properties(title=title) if title else chart
