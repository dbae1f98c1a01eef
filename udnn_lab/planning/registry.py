"""Every policy, by name: a policy module registers each of its functions with ``@policy("name")``.

A policy is a function ``(graph, cost_model, budget) -> Plan``; the registry keeps them in
the order they were registered (the order of the imports in ``udnn_lab.planning``).
"""

from __future__ import annotations

from collections.abc import Callable

from udnn_lab.cost.model import CostModel
from udnn_lab.graph.plan_ir import Plan
from udnn_lab.graph.step_graph import Graph

Policy = Callable[[Graph, CostModel, "int | None"], Plan]

POLICIES: dict[str, Policy] = {}


def policy(name: str) -> Callable[[Policy], Policy]:
    """Register the decorated function as the policy ``name``; a name is taken once."""
    def register(function: Policy) -> Policy:
        if name in POLICIES:
            raise ValueError(f"policy {name!r} is registered twice: by {POLICIES[name].__module__}."
                             f"{POLICIES[name].__qualname__} and by {function.__module__}.{function.__qualname__}")
        POLICIES[name] = function
        return function
    return register


@policy("keep-all")
def keep_all(graph: Graph, cost: CostModel, budget: int | None) -> Plan:
    return Plan.keep_all(graph, budget)
