"""Every policy, by name: a policy module registers each of its functions with ``@policy("name")``.

A policy is a function ``(graph, cost_model, budget) -> Plan``; the registry keeps them in
the order they were registered (the order of the imports in ``udnn_lab.planning``).

One rule holds for every policy, so it lives here: a budget the step already fits with
every tensor kept needs no plan. Under such a budget each policy keeps everything (its
name stays on the plan); a policy's own behaviour starts below the keep-all peak. Without
a budget (None) a policy plans as it would under any budget (vDNN_all offloads every
layer's input, as in the paper, and min_budget reads its floor from that plan).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from udnn_lab.cost.model import CostModel
from udnn_lab.graph.plan_ir import Plan
from udnn_lab.graph.step_graph import Graph
from udnn_lab.simulation.simulator import simulate_with

Policy = Callable[[Graph, CostModel, "int | None"], Plan]

POLICIES: dict[str, Policy] = {}
SOLVER_POLICIES: set[str] = set()  # policies that run a solver for up to a minute: left out where many plans are made
CHOOSING_POLICIES: set[str] = set()  # policies that pick one of the others' plans (Plan.chosen_policy names it)


def quick_policies() -> tuple[str, ...]:
    """The policies that plan in seconds at most: what sweeps and MemoryLab offer by default."""
    return tuple(name for name in POLICIES if name not in SOLVER_POLICIES)


def policy(name: str, solver: bool = False, chooses: bool = False) -> Callable[[Policy], Policy]:
    """Register the decorated function as the policy ``name`` (a name is taken once), keeping everything under a
    budget the keep-all step fits. ``solver``: it runs a solver that may take a minute (see quick_policies).
    ``chooses``: it picks among the other policies' plans, and says which in ``Plan.chosen_policy``."""
    def register(function: Policy) -> Policy:
        if name in POLICIES:
            raise ValueError(f"policy {name!r} is registered twice: by {POLICIES[name].__module__}."
                             f"{POLICIES[name].__qualname__} and by {function.__module__}.{function.__qualname__}")

        @functools.wraps(function)
        def planned(graph: Graph, cost: CostModel, budget: int | None) -> Plan:
            if budget is not None and keep_all_peak(graph, cost) <= budget:
                return Plan(name, graph.fingerprint, budget, notes=(f"{KEPT_NOTE}: nothing to move",),
                            chosen_policy="keep-all" if chooses else "")
            return function(graph, cost, budget)

        POLICIES[name] = planned
        if solver:
            SOLVER_POLICIES.add(name)
        if chooses:
            CHOOSING_POLICIES.add(name)
        return planned
    return register


KEPT_NOTE = "the step fits the budget with every tensor kept"


def keep_all_peak(graph: Graph, cost: CostModel) -> int:
    """The simulated peak with every tensor kept, as the budget counts it (512-byte blocks on CUDA)."""
    return simulate_with(graph, Plan.keep_all(graph), cost).peak_bytes


@policy("keep-all")
def keep_all(graph: Graph, cost: CostModel, budget: int | None) -> Plan:
    return Plan.keep_all(graph, budget)
