"""Every policy, by name. Each is a function ``(graph, cost_model, budget) -> Plan``."""

from __future__ import annotations

from typing import Callable

from udnn_lab.cost import CostModel
from udnn_lab.graph import Graph
from udnn_lab.plan.auto import auto
from udnn_lab.plan.ir import Plan
from udnn_lab.plan.pinning import pin_dp, pin_greedy
from udnn_lab.plan.recompute import recompute
from udnn_lab.plan.vdnn import vdnn_all, vdnn_conv, vdnn_dyn, vdnn_plus_plus

Policy = Callable[[Graph, CostModel, "int | None"], Plan]


def keep_all(graph: Graph, cost: CostModel, budget: int | None) -> Plan:
    return Plan.keep_all(graph, budget)


POLICIES: dict[str, Policy] = {
    "keep-all": keep_all,
    "vdnn-all": vdnn_all,
    "vdnn-conv": vdnn_conv,
    "vdnn-dyn": vdnn_dyn,
    "vdnn++": vdnn_plus_plus,
    "pin-greedy": pin_greedy,
    "pin-dp": pin_dp,
    "recompute": recompute,
    "auto": auto,
}
