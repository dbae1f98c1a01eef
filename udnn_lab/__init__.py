"""udnn_lab: how much GPU memory each step of training needs, where it goes, and how to make it fit."""

from udnn_lab import zoo
from udnn_lab.errors import (
    FakeTensorUnsupported,
    MissingDependency,
    ModelInputError,
    TraceMismatch,
    UdnnLabError,
    UnknownModelError,
)
from udnn_lab.graph import Graph
from udnn_lab.hardware import Hardware, HardwareMismatchWarning, HardwareProfileError, UnknownHardwareError
from udnn_lab.cost import CostModel, RateCurve
from udnn_lab.measure import Measurement, measure
from udnn_lab.plan import Offload, Plan, PlanError, Recompute
from udnn_lab.plan.budget import PlanInfeasible, min_budget, plan, sweep
from udnn_lab.profile import Profile, profile
from udnn_lab.runtime import HostMemoryError, OffloadRuntime, PlanMismatch, Run, train
from udnn_lab.simulate import Simulation, simulate
from udnn_lab.trace import trace
from udnn_lab.units import format_bytes, format_seconds, parse_bytes
from udnn_lab.workload import Workload

__all__ = [
    "CostModel", "FakeTensorUnsupported", "Graph", "Hardware", "HardwareMismatchWarning", "HardwareProfileError",
    "HostMemoryError", "Measurement", "MemoryLab", "MissingDependency", "ModelInputError", "Offload",
    "OffloadRuntime", "Plan", "PlanError", "PlanInfeasible", "PlanMismatch", "Profile", "RateCurve", "Recompute",
    "Run", "Simulation", "TraceMismatch", "UdnnLabError", "UnknownHardwareError", "UnknownModelError", "Workload",
    "format_bytes", "format_seconds", "measure", "min_budget", "parse_bytes", "plan", "profile", "simulate", "sweep",
    "trace", "train", "zoo",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "MemoryLab":  # the app pulls in altair and ipywidgets (seconds to import): loaded on first use
        from udnn_lab.widgets import MemoryLab

        return MemoryLab
    raise AttributeError(f"module 'udnn_lab' has no attribute {name!r}")
