"""Charts (altair) drawn from the tidy frames of ``udnn_lab.frames``, rendered offline.

May import: frames' column names and the vocabulary; never a Graph, Plan or Simulation."""

from udnn_lab.charts.fits import breakdown_bars, by_world_size, peak_by_size  # noqa: F401
from udnn_lab.charts.linked import OP_RANGE, TIME_RANGE, linked_memory_and_streams  # noqa: F401
from udnn_lab.charts.memory import (  # noqa: F401
    OP_SELECTION,
    bandwidth,
    batch_sweep,
    budget_sweep,
    enable_offline,
    layer_bars,
    memory_by_category,
    memory_curve,
    policy_savings,
    predicted_vs_measured,
    save,
    step_times,
    timeline,
    training,
)
from udnn_lab.charts.snapshot_overlay import snapshot_overlay  # noqa: F401

__all__ = [
    "OP_RANGE", "OP_SELECTION", "TIME_RANGE", "bandwidth", "batch_sweep", "breakdown_bars",
    "budget_sweep", "by_world_size", "enable_offline", "layer_bars", "linked_memory_and_streams", "memory_by_category",
    "memory_curve", "peak_by_size", "policy_savings", "predicted_vs_measured", "save", "snapshot_overlay", "step_times",
    "timeline", "training",
]
