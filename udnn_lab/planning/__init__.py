"""Planning: for a Graph and a budget, what to keep on the device, offload to host memory, or recompute.

Policies live one family per module (vdnn, pinning, segments, recompute, auto; optimal, the
exact reference, needs the [exact] extra) and register themselves in ``registry.POLICIES``;
``plan()``, ``min_budget()`` and ``sweep()`` search budgets with the simulator. Under a budget
the step already fits with every tensor kept, every policy keeps everything (the registry
applies that rule to each). May import: the Graph and Plan IR, cost, hardware, simulation,
the allocator model (a budget counted in reserved bytes), units and errors.
"""

# the policy modules register themselves on import, in this order
from udnn_lab.planning import vdnn, pinning, segments, recompute, auto, optimal  # noqa: F401, I001
from udnn_lab.graph.plan_ir import Offload, Plan, PlanError, Recompute
from udnn_lab.planning import host
from udnn_lab.planning.budget import (
    PlanInfeasible,
    check_within_device,
    floor_bytes,
    least_live_budget,
    min_budget,
    op_by_op,
    plan,
    sweep,
)
from udnn_lab.planning.floors import unlowered
from udnn_lab.planning.registry import POLICIES, policy, quick_policies

__all__ = ["Offload", "Plan", "PlanError", "PlanInfeasible", "Recompute", "POLICIES", "check_within_device",
           "floor_bytes", "host", "least_live_budget", "min_budget", "op_by_op", "plan", "policy", "quick_policies",
           "sweep", "unlowered"]
