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
from udnn_lab.frames.snapshot_overlay import (  # noqa: F401
    DIFFERENCE_COLUMNS,
    PEAK_PART_COLUMNS,
    SNAPSHOT_TIMELINE_COLUMNS,
    SnapshotOverlay,
    snapshot_overlay,
)

__all__ = [
    "DEFAULT_POINTS", "DIFFERENCE_COLUMNS", "LANES", "LIVE_TENSOR_COLUMNS", "PEAK_PART_COLUMNS", "PLAN_REASON_COLUMNS",
    "SNAPSHOT_TIMELINE_COLUMNS", "STALL_KINDS", "SnapshotOverlay", "TIMELINE_FRAME_COLUMNS", "TRAINING_COLUMNS",
    "bandwidth", "budget_sweep", "downsample", "layers", "live_tensors", "memory_by_category", "memory_curve",
    "plan_reasons", "predicted_vs_measured", "savings", "simulations", "snapshot_overlay", "timeline", "training",
]
