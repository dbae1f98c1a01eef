"""Charts of the co-training study, from its tidy frames (altair)."""

from __future__ import annotations

import altair as alt
import pandas as pd

from udnn_lab.charts.base import check_columns


def degradation_heatmap(result_or_frame, width: int = 320,
                        height: int = 320) -> alt.LayerChart | alt.FacetChart:
    """r_AB as a heatmap: job A in rows, partner B in columns, 1 (no slowdown) white, worse redder.

    Takes a StudyResult or its ``degradation()`` frame (job, partner, r)."""
    frame = result_or_frame.degradation() if hasattr(result_or_frame, "degradation") else result_or_frame
    check_columns(frame, ["job", "partner", "r"], "StudyResult.degradation()")
    names = _order(frame)
    top = max(2.0, float(frame["r"].max()) if len(frame) else 2.0)
    color = alt.Color("r:Q", title="r_AB", scale=alt.Scale(domain=[1.0, top], scheme="reds", clamp=True))
    return _heatmap(frame, "r", "r_AB: A's iteration time shared with B / alone (larger is worse)", names, color,
                    width, height, "A (slowed)", "B (partner)")


def jaccard_heatmap(result, width: int = 320, height: int = 320) -> alt.LayerChart | alt.FacetChart:
    """Q3: normalized Jaccard similarity of the jobs' operator mixes (1: the same mix)."""
    matrix = result.jaccard()
    frame = matrix.stack().rename("similarity").reset_index() if len(matrix) else \
        pd.DataFrame(columns=["job", "partner", "similarity"])
    color = alt.Color("similarity:Q", scale=alt.Scale(domain=[0, 1], scheme="blues"))
    return _heatmap(frame, "similarity", "operator-mix similarity (normalized Jaccard)", list(matrix.index), color,
                    width, height, "job", "job")


def _heatmap(frame: pd.DataFrame, value: str, title: str, names: list[str], color, width: int, height: int,
             y_title: str, x_title: str) -> alt.LayerChart | alt.FacetChart:
    base = alt.Chart(frame).encode(x=alt.X("partner:N", sort=names, title=x_title),
                                   y=alt.Y("job:N", sort=names, title=y_title))
    cells = base.mark_rect(stroke="white").encode(color=color, tooltip=["job:N", "partner:N",
                                                                        alt.Tooltip(f"{value}:Q", format=".3f")])
    labels = base.mark_text(fontSize=12).encode(text=alt.Text(f"{value}:Q", format=".2f"))
    return alt.layer(cells, labels).properties(width=width, height=height, title=title)


def q1_chart(result, width: int = 520, height: int = 260, uncapped_at: float = 1.2) -> alt.Chart:
    """Q1: median step time against the memory cap, one line per job. The cap is a fraction of the job's
    need (its predicted peak plus allocator overhead), so every job shares the axis; uncapped is drawn
    at ``uncapped_at``."""
    frame = result.q1_summary()
    check_columns(frame, ["job", "cap", "cap_bytes", "median_time_s", "slowdown"], "StudyResult.q1_summary()")
    need = result.jobs.set_index("job")["need_bytes"]
    frame = frame[frame["oom"].isna()].copy()
    frame["of_need"] = (frame["cap_bytes"].astype(float) / frame["job"].map(need).astype(float)).fillna(uncapped_at)
    frame["cap_mib"] = frame["cap_bytes"].astype(float) / 2**20
    frame["step_ms"] = frame["median_time_s"] * 1e3
    return alt.Chart(frame).mark_line(point=True).encode(
        x=alt.X("of_need:Q", title=f"memory cap / the job's need (uncapped drawn at {uncapped_at:g})",
                scale=alt.Scale(zero=False)),
        y=alt.Y("slowdown:Q", title="median step / uncapped", scale=alt.Scale(zero=False)),
        color=alt.Color("job:N"),
        tooltip=["job:N", "cap:N", alt.Tooltip("cap_mib:Q", format=",.1f"), alt.Tooltip("step_ms:Q", format=".2f"),
                 "policy:N", alt.Tooltip("slowdown:Q", format=".3f")],
    ).properties(width=width, height=height, title="Q1: step time against the memory cap")


