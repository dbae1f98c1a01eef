"""The runtime: carry a Plan out around a training step, and managed training."""

from udnn_lab.runtime.offload import OffloadRuntime, PlanMismatch, StepStats
from udnn_lab.runtime.pinned_pool import HostMemoryError
from udnn_lab.runtime.training import Run, train

__all__ = ["HostMemoryError", "OffloadRuntime", "PlanMismatch", "Run", "StepStats", "train"]
