"""A local search from the plan auto chose: drop what is no longer needed, replace what costs most.

The greedy chooses at the peak, one tensor at a time; a choice made early may be needed no
longer once later ones are made, and a dear one (a long recomputation, a copy the compute does
not hide) may be replaceable by what the greedy picks when it is not there. From the fastest
plan that fits, each round first drops the first action without which the plan still fits and
is faster; else, for the ``TRIES`` actions whose removal saves the most time, it completes the
plan without that action by the greedy (recomputes only, then with offloads) and keeps the first
completion that fits and is faster. It stops when a round finds nothing, or when the simulations
have covered ``OP_SIMULATIONS`` ops (a bound in work, not seconds: the same plan on every machine).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from udnn_lab.cost.model import CostModel
from udnn_lab.graph.plan_ir import Offload, Plan, Recompute
from udnn_lab.graph.step_graph import Graph
from udnn_lab.planning.host import plan_host_bytes
from udnn_lab.planning.vdnn import pinned_pool_bytes
from udnn_lab.simulation.simulator import simulate_with

TRIES = 8  # actions replaced per round, dearest first
OP_SIMULATIONS = 400_000  # ops simulated in all: about 800 simulations of ResNet-50's 473-op step
LOCAL_SEARCH = "then local search"  # appended to the chosen plan's name when the search improved it

# (base, offloads allowed) -> the greedy's completion of base
Complete = Callable[[Plan, bool], Plan]
_Saving = tuple[float, int, Offload | Recompute]  # (the step's seconds saved without the action, -its place, it)


def improved(graph: Graph, cost: CostModel, plan: Plan, step_s: float, complete: Complete,
             host_budget: int | None = None) -> Plan:
    """``plan`` (simulated at ``step_s``, fitting), or a faster one that fits found from it (module docstring);
    with ``host_budget``, only plans whose offloads take at most that much host memory."""
    search = _Search(graph, cost, host_budget)
    start = plan
    while search.work_left():
        found, savings = search.dropped(plan, step_s)
        found = found or search.replaced(plan, step_s, savings, complete)
        if found is None:
            break
        plan, step_s = found
    if plan is start:
        return plan
    name = start.chosen_policy or start.policy
    return replace(plan, policy=f"{name}, {LOCAL_SEARCH}", chosen_policy="")


class _Search:
    def __init__(self, graph: Graph, cost: CostModel, host_budget: int | None) -> None:
        self.graph, self.cost, self.host_budget = graph, cost, host_budget
        self.ops_simulated = 0

    def work_left(self) -> bool:
        return self.ops_simulated < OP_SIMULATIONS

    def step_s(self, plan: Plan) -> float | None:
        """The simulated step of a plan that fits (and keeps within the host budget), else None."""
        if not self._within_host(plan):
            return None
        self.ops_simulated += len(self.graph.ops)
        sim = simulate_with(self.graph, plan, self.cost)
        return sim.step_time_s if sim.fits else None

    def dropped(self, plan: Plan, step_s: float) -> tuple[tuple[Plan, float] | None, list[_Saving]]:
        """The plan without its first action that it is faster without and still fits (or None), and what the step
        saved without each action tried before it, fitting or not (for ``replaced``)."""
        savings: list[_Saving] = []
        actions: list[Offload | Recompute] = [*plan.offloads, *plan.recomputes]
        for index, action in enumerate(actions):
            if not self.work_left():
                return None, savings
            smaller = _without(self.graph, plan, action)
            self.ops_simulated += len(self.graph.ops)
            sim = simulate_with(self.graph, smaller, self.cost)
            if sim.fits and sim.step_time_s < step_s and self._within_host(smaller):
                return (smaller, sim.step_time_s), savings
            savings.append((step_s - sim.step_time_s, -index, action))
        return None, savings

    def replaced(self, plan: Plan, step_s: float, savings: list[_Saving],
                 complete: Complete) -> tuple[Plan, float] | None:
        """The first completion, without one of the dearest actions, that fits and is faster."""
        for _, _, action in sorted(savings, key=lambda s: s[:2], reverse=True)[:TRIES]:
            base = replace(_without(self.graph, plan, action), policy=plan.chosen_policy or plan.policy)
            for offloads in (False, True):
                if not self.work_left():
                    return None
                completed = complete(base, offloads)
                completed_s = self.step_s(completed)
                if completed_s is not None and completed_s < step_s:
                    return completed, completed_s
        return None

    def _within_host(self, plan: Plan) -> bool:
        return self.host_budget is None or not plan.offloads or plan_host_bytes(self.graph, plan) <= self.host_budget


def _without(graph: Graph, plan: Plan, action: Offload | Recompute) -> Plan:
    offloads = tuple(o for o in plan.offloads if o is not action)
    if len(offloads) == len(plan.offloads):
        return replace(plan, recomputes=tuple(r for r in plan.recomputes if r is not action))
    return replace(plan, offloads=offloads, pinned_pool_bytes=pinned_pool_bytes(graph, offloads))
