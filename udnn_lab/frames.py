"""Graphs, measurements and simulations -> tidy DataFrames for charts (one row per observation)."""

from __future__ import annotations

import pandas as pd

from udnn_lab.categories import CATEGORIES
from udnn_lab.graph import Graph
from udnn_lab.measure import Measurement

_KEYS = ["index", "phase", "module", "op"]


def memory_by_category(graph: Graph) -> pd.DataFrame:
    """Predicted live bytes per op and category: columns index, phase, module, op, category, bytes."""
    curve = graph.memory_curve()
    present = [c for c in CATEGORIES if curve[c].any()]
    return curve.melt(id_vars=_KEYS, value_vars=present, var_name="category", value_name="bytes")


def predicted_vs_measured(graph: Graph, measurement: Measurement) -> pd.DataFrame:
    """Predicted and measured live bytes per op: columns index, phase, module, op, series, bytes."""
    frame = measurement.compare(graph).rename(columns={"predicted_bytes": "predicted", "measured_bytes": "measured"})
    return frame.melt(id_vars=_KEYS, value_vars=["predicted", "measured"], var_name="series", value_name="bytes")
