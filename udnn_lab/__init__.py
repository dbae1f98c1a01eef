"""udnn_lab: how much GPU memory each step of training needs, where it goes, and how to make it fit.

The stages, in the order data flows through them (each a subpackage; see udnn_lab/README.md):
analysis (trace) -> graph (Graph, liveness, Plan IR) -> hardware, cost -> simulation ->
planning -> runtime, measurement -> frames -> charts -> widgets, report; sharing uses them all.
"""

from udnn_lab import zoo
from udnn_lab.analysis import trace
from udnn_lab.cost import CostModel, Profile, RateCurve, profile
from udnn_lab.errors import (
    FakeTensorUnsupported,
    HardwareMismatchWarning,
    HardwareProfileError,
    HostMemoryError,
    LargeMeasurementWarning,
    MissingDependency,
    ModelInputError,
    PlanError,
    PlanInfeasible,
    PlanMismatch,
    TraceMismatch,
    UdnnLabError,
    UnknownHardwareError,
    UnknownModelError,
)
from udnn_lab.graph import Graph, Offload, Plan, Recompute
from udnn_lab.hardware import Hardware
from udnn_lab.measurement import Measurement, measure
from udnn_lab.planning import min_budget, plan, sweep
from udnn_lab.runtime import OffloadRuntime, Run, train
from udnn_lab.simulation import Simulation, simulate
from udnn_lab.units import format_bytes, format_seconds, parse_bytes
from udnn_lab.workload import Workload

__all__ = [
    "CostModel", "FakeTensorUnsupported", "Graph", "Hardware", "HardwareMismatchWarning", "HardwareProfileError",
    "HostMemoryError", "LargeMeasurementWarning", "Measurement", "MemoryLab", "MissingDependency", "ModelInputError",
    "Offload",
    "OffloadRuntime", "Plan", "PlanError", "PlanInfeasible", "PlanMismatch", "Profile", "RateCurve", "Recompute",
    "Run", "Simulation", "TraceMismatch", "UdnnLabError", "UnknownHardwareError", "UnknownModelError", "Workload",
    "format_bytes", "format_seconds", "measure", "min_budget", "parse_bytes", "plan", "profile", "simulate", "sweep",
    "trace", "train", "zoo",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "MemoryLab":
        # heavy: the app pulls in altair and ipywidgets (seconds to import), so it loads on first use
        from udnn_lab.widgets import MemoryLab

        return MemoryLab
    raise AttributeError(f"module 'udnn_lab' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
