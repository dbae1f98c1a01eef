"""Charts of time: the stream timeline (Gantt: compute, device-to-host and host-to-device lanes, stalls
highlighted) and a training run's peak memory and time per step."""

from __future__ import annotations

import altair as alt
import pandas as pd

from udnn_lab.charts.base import byte_unit, check_columns, rules

KIND_COLORS = {
    "op": "#4c78a8", "recompute": "#b279a2", "offload": "#e6a700", "prefetch": "#54a24b",
    "prefetch_cancelled": "#bab0ac", "stall_memory": "#d62728", "stall_prefetch": "#a50f15", "stall_sync": "#fb6a4a",
    "stall_communication": "#e7298a", "stall_host": "#fdae6b", "all_gather": "#17becf", "reduce_scatter": "#9467bd",
    "all_reduce": "#8c564b", "all_to_all": "#bcbd22", "point_to_point": "#7f7f7f", "collective": "#c49c94",
    "shard_to_device": "#72b7b2", "gradient_to_host": "#f58518",
}
_LANE_TITLES = {"compute": "compute", "d2h": "device → host", "h2d": "host → device", "comm": "collectives",
                "comm_copy_in": "all-gather copy-in"}


def timeline(frame: pd.DataFrame, width: int = 720, lane_height: int = 28,
             title: str | None = None) -> alt.LayerChart | alt.FacetChart:
    """Gantt chart of a step's streams (from frames.timeline; simulated and measured rows may be concatenated).

    One lane per stream (and per source when there are several); stalls, where compute
    waits for memory, prefetches or a synchronization, are red and also ticked above the
    lane so that the shortest stay visible.
    """
    layers, tracks = timeline_layers(frame, lane_height)
    chart = alt.layer(*layers).properties(width=width, height=max(lane_height * tracks, 60))
    return chart.properties(title=title) if title else chart


def timeline_layers(frame: pd.DataFrame, lane_height: int = 28, op_range: str | None = None,
                    time_range: alt.Parameter | None = None) -> tuple[list[alt.Chart], int]:
    """timeline's layers and its number of tracks, for charts that link it to others (charts.linked).

    ``op_range``: the name of an interval selection over op ``index`` elsewhere in the chart;
    while it holds a range, the bars of the ops outside it fade. ``time_range``: an interval
    selection over time, added to the bars so that dragging across them selects a span.
    """
    check_columns(frame, ["source", "lane", "kind", "stall", "start_s", "end_s", "name", "module", "nbytes", "count"],
                  "frames.timeline")
    several = frame["source"].nunique() > 1
    track = frame["lane"].map(_LANE_TITLES).fillna(frame["lane"])
    data = frame.assign(track=(frame["source"] + " · " + track) if several else track,
                        start_ms=frame["start_s"] * 1e3, end_ms=frame["end_s"] * 1e3,
                        duration_ms=(frame["end_s"] - frame["start_s"]) * 1e3, MiB=frame["nbytes"] / 2**20)
    order = [t for t in _track_order(data) if t in set(data["track"])]
    kinds = [k for k in KIND_COLORS if k in set(data["kind"])] + sorted(set(data["kind"]) - set(KIND_COLORS))
    colors = alt.Scale(domain=kinds, range=[KIND_COLORS.get(k, "#7f7f7f") for k in kinds])
    y = alt.Y("track:N", sort=order, title=None)
    tooltip = ["track:N", "kind:N", "name:N", "module:N", "op:Q", "count:Q",
               alt.Tooltip("start_ms:Q", format=",.3f"), alt.Tooltip("duration_ms:Q", format=",.3f"),
               alt.Tooltip("MiB:Q", format=",.2f")]
    encoding: dict = {"x2": "end_ms:Q", "y": y, "color": alt.Color("kind:N", scale=colors, title="event"),
                      "tooltip": tooltip}
    if op_range is not None:  # a bar overlaps the range when its first op is before its end and its last op after
        inside = (f"!isValid({op_range}.index) || "
                  f"(datum.last_op >= {op_range}.index[0] && datum.op <= {op_range}.index[1])")
        encoding["opacity"] = alt.condition({"test": inside}, alt.value(1.0), alt.value(0.15))
    bars = alt.Chart(data).mark_bar(height={"band": 0.8}).encode(
        x=alt.X("start_ms:Q", title="time in the step (ms)"), **encoding)
    if time_range is not None:
        bars = bars.add_params(time_range)
    stalls = alt.Chart(data[data["stall"]]).mark_tick(thickness=2, bandSize=lane_height, color="#d62728").encode(
        x="start_ms:Q", y=y, tooltip=tooltip)
    return [bars, stalls], len(order)


def _track_order(data: pd.DataFrame) -> list[str]:
    """Sources in the order they come in the frame, each one's lanes compute, device → host, host → device."""
    sources = {source: i for i, source in enumerate(dict.fromkeys(data["source"]))}
    lane_rank = {title: i for i, title in enumerate(_LANE_TITLES.values())}
    tracks = data[["source", "track"]].drop_duplicates()
    ranked = sorted(tracks.itertuples(index=False),
                    key=lambda row: (sources[row.source], lane_rank.get(row.track.split(" · ")[-1], 9)))
    return [row.track for row in ranked]


def training(frame: pd.DataFrame, budget_bytes: int | None = None, predicted_peak_bytes: int | None = None,
             width: int = 640, height: int = 150) -> alt.VConcatChart:
    """Measured peak memory per step against the budget and the predicted peak, then the loss, then step time
    (from frames.training)."""
    check_columns(frame, ["step", "measure", "value"], "frames.training")
    peaks = frame[frame["measure"] == "peak_bytes"]
    unit, scale = byte_unit(max([peaks["value"].max() if len(peaks) else 0, budget_bytes or 0,
                                 predicted_peak_bytes or 0]))
    x = alt.X("step:Q", title="step", scale=alt.Scale(nice=False), axis=alt.Axis(tickMinStep=1))
    memory = alt.Chart(peaks.assign(value=peaks["value"] / scale)).mark_line(point=True, color="#d62728").encode(
        x, alt.Y("value:Q", title=f"measured peak ({unit})"), tooltip=["step:Q", alt.Tooltip("value:Q", format=",.1f")])
    marks = rules({"budget": budget_bytes, "predicted peak": predicted_peak_bytes}, scale, unit)
    top = alt.layer(memory, marks) if marks is not None else memory
    losses = frame[frame["measure"] == "loss"]
    loss = alt.Chart(losses).mark_line(point=True, color="#2ca02c").encode(
        x, alt.Y("value:Q", title="loss", scale=alt.Scale(zero=False)),
        tooltip=["step:Q", alt.Tooltip("value:Q", title="loss", format=",.4g")])
    times = frame[frame["measure"] == "time_s"]
    bottom = alt.Chart(times.assign(ms=times["value"] * 1e3)).mark_bar(color="#1f77b4").encode(
        x, alt.Y("ms:Q", title="step time (ms)"), tooltip=["step:Q", alt.Tooltip("ms:Q", format=",.1f")])
    return alt.vconcat(top.properties(width=width, height=height), loss.properties(width=width, height=90),
                       bottom.properties(width=width, height=70))