def op_mix_chart(result, top: int = 8, width: int = 520, height: int = 200) -> alt.Chart:
    """Q3: each job's share of step time per op type (the ``top`` largest overall, the rest as 'other')."""
    frame = result.op_mix.copy()
    check_columns(frame, ["job", "op", "share"], "StudyResult.op_mix")
    keep = frame.groupby("op")["share"].sum().nlargest(top).index
    frame["op"] = frame["op"].where(frame["op"].isin(keep), "other")
    frame = frame.groupby(["job", "op"], as_index=False)["share"].sum()
    return alt.Chart(frame).mark_bar().encode(
        x=alt.X("share:Q", stack="normalize", title="share of the step's op time", axis=alt.Axis(format="%")),
        y=alt.Y("job:N"), color=alt.Color("op:N", title="op type"),
        tooltip=["job:N", "op:N", alt.Tooltip("share:Q", format=".1%")],
    ).properties(width=width, height=height, title="Q3: operator mix")


def signals_chart(result, signal: str = "device_busy_percent", width: int = 120, height: int = 160,
                  columns: int = 3) -> alt.FacetChart:
    """Q4: a signal's samples alone and shared, one box per window, one panel per pair."""
    frame = result.samples
    check_columns(frame, ["pair", "window", "subject", "signal", "value"], "StudyResult.samples")
    frame = frame[frame["signal"] == signal].assign(
        label=lambda f: f["window"].where(f["window"] == "shared", "alone: " + f["subject"]))
    return alt.Chart(frame).mark_boxplot().encode(
        x=alt.X("label:N", title=None), y=alt.Y("value:Q", title=signal), color=alt.Color("window:N"),
    ).properties(width=width, height=height).facet(
        facet=alt.Facet("pair:N", title=f"Q4: {signal}, alone and shared"), columns=columns,
    ).resolve_scale(x="independent")


def repeat_chart(frame: pd.DataFrame, tolerance: float = 0.10, width: int = 300,
                 height: int = 300) -> alt.LayerChart | alt.FacetChart:
    """Two runs of one study: each r of the second against the first, with the band where they agree
    within ``tolerance``. Takes sharing.compare_runs(...)."""
    check_columns(frame, ["job", "partner", "run1", "run2", "relative_spread"], "sharing.compare_runs(results)")
    frame = frame.assign(label=frame["job"] + " with " + frame["partner"],
                         agrees=frame["relative_spread"] <= tolerance)
    values = frame[["run1", "run2"]].to_numpy().ravel()
    low, high = (0.9 * float(values.min()), 1.1 * float(values.max())) if len(frame) else (0.0, 1.0)
    grid = pd.DataFrame({"run1": [low, high]}).assign(equal=lambda f: f["run1"],
                                                      upper=lambda f: f["run1"] * (1 + tolerance),
                                                      lower=lambda f: f["run1"] / (1 + tolerance))
    scale = alt.Scale(domain=[low, high])
    band = alt.Chart(grid).mark_area(opacity=0.15, color="gray", clip=True).encode(
        x=alt.X("run1:Q", scale=scale, title="r, run 1"), y=alt.Y("lower:Q", scale=scale, title="r, run 2"),
        y2="upper:Q")
    diagonal = alt.Chart(grid).mark_line(color="gray", clip=True).encode(x="run1:Q", y="equal:Q")
    points = alt.Chart(frame).mark_point(filled=True, size=70).encode(
        x="run1:Q", y="run2:Q", shape=alt.Shape("agrees:N", title=f"within {tolerance:.0%}"),
        color=alt.Color("job:N"),
        tooltip=["label:N", alt.Tooltip("run1:Q", format=".3f"), alt.Tooltip("run2:Q", format=".3f"),
                 alt.Tooltip("relative_spread:Q", format=".1%")])
    return alt.layer(band, diagonal, points).properties(
        width=width, height=height, title=f"r_AB in two runs (band: within {tolerance:.0%})")


def _order(frame: pd.DataFrame) -> list[str]:
    return list(dict.fromkeys(list(frame["job"]) + list(frame["partner"])))
