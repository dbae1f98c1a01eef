"""Plans: what to keep on the device, offload to host memory, or recompute.

``ir`` holds the plan itself; the policies (vdnn, pinning, recompute, auto) and
``plan()`` / ``min_budget()`` / ``sweep()`` are loaded on first use, since they simulate
and the simulator reads plans.
"""

from udnn_lab.plan.ir import Offload, Plan, PlanError, Recompute

__all__ = ["Offload", "Plan", "PlanError", "PlanInfeasible", "Recompute", "POLICIES", "min_budget", "plan", "sweep"]


def __getattr__(name: str):
    if name in ("plan", "min_budget", "sweep", "PlanInfeasible"):
        from udnn_lab.plan import budget

        return getattr(budget, name)
    if name == "POLICIES":
        from udnn_lab.plan.policies import POLICIES

        return POLICIES
    raise AttributeError(f"module 'udnn_lab.plan' has no attribute {name!r}")
