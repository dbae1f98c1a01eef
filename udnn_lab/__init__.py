"""udnn_lab: how much GPU memory each step of training needs, where it goes, and how to make it fit.

The stages, in the order data flows through them (each a subpackage; see udnn_lab/README.md):
analysis (trace) -> graph (Graph, liveness, Plan IR) -> hardware, cost -> simulation ->
planning -> fitting, runtime, measurement -> frames -> charts -> widgets, report; sharing uses them all.

Every public name loads on first use: ``import udnn_lab`` costs no torch import, so the
``udnn-lab`` command answers ``--help`` at once and only the stage a command needs is loaded.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from udnn_lab import zoo
    from udnn_lab.analysis import trace
    from udnn_lab.cost import CostModel, Profile, RateCurve, profile
    from udnn_lab.errors import (
        BudgetTooSmall,
        FakeTensorUnsupported,
        HardwareMismatchWarning,
        HardwareProfileError,
        HostMemoryError,
        LargeMeasurementWarning,
        MissingDependency,
        ModelFactoryError,
        ModelInputError,
        PlanError,
        PlanInfeasible,
        PlanMismatch,
        ShippedProfileWarning,
        TraceMismatch,
        UdnnLabError,
        UnknownHardwareError,
        UnknownModelError,
    )
    from udnn_lab.fitting import FitSearch, WorldSizeSearch, max_batch, max_seq_len, min_world_size, sweep
    from udnn_lab.graph import Graph, NetworkWide, Offload, Plan, Recompute, network_wide
    from udnn_lab.hardware import Hardware
    from udnn_lab.measurement import Measurement, measure
    from udnn_lab.parallel import DDP, FSDP
    from udnn_lab.planning import min_budget, plan
    from udnn_lab.runtime import OffloadRuntime, Run, train
    from udnn_lab.simulation import Simulation, network_wide_saving, simulate
    from udnn_lab.units import Bytes, format_bytes, format_seconds, parse_bytes
    from udnn_lab.widgets import MemoryLab
    from udnn_lab.workload import Workload

# public name -> the module it lives in (a module's own name for the zoo)
_HOMES = {
    "zoo": "udnn_lab.zoo", "trace": "udnn_lab.analysis",
    **dict.fromkeys(["CostModel", "Profile", "RateCurve", "profile"], "udnn_lab.cost"),
    **dict.fromkeys(["FakeTensorUnsupported", "HardwareMismatchWarning", "HardwareProfileError", "HostMemoryError",
                     "LargeMeasurementWarning", "MissingDependency", "ModelFactoryError", "ModelInputError",
                     "PlanError", "PlanInfeasible", "PlanMismatch", "ShippedProfileWarning", "TraceMismatch",
                     "UdnnLabError", "UnknownHardwareError", "UnknownModelError"], "udnn_lab.errors"),
    **dict.fromkeys(["Graph", "NetworkWide", "Offload", "Plan", "Recompute", "network_wide"], "udnn_lab.graph"),
    **dict.fromkeys(["FitSearch", "WorldSizeSearch", "max_batch", "max_seq_len", "min_world_size", "sweep"],
                    "udnn_lab.fitting"),
    "BudgetTooSmall": "udnn_lab.errors",
    "Hardware": "udnn_lab.hardware",
    **dict.fromkeys(["Measurement", "measure"], "udnn_lab.measurement"),
    **dict.fromkeys(["DDP", "FSDP"], "udnn_lab.parallel"),
    **dict.fromkeys(["min_budget", "plan"], "udnn_lab.planning"),
    **dict.fromkeys(["OffloadRuntime", "Run", "train"], "udnn_lab.runtime"),
    **dict.fromkeys(["Simulation", "network_wide_saving", "simulate"], "udnn_lab.simulation"),
    **dict.fromkeys(["Bytes", "format_bytes", "format_seconds", "parse_bytes"], "udnn_lab.units"),
    "MemoryLab": "udnn_lab.widgets",  # the app pulls in altair and ipywidgets
    "Workload": "udnn_lab.workload",
}

__all__ = [
    "Bytes", "CostModel", "FakeTensorUnsupported", "Graph", "Hardware", "HardwareMismatchWarning",
    "HardwareProfileError", "HostMemoryError", "LargeMeasurementWarning", "Measurement", "MemoryLab",
    "MissingDependency", "ModelFactoryError", "ModelInputError", "NetworkWide", "Offload", "OffloadRuntime", "Plan",
    "PlanError", "PlanInfeasible", "PlanMismatch", "Profile", "RateCurve", "Recompute", "Run",
    "ShippedProfileWarning", "Simulation", "TraceMismatch", "UdnnLabError", "UnknownHardwareError",
    "UnknownModelError", "Workload", "format_bytes", "format_seconds", "measure", "min_budget", "network_wide",
    "network_wide_saving", "parse_bytes", "plan",
    "profile", "simulate", "sweep", "trace", "train", "zoo",
    "BudgetTooSmall", "FitSearch", "max_batch", "max_seq_len", "DDP", "FSDP", "WorldSizeSearch", "min_world_size",
]
assert sorted(__all__) == sorted(_HOMES), "every public name has a home, and only those"
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None and not name.startswith("_") and importlib.util.find_spec(f"udnn_lab.{name}") is not None:
        home = f"udnn_lab.{name}"  # a subpackage or module, as ul.charts after import udnn_lab
    if home is None:
        raise AttributeError(f"module 'udnn_lab' has no attribute {name!r}")
    module = importlib.import_module(home)
    value = module if home == f"udnn_lab.{name}" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
