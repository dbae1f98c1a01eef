"""Charts (altair) drawn from the tidy frames of ``udnn_lab.frames``, rendered offline.

May import: frames' column names and the vocabulary; never a Graph, Plan or Simulation."""

from udnn_lab.charts.memory import (  # noqa: F401
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

__all__ = [
    "bandwidth", "batch_sweep", "budget_sweep", "enable_offline", "layer_bars", "memory_by_category",
    "memory_curve", "policy_savings", "predicted_vs_measured", "save", "step_times", "timeline", "training",
]
