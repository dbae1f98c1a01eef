"""Tidy DataFrames -> altair charts, rendered without a CDN."""

from __future__ import annotations

import altair as alt
import pandas as pd

from udnn_lab.categories import CATEGORIES


def enable_offline() -> None:
    """Render charts in notebooks from JavaScript bundled with the package (no CDN, no network)."""
    alt.renderers.enable("jupyter", offline=True)


def memory_by_category(frame: pd.DataFrame, width: int = 720, height: int = 280) -> alt.Chart:
    """Stacked live bytes over the step, one band per category (from frames.memory_by_category)."""
    data = frame.assign(MiB=frame["bytes"] / 2**20)
    order = [c for c in CATEGORIES if c in set(data["category"])]
    return alt.Chart(data).mark_area().encode(
        x=alt.X("index:Q", title="op (forward, backward, optimizer)"),
        y=alt.Y("MiB:Q", stack=True, title="live MiB"),
        color=alt.Color("category:N", sort=order),
        tooltip=["index:Q", "phase:N", "module:N", "op:N", "category:N", alt.Tooltip("MiB:Q", format=".1f")],
    ).properties(width=width, height=height)


def predicted_vs_measured(frame: pd.DataFrame, width: int = 720, height: int = 280) -> alt.Chart:
    """Predicted against measured live bytes over the step (from frames.predicted_vs_measured)."""
    data = frame.assign(MiB=frame["bytes"] / 2**20)
    return alt.Chart(data).mark_line().encode(
        x=alt.X("index:Q", title="op"),
        y=alt.Y("MiB:Q", title="live MiB"),
        color=alt.Color("series:N", sort=["predicted", "measured"]),
        strokeDash=alt.StrokeDash("series:N", sort=["predicted", "measured"]),
        tooltip=["index:Q", "phase:N", "module:N", "op:N", "series:N", alt.Tooltip("MiB:Q", format=".1f")],
    ).properties(width=width, height=height)
