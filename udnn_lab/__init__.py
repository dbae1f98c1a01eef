"""udnn_lab: how much GPU memory each step of training needs, where it goes, and how to make it fit.

The stages, in the order data flows through them (each a subpackage; see udnn_lab/README.md):
analysis (trace) -> graph (Graph, liveness, Plan IR) -> hardware, cost -> simulation ->
planning -> fitting, runtime, measurement -> frames -> charts -> widgets, report; sharing uses them all.

Every public name loads on first use: ``import udnn_lab`` costs no torch import, so the
``udnn-lab`` command answers ``--help`` at once and only the stage a command needs is loaded.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any

from udnn_lab.vocabulary import PACKAGE_VERSION

if TYPE_CHECKING:
    from udnn_lab import zoo as zoo
    from udnn_lab.analysis import trace as trace
    from udnn_lab.cost import CostModel as CostModel
    from udnn_lab.cost import Profile as Profile
    from udnn_lab.cost import RateCurve as RateCurve
    from udnn_lab.cost import profile as profile
    from udnn_lab.errors import (
        BudgetTooSmall as BudgetTooSmall,
    )
    from udnn_lab.errors import (
        FakeTensorUnsupported as FakeTensorUnsupported,
    )
    from udnn_lab.errors import (
        HardwareMismatchWarning as HardwareMismatchWarning,
    )
    from udnn_lab.errors import (
        HardwareProfileError as HardwareProfileError,
    )
    from udnn_lab.errors import (
        HostMemoryError as HostMemoryError,
    )
    from udnn_lab.errors import (
        LargeMeasurementWarning as LargeMeasurementWarning,
    )
    from udnn_lab.errors import (
        MissingDependency as MissingDependency,
    )
    from udnn_lab.errors import (
        ModelFactoryError as ModelFactoryError,
    )
    from udnn_lab.errors import (
        ModelInputError as ModelInputError,
    )
    from udnn_lab.errors import (
        PlanError as PlanError,
    )
    from udnn_lab.errors import (
        PlanInfeasible as PlanInfeasible,
    )
    from udnn_lab.errors import (
        PlanMismatch as PlanMismatch,
    )
    from udnn_lab.errors import (
        ShippedProfileWarning as ShippedProfileWarning,
    )
    from udnn_lab.errors import (
        SnapshotError as SnapshotError,
    )
    from udnn_lab.errors import (
        TraceMismatch as TraceMismatch,
    )
    from udnn_lab.errors import (
        UdnnLabError as UdnnLabError,
    )
    from udnn_lab.errors import (
        UnknownHardwareError as UnknownHardwareError,
    )
    from udnn_lab.errors import (
        UnknownModelError as UnknownModelError,
    )
    from udnn_lab.errors import (
        UnmeasuredFigureWarning as UnmeasuredFigureWarning,
    )
    from udnn_lab.fitting import (
        FitSearch as FitSearch,
    )
    from udnn_lab.fitting import (
        WorldSizeSearch as WorldSizeSearch,
    )
    from udnn_lab.fitting import (
        max_batch as max_batch,
    )
    from udnn_lab.fitting import (
        max_seq_len as max_seq_len,
    )
    from udnn_lab.fitting import (
        min_world_size as min_world_size,
    )
    from udnn_lab.fitting import (
        sweep as sweep,
    )
    from udnn_lab.graph import (
        Graph as Graph,
    )
    from udnn_lab.graph import (
        NetworkWide as NetworkWide,
    )
    from udnn_lab.graph import (
        Offload as Offload,
    )
    from udnn_lab.graph import (
        Plan as Plan,
    )
    from udnn_lab.graph import (
        Recompute as Recompute,
    )
    from udnn_lab.graph import (
        network_wide as network_wide,
    )
    from udnn_lab.hardware import Hardware as Hardware
    from udnn_lab.measurement import Measurement as Measurement
    from udnn_lab.measurement import load_snapshot as load_snapshot
    from udnn_lab.measurement import measure as measure
    from udnn_lab.measurement import write_cpu_snapshot as write_cpu_snapshot
    from udnn_lab.parallel import DDP as DDP
    from udnn_lab.parallel import FSDP as FSDP
    from udnn_lab.planning import min_budget as min_budget
    from udnn_lab.planning import plan as plan
    from udnn_lab.runtime import OffloadRuntime as OffloadRuntime
    from udnn_lab.runtime import Run as Run
    from udnn_lab.runtime import train as train
    from udnn_lab.simulation import (
        Simulation as Simulation,
    )
    from udnn_lab.simulation import (
        network_wide_saving as network_wide_saving,
    )
    from udnn_lab.simulation import (
        simulate as simulate,
    )
    from udnn_lab.units import (
        Bytes as Bytes,
    )
    from udnn_lab.units import (
        format_bytes as format_bytes,
    )
    from udnn_lab.units import (
        format_seconds as format_seconds,
    )
    from udnn_lab.units import (
        parse_bytes as parse_bytes,
    )
    from udnn_lab.widgets import MemoryLab as MemoryLab
    from udnn_lab.workload import Workload as Workload


def _homes() -> dict[str, str]:
    """Public name -> the module it lives in (a module's own name for the zoo), read from the imports under
    TYPE_CHECKING above: that block is the one list of public names, for type checkers and for this."""
    tree = ast.parse(Path(__file__).read_text(encoding="utf-8"))
    block = next(node for node in tree.body if isinstance(node, ast.If) and isinstance(node.test, ast.Name)
                 and node.test.id == "TYPE_CHECKING")
    homes = {}
    for node in block.body:
        if isinstance(node, ast.ImportFrom) and node.module:  # 'from udnn_lab.x import y as y', all there are
            for alias in node.names:
                homes[alias.asname or alias.name] = \
                    f"udnn_lab.{alias.name}" if node.module == "udnn_lab" else node.module
    return homes


_HOMES = _homes()
# what can be had without the runtime: nothing there measures or prices a machine
_WITHOUT_RUNTIME = ("udnn_lab.units", "udnn_lab.errors", "udnn_lab.workload", "udnn_lab.parallel", "udnn_lab.zoo",
                    "udnn_lab.vocabulary", "udnn_lab.devices", "udnn_lab.graph", "udnn_lab.charts")
__all__ = sorted(_HOMES)
__version__ = PACKAGE_VERSION


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None and not name.startswith("_") and importlib.util.find_spec(f"udnn_lab.{name}") is not None:
        home = f"udnn_lab.{name}"  # a subpackage or module, as ul.charts after import udnn_lab
    if home is None:
        raise AttributeError(f"module 'udnn_lab' has no attribute {name!r}")
    module = importlib.import_module(home)
    if not home.startswith(_WITHOUT_RUNTIME):  # its host probe registers with Hardware.measure (NOTE [host probes] 2)
        importlib.import_module("udnn_lab.runtime")
    value = module if home == f"udnn_lab.{name}" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
