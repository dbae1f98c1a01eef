"""Data pinning (document 001): which saved tensors stay resident ("pinned") in device memory.

Every candidate that is not pinned is offloaded after its last forward use and prefetched
before backward needs it. All candidates are saved across the forward/backward boundary,
so at that op they compete for the same memory: what is left of the budget once every
candidate is away. ``pin-dp`` solves that as a 0/1 knapsack exactly, by dynamic
programming over memory in discrete units, maximizing the bytes pinned (bytes never
moved: document 001's measure); ``pin-greedy`` pins in access order while they fit, as
GeePS's memory manager does. Ops other than the boundary are then checked, and
tensors unpinned where they still overflow.

pin-dp costs O(n * U) time and memory for n candidates and U = capacity / unit units;
the unit is the capacity / 4096, and at least 64 KiB, so U <= 4096. Sizes round up to whole
units and the capacity down, so the DP's answer always fits but can miss a packing that
exact bytes allow; it is repaired: what still fits in the bytes left is added, and the
greedy packing, a feasible answer too, wins where it pins more. The plan that follows is
checked the same way, so pin-dp never pins fewer bytes than pin-greedy at a budget both fit.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from udnn_lab.cost.model import CostModel
from udnn_lab.graph.plan_ir import Offload, Plan
from udnn_lab.graph.step_graph import Graph
from udnn_lab.planning._candidates import Candidate, candidates, first_backward_op, prefetch_point
from udnn_lab.planning._curve_estimate import CurveEstimate
from udnn_lab.planning.registry import policy
from udnn_lab.planning.vdnn import MARGINS, SIZE_FLOOR, pinned_pool_bytes
from udnn_lab.simulation.simulator import simulate_with

MAX_UNITS = 4096
MIN_UNIT = 64 << 10
LOOKAHEAD = 2


@policy("pin-greedy")
def pin_greedy(graph: Graph, cost: CostModel, budget: int | None) -> Plan:
    key = ("pin-greedy", id(graph), graph.fingerprint, budget)  # pin-dp plans it again beside auto's contender
    if key not in cost.memo:
        cost.memo[key] = _pinning(graph, cost, budget, "pin-greedy", _in_access_order)
    return cost.memo[key]


@policy("pin-dp")
def pin_dp(graph: Graph, cost: CostModel, budget: int | None) -> Plan:
    plan = _pinning(graph, cost, budget, "pin-dp", _knapsack)
    if budget is None:
        return plan
    # the same repair for the plan: _settle and the margins act after the knapsack and can undo its lead
    greedy = pin_greedy(graph, cost, budget)  # as registered: its simulations are already in the memo
    if simulate_with(graph, greedy, cost).fits and \
            (pinned_bytes(graph, greedy) > pinned_bytes(graph, plan) or not simulate_with(graph, plan, cost).fits):
        return replace(greedy, policy="pin-dp",
                       notes=greedy.notes + ("the greedy packing pins more than the rounded knapsack here",))
    return plan


def pinned_bytes(graph: Graph, plan: Plan) -> int:
    """Bytes of the pinning candidates a plan keeps on the device (document 001's measure)."""
    pool = _pool(graph)
    moved = {o.tensor for o in plan.offloads}
    return sum(c.nbytes for c in pool if c.tensor not in moved)


def _pool(graph: Graph) -> list[Candidate]:
    return [c for c in candidates(graph, SIZE_FLOOR)
            if c.last_forward < first_backward_op(graph) and _window(graph, c)[1] > _window(graph, c)[0]]


def _pinning(graph: Graph, cost: CostModel, budget: int | None, policy: str, choose) -> Plan:
    pool = _pool(graph)
    if budget is None:
        return _plan(graph, budget, policy, pool, pinned=pool)
    plan = _plan(graph, budget, policy, pool, pinned=pool)
    for margin in MARGINS:
        target = budget * (1 - margin)
        pinned = _settle(graph, pool, choose(graph, cost, pool, target), target)
        plan = _plan(graph, budget, policy, pool, pinned)
        if simulate_with(graph, plan, cost).fits:
            break
    return plan


def _window(graph: Graph, c: Candidate) -> tuple[int, int]:
    return c.freed_after + 1, prefetch_point(graph, c.first_backward, LOOKAHEAD)


def _all_away(graph: Graph, pool: list[Candidate]) -> CurveEstimate:
    estimate = CurveEstimate(graph)
    for c in pool:
        estimate.drop(c, _window(graph, c))
    return estimate


def _capacity(graph: Graph, pool: list[Candidate], target: float) -> tuple[float, CurveEstimate]:
    estimate = _all_away(graph, pool)
    boundary = first_backward_op(graph)
    at = min(boundary, len(estimate.live) - 1)
    return target - estimate.live[at], estimate


def _knapsack(graph: Graph, cost: CostModel, pool: list[Candidate], target: float) -> list[Candidate]:
    """Maximize the bytes pinned (the data never moved) within the boundary capacity."""
    capacity, estimate = _capacity(graph, pool, target)
    if capacity <= 0 or not pool:
        return []
    unit = max(MIN_UNIT, capacity / MAX_UNITS)
    units = int(capacity // unit)
    weights = [int(np.ceil(estimate.size(c) / unit)) for c in pool]
    values = [float(c.nbytes) for c in pool]
    best = np.zeros(units + 1)
    took = np.zeros((len(pool), units + 1), dtype=bool)
    for i, (weight, value) in enumerate(zip(weights, values)):
        if weight > units:
            continue
        with_item = best[:units + 1 - weight] + value
        better = with_item > best[weight:]
        took[i, weight:] = better
        best[weight:] = np.where(better, with_item, best[weight:])
    chosen, left = [], units
    for i in range(len(pool) - 1, -1, -1):
        if took[i, left]:
            chosen.append(pool[i])
            left -= weights[i]
    repaired = _fill(estimate, pool, chosen[::-1], capacity)
    greedy = _in_access_order(graph, cost, pool, target)
    return greedy if sum(c.nbytes for c in greedy) > sum(c.nbytes for c in repaired) else repaired


def _fill(estimate: CurveEstimate, pool: list[Candidate], chosen: list[Candidate], capacity: float) -> list[Candidate]:
    """Add, largest first, what still fits in exact bytes: the rounding left room."""
    taken = {c.tensor for c in chosen}
    used = sum(estimate.size(c) for c in chosen)
    for c in sorted(pool, key=lambda c: (-c.nbytes, c.tensor)):
        if c.tensor not in taken and used + estimate.size(c) <= capacity:
            taken.add(c.tensor)
            used += estimate.size(c)
    return [c for c in pool if c.tensor in taken]


def _in_access_order(graph: Graph, cost: CostModel, pool: list[Candidate], target: float) -> list[Candidate]:
    """GeePS: pin in the order the data is accessed, as long as it fits."""
    capacity, estimate = _capacity(graph, pool, target)
    chosen, used = [], 0
    for c in pool:
        if used + estimate.size(c) <= capacity:
            chosen.append(c)
            used += estimate.size(c)
    return chosen


def _settle(graph: Graph, pool: list[Candidate], pinned: list[Candidate], target: float) -> list[Candidate]:
    """Unpin, smallest first, where ops other than the boundary still overflow."""
    estimate = _all_away(graph, pool)
    for c in pinned:
        first, last = _window(graph, c)
        estimate.live[first:last] += estimate.size(c)
    kept = sorted(pinned, key=lambda c: (c.nbytes, c.tensor))
    peak, op = estimate.peak()
    while peak > target and kept:
        found = next((i for i, c in enumerate(kept) if _window(graph, c)[0] <= op < _window(graph, c)[1]), None)
        if found is None:
            break
        estimate.drop(kept[found], _window(graph, kept[found]))
        del kept[found]
        peak, op = estimate.peak()
    still = {c.tensor for c in kept}
    return [c for c in pinned if c.tensor in still]


def _plan(graph: Graph, budget: int | None, policy: str, pool: list[Candidate], pinned: list[Candidate]) -> Plan:
    resident = {c.tensor for c in pinned}
    offloads = tuple(Offload(c.tensor, c.last_forward, _window(graph, c)[1], pinned=True)
                     for c in pool if c.tensor not in resident)
    kept = sum(c.nbytes for c in pinned)
    return Plan(policy, graph.fingerprint, budget, offloads=offloads,
                pinned_pool_bytes=pinned_pool_bytes(graph, offloads), size_floor_bytes=SIZE_FLOOR,
                notes=(f"pinned (kept resident) {kept} bytes of {len(pinned)} tensors",))
