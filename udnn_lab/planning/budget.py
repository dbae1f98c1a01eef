"""Planning under a budget: plan(), the smallest budget a policy meets, and budget sweeps."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import pandas as pd

from udnn_lab.cost.model import CostModel, RateCurve
from udnn_lab.cost.profiling import Profile
from udnn_lab.errors import PlanInfeasible
from udnn_lab.graph.plan_ir import Plan
from udnn_lab.graph.step_graph import Graph
from udnn_lab.hardware.profiles import Hardware
from udnn_lab.planning._candidates import candidates
from udnn_lab.planning._estimate import CurveEstimate
from udnn_lab.planning.registry import POLICIES, quick_policies
from udnn_lab.simulation.simulator import cost_model, simulate_with
from udnn_lab.units import Bytes, format_bytes, parse_bytes

_RESOLUTION = 1 / 512  # min_budget searches to this fraction of the keep-all peak
_BUDGET_FREE = ("keep-all", "vdnn-all", "vdnn-conv")  # the same plan under any budget below the keep-all peak


def plan(graph: Graph, budget: int | str | None = None, policy: str = "auto", hardware: Hardware | str | None = None,
         profile: Profile | None = None, rates: RateCurve | bool | None = None, *,
         ranks_per_node: int | None = None) -> Plan:
    """A plan of ``policy`` for ``graph`` whose simulated peak fits ``budget`` ("6 GiB", bytes, or None).

    ``ranks_per_node``: for a graph of one rank of several, the ranks sharing a node (default: the profile's
    ``gpus_per_node``), as for ``simulate``: a collective whose group spans more crosses the nodes' network
    instead of the node's GPU-to-GPU fabric, and the node's ranks share its host memory for their copies
    (NOTE [collectives]). Raises PlanInfeasible, with the policy's smallest budget and a policy that would fit,
    when it cannot.
    """
    cost = cost_model(graph, hardware, profile, rates, ranks_per_node)
    budget_bytes = None if budget is None else parse_bytes(budget)
    result = _policy(policy)(graph, cost, budget_bytes)
    simulation = simulate_with(graph, result, cost)
    if budget_bytes is not None and not simulation.fits:
        minimum = min_budget(graph, policy, cost=cost)
        other = None if policy == "auto" else _fitting_policy(graph, cost, budget_bytes)  # auto tried them all
        hint = f"; {other!r} fits {format_bytes(budget_bytes)}" if other else \
            "; no policy fits it: raise the budget, or lower the batch size"
        raise PlanInfeasible(f"policy {policy!r} cannot fit {graph.model_name} into {format_bytes(budget_bytes)}: "
                             f"the smallest budget it meets is {format_bytes(minimum)}{hint}", minimum, other)
    released = result.with_releases(simulation.released_before)
    located = released.located(graph)
    if located.hook_events and located.offloads != released.offloads:  # NOTE [hook points] 2: moved; still fits?
        moved = simulate_with(graph, located, cost)
        if not (moved.fits if budget_bytes is not None else moved.peak_bytes <= simulation.peak_bytes):
            return released.located(graph, on_hooks=False)
    return located


def min_budget(graph: Graph, policy: str = "auto", hardware: Hardware | str | None = None,
               profile: Profile | None = None, rates: RateCurve | bool | None = None,
               cost: CostModel | None = None, *, ranks_per_node: int | None = None) -> Bytes:
    """The smallest budget (bytes) whose plan of ``policy`` simulates within it.

    A plan that does not depend on the budget is simulated once with compute waiting for
    every copy in flight (its floor); other policies are bisected between a floor no plan
    can go under (what each op needs while every saved tensor it does not touch is away)
    and the keep-all peak. ``ranks_per_node`` as for ``plan`` (a ``cost`` model carries its own).
    """
    if cost is not None and ranks_per_node is not None:
        raise ValueError("a cost model carries its own ranks_per_node: give min_budget either cost or "
                         "ranks_per_node, or make the cost model with it (simulation.cost_model(..., ranks_per_node))")
    cost = cost or cost_model(graph, hardware, profile, rates, ranks_per_node)
    choose = _policy(policy)
    high = simulate_with(graph, Plan.keep_all(graph), cost).peak_bytes
    if policy in _BUDGET_FREE:
        fixed = choose(graph, cost, None)
        floor = simulate_with(graph, replace(fixed, budget_bytes=0), cost).peak_bytes
        return Bytes(floor if simulate_with(graph, replace(fixed, budget_bytes=floor), cost).fits else high)
    if not _fits(graph, cost, choose, high):
        return Bytes(simulate_with(graph, choose(graph, cost, None), cost).peak_bytes)
    low, step = max(0, floor_bytes(graph) - 1), max(1, int(high * _RESOLUTION))
    while high - low > step:
        middle = (low + high) // 2
        if _fits(graph, cost, choose, middle):
            high = middle
        else:
            low = middle
    return Bytes(high)


def sweep(graph: Graph, budgets: Iterable[int | str], policies: Iterable[str] | None = None,
          hardware: Hardware | str | None = None, profile: Profile | None = None,
          rates: RateCurve | bool | None = None, *, ranks_per_node: int | None = None) -> pd.DataFrame:
    """Budget x policy -> fits, predicted step time, peak, bytes moved, pinned bytes, stall time.

    ``policies``: by default every policy that plans in seconds (not ``optimal``'s solver: name it to include it).
    ``ranks_per_node`` as for ``plan``.
    """
    policies = quick_policies() if policies is None else policies
    cost = cost_model(graph, hardware, profile, rates, ranks_per_node)
    rows = []
    for budget in budgets:
        budget_bytes = parse_bytes(budget)
        for name in policies:
            chosen = _policy(name)(graph, cost, budget_bytes)
            sim = simulate_with(graph, chosen, cost)
            rows.append({"budget_bytes": budget_bytes, "policy": name, "fits": sim.fits,
                         "step_time_s": sim.step_time_s if sim.fits else float("nan"),
                         "peak_bytes": sim.peak_bytes, "d2h_bytes": sim.d2h_bytes, "h2d_bytes": sim.h2d_bytes,
                         "pinned_bytes": chosen.pinned_pool_bytes, "stall_time_s": sim.stall_time_s,
                         "compute_time_s": sim.compute_time_s, "offloads": len(chosen.offloads),
                         "recomputes": len(chosen.recomputes)})
    return pd.DataFrame(rows)


def _policy(name: str):
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; the policies are: {', '.join(POLICIES)}") from None


def _fits(graph: Graph, cost: CostModel, choose, budget: int) -> bool:
    return simulate_with(graph, choose(graph, cost, budget), cost).fits


def _fitting_policy(graph: Graph, cost: CostModel, budget: int) -> str | None:
    """The policy auto picks for this budget (auto tries them all), or None if none fits."""
    chosen = POLICIES["auto"](graph, cost, budget)
    if not simulate_with(graph, chosen, cost).fits:
        return None
    return next((note.removeprefix("chose ") for note in chosen.notes if note.startswith("chose ")), "auto")


def floor_bytes(graph: Graph) -> int:
    """No plan of any policy goes under this: the peak with every saved tensor away wherever no op touches it
    (what the ops need at once, with what the step holds throughout: parameters, gradients, optimizer state)."""
    estimate = CurveEstimate(graph)
    for c in candidates(graph):
        estimate.drop(c, (c.freed_after + 1, c.first_backward))
    return int(estimate.peak()[0])
