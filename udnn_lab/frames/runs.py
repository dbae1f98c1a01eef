"""A managed training run (or its rows so far) -> a tidy frame: one row per step and measure."""

from __future__ import annotations

from collections.abc import Iterable

import pandas as pd

TRAINING_COLUMNS = ["step", "measure", "value"]
_MEASURES = ("peak_bytes", "time_s", "loss")


def training(rows: pd.DataFrame | Iterable[dict]) -> pd.DataFrame:
    """Steps of a Run (``run.steps``) or the rows a training callback has seen: step, measure, value."""
    frame = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows))
    if frame.empty:
        return pd.DataFrame(columns=TRAINING_COLUMNS)
    present = [m for m in _MEASURES if m in frame.columns]
    return frame.melt(id_vars=["step"], value_vars=present, var_name="measure", value_name="value")
