"""Tidy DataFrames of every stage, the one input of the charts and the widgets.

May import: the stages' result types (Graph, Simulation, Measurement, Profile, Hardware)."""

from udnn_lab.frames.drill import LIVE_TENSOR_COLUMNS, live_tensors  # noqa: F401
from udnn_lab.frames.memory import (  # noqa: F401
    DEFAULT_POINTS,
    LANES,
    STALL_KINDS,
    TIMELINE_FRAME_COLUMNS,
    TRAINING_COLUMNS,
    bandwidth,
    budget_sweep,
    downsample,
    layers,
    memory_by_category,
    memory_curve,
    predicted_vs_measured,
    savings,
    simulations,
    timeline,
    training,
)
from udnn_lab.frames.plan_reasons import PLAN_REASON_COLUMNS, plan_reasons  # noqa: F401

__all__ = [
    "DEFAULT_POINTS", "LANES", "LIVE_TENSOR_COLUMNS", "PLAN_REASON_COLUMNS", "STALL_KINDS", "TIMELINE_FRAME_COLUMNS",
    "TRAINING_COLUMNS", "bandwidth", "budget_sweep", "downsample", "layers", "live_tensors", "memory_by_category",
    "memory_curve", "plan_reasons", "predicted_vs_measured", "savings", "simulations", "timeline", "training",
]
