"""Recomputation that spends only what the budget asks for.

Under a budget, saved tensors are dropped one at a time, cheapest first: at the op where
the estimated curve peaks, the tensor away there that costs the least recompute time per
byte freed (``_rebuild.cheapest_first``); the plan takes the shortest prefix of that order
that the simulator says fits. At the keep-all peak that is nothing, and a larger budget
never recomputes more. Tensor by tensor, a tensor another rebuild reads must stay; below
what that reaches, segment checkpointing (segments rebuild from their checkpoints) goes
lower, so its plans compete too and the fastest that fits wins. Without a budget the plan
is the one with the least peak: the least memory recompute reaches.
"""

from __future__ import annotations

from dataclasses import replace

from udnn_lab.cost.model import CostModel
from udnn_lab.graph.plan_ir import Plan
from udnn_lab.graph.step_graph import Graph
from udnn_lab.planning._rebuild import Rebuild, cheapest_first
from udnn_lab.planning.registry import policy
from udnn_lab.planning.segments import checkpoint_segments, segment_plans
from udnn_lab.simulation.simulator import simulate_with

NAME = "recompute"


@policy(NAME)
def recompute(graph: Graph, cost: CostModel, budget: int | None) -> Plan:
    order, _ = cheapest_first(graph, cost)
    segments = checkpoint_segments(graph, cost, budget)  # as registered: its simulations are already in the memo
    if budget is not None:
        shortest = _shortest_fitting(graph, cost, budget)
        fitting = [p for p in (shortest, segments) if p is not None and simulate_with(graph, p, cost).fits]
        if fitting:
            return _named(min(fitting, key=lambda p: (simulate_with(graph, p, cost).step_time_s, _actions(p))))
    # the least peak; on a tie, today's sqrt(n) segments (the first), which recompute all they can
    plans = [replace(checkpoint_segments(graph, cost, None), budget_bytes=budget),
             _dropping(graph, order, len(order), budget), *segment_plans(graph, budget)]
    return _named(min(plans, key=lambda p: simulate_with(graph, p, cost).peak_bytes))


def _shortest_fitting(graph: Graph, cost: CostModel, budget: int) -> Plan | None:
    """The shortest prefix of the cheapest-first order that fits, by bisection from the estimate's guess
    (the estimate is optimistic: fewer drops than it asks for do not fit)."""
    order, peaks = cheapest_first(graph, cost)
    low = next((k for k, peak in enumerate(peaks) if peak <= budget), len(order))

    def fits(k: int) -> bool:
        return simulate_with(graph, _dropping(graph, order, k, budget), cost).fits

    if fits(low):
        return _dropping(graph, order, low, budget)
    high = len(order)
    if not fits(high):
        return None
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            high = middle
        else:
            low = middle
    return _dropping(graph, order, high, budget)


def _dropping(graph: Graph, order: tuple[Rebuild, ...], count: int, budget: int | None) -> Plan:
    actions = tuple(sorted((r.action() for r in order[:count]), key=lambda a: (a.at_op, a.tensors)))
    return Plan(NAME, graph.fingerprint, budget, recomputes=actions,
                notes=(f"recomputes {count} of {len(order)} rebuildable tensors, the cheapest per byte freed first",))


def _named(plan: Plan) -> Plan:
    return replace(plan, policy=NAME)


def _actions(plan: Plan) -> int:
    return sum(len(r.ops) for r in plan.recomputes)
