"""Planning under a budget: plan(), the smallest budget a policy meets, and budget sweeps."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import pandas as pd

from udnn_lab.cost.model import CostModel, RateCurve
from udnn_lab.cost.profiling import Profile
from udnn_lab.errors import BudgetOverDevice, HostBudgetExceeded, PlanInfeasible
from udnn_lab.graph.plan_ir import Plan
from udnn_lab.graph.reruns import blocks_taking_objects
from udnn_lab.graph.step_graph import Graph
from udnn_lab.hardware.profiles import Hardware
from udnn_lab.planning._candidates import candidates
from udnn_lab.planning._curve_estimate import CurveEstimate
from udnn_lab.planning.auto import auto_fits, auto_within_host
from udnn_lab.planning.floors import fixed_floor, one_op_floor, unlowered_note
from udnn_lab.planning.host import LOCAL, host_budget_bytes, plan_host_bytes
from udnn_lab.planning.registry import POLICIES, quick_policies
from udnn_lab.planning.reserved import (
    allocated_peak_bytes,
    check_counts,
    counts_whole_blocks,
    plan_in_allocated,
    plan_in_reserved,
)
from udnn_lab.simulation.simulator import cost_model, simulate_with
from udnn_lab.units import Bytes, format_budget, format_bytes, format_seconds, parse_bytes

_RESOLUTION = 1 / 512  # min_budget searches to this fraction of the keep-all peak
_BUDGET_FREE = ("keep-all", "vdnn-all", "vdnn-conv")  # the same plan under any budget below the keep-all peak
# how the note begins on a plan the runtime follows op by op because on hook points it would not fit
OP_BY_OP_NOTE = "followed op by op"


def plan(graph: Graph, budget: int | str | None = None, policy: str = "auto", hardware: Hardware | str | None = None,
         profile: Profile | None = None, rates: RateCurve | bool | None = None, *,
         ranks_per_node: int | None = None, host_budget: int | str | None = LOCAL, counts: str = "allocated",
         outside_bytes: int | str = 0) -> Plan:
    """A plan of ``policy`` for ``graph`` whose simulated peak fits ``budget`` ("6 GiB", bytes, or None).

    ``counts``: what the budget counts: 'allocated' bytes (live tensors, as the simulation's peak; on a CUDA step
    as torch.cuda.max_memory_allocated counts them, with the whole blocks the caching allocator hands out: NOTE
    [whole blocks] in planning/reserved.py), or, for a CUDA step, 'reserved' bytes (what the caching allocator is
    predicted to reserve, as torch.cuda.max_memory_reserved, plus ``outside_bytes``: what the process holds outside
    the allocator, the CUDA context and libraries' workspaces; NCCL's buffers on a rank), the number an
    out-of-memory error is about (planning/reserved.py).

    ``ranks_per_node``: for a graph of one rank of several, the ranks sharing a node (default: the profile's
    ``gpus_per_node``), as for ``simulate``: a collective whose group spans more crosses the nodes' network
    instead of the node's GPU-to-GPU fabric, and the node's ranks share its host memory for their copies
    (NOTE [collectives]). ``host_budget``: the host memory the plan's offloads may take ("64 GiB", bytes; by
    default "local", what this machine's runtime pool may take; None: not checked; NOTE [host budget]): auto
    chooses among the plans within it. A budget above the profile's device memory raises BudgetOverDevice.
    Raises PlanInfeasible, with the policy's smallest budget and a policy that would fit, when it cannot fit
    the budget, and HostBudgetExceeded (a PlanInfeasible) when it fits only with more host memory.
    """
    cost = cost_model(graph, hardware, profile, rates, ranks_per_node)
    budget_bytes = None if budget is None else parse_bytes(budget)
    check_within_device(budget_bytes, cost.hardware)
    check_counts(counts, graph)

    def planned(live: int | None) -> Plan:  # within a search of live bytes: the policy's least in live bytes
        return _plan_live(graph, cost, policy, live, host_budget, whole_blocks=False)

    if budget_bytes is None:
        return planned(None)
    if counts == "reserved":
        return plan_in_reserved(graph, budget_bytes, parse_bytes(outside_bytes), cost, planned)
    result = _plan_live(graph, cost, policy, budget_bytes, host_budget, whole_blocks=True)
    if not _counts_whole_blocks(graph, policy, result):
        return result
    counted = allocated_peak_bytes(graph, result, simulate_with(graph, result, cost))
    if counted > budget_bytes:  # NOTE [whole blocks]
        try:
            return plan_in_allocated(graph, budget_bytes, cost, planned, (result, counted))
        except PlanInfeasible as err:
            return _counted_lowest(graph, cost, policy, budget_bytes, host_budget, err)
    return result


def _counted_lowest(graph: Graph, cost: CostModel, policy: str, budget_bytes: int, host_budget: int | str | None,
                    err: PlanInfeasible) -> Plan:
    """Where no plan fits ``budget_bytes`` as the caching allocator counts it, auto's at its least budget of live
    bytes that is counted within it, as min_budget finds it (``auto_within_host``'s ``counted_within``); else
    ``err``, with min_budget's figure."""
    if policy != "auto":
        raise err
    least = _least_live(graph, cost, policy, _policy(policy))
    chosen = _plan_live(graph, cost, policy, least, host_budget, whole_blocks=False, counted_within=budget_bytes)
    counted = allocated_peak_bytes(graph, chosen, simulate_with(graph, chosen, cost))
    if max(least, counted) > budget_bytes:  # none there is counted within it: this one is counted lowest
        minimum = max(least, counted)
        raise PlanInfeasible(f"{str(err).split(': the least budget')[0]}: the least budget that fits is "
                             f"{format_bytes(minimum)}", minimum, err.fitting_policy) from None
    said = (f"planned for {format_bytes(least)} of live bytes, auto's least: of its plans there, this one the caching "
            f"allocator is predicted to count {format_bytes(counted)} allocated, within {format_bytes(budget_bytes)}")
    return replace(chosen, budget_bytes=budget_bytes, notes=(*chosen.notes, said))


def _counts_whole_blocks(graph: Graph, policy: str, chosen: Plan) -> bool:
    """Whether ``chosen`` is held to its budget in whole blocks (NOTE [whole blocks] in planning/reserved.py): a plan
    that moves tensors on a CUDA step, of a policy that plans for a budget. Keeping everything is the step as it
    runs without udnn_lab, whose peak is the graph's; vDNN's fixed policies offload what they offload."""
    return counts_whole_blocks(graph) and policy not in _BUDGET_FREE and bool(chosen.offloads or chosen.recomputes)


def _plan_live(graph: Graph, cost: CostModel, policy: str, budget_bytes: int | None,
               host_budget: int | str | None, whole_blocks: bool, counted_within: int | None = None) -> Plan:
    """The policy's plan whose simulated peak of live bytes fits ``budget_bytes`` (plan's errors, whose smallest
    budget counts ``whole_blocks`` on CUDA or live bytes alone); auto's, of those, the one ``counted_within`` takes
    (``auto_within_host``)."""
    host_bytes = host_budget_bytes(host_budget, graph.device, budget_bytes)
    result = _planned(graph, cost, policy, budget_bytes, host_bytes, counted_within)
    simulation = simulate_with(graph, result, cost)
    if budget_bytes is not None and not simulation.fits:
        minimum = _smallest_budget(graph, cost, policy, whole_blocks)
        other = None if policy == "auto" else _fitting_policy(graph, cost, budget_bytes, host_bytes)
        hint = f"; {other!r} fits {format_bytes(budget_bytes)}" if other else \
            (fixed_floor(graph, minimum) or one_op_floor(graph, minimum)
             or "; no policy fits it: raise the budget, or lower the batch size")
        raise PlanInfeasible(f"policy {policy!r} cannot fit {graph.model_name} into {format_bytes(budget_bytes)}: "
                             f"the smallest budget it meets is {format_bytes(minimum)}{hint}", minimum, other)
    if host_bytes is not None and plan_host_bytes(graph, result) > host_bytes:
        _host_exceeded(graph, cost, policy, result, simulation.peak_bytes, host_bytes)
    # below the graph's own peak it is lower (keep-all's simulated peak is no lower than that), at no extra simulation
    if (result.offloads or result.recomputes) and simulation.peak_bytes >= graph.counted_peak_bytes:
        kept = simulate_with(graph, Plan.keep_all(graph, budget_bytes), cost)
        if simulation.peak_bytes >= kept.peak_bytes:  # slower, and no lower: say why, and what would help
            result = replace(result, notes=(*result.notes, unlowered_note(graph, simulation, kept)))
    block = blocks_taking_objects(graph) if result.recomputes else ""
    if block:
        result = replace(result, notes=(*result.notes, _recorded_note(block)))
    released = result.with_releases(simulation.released_before)
    located = released.located(graph)
    if located.hook_events and located.offloads != released.offloads:  # NOTE [hook points] 2: moved; still fits?
        moved = simulate_with(graph, located, cost)
        if not (moved.fits if budget_bytes is not None else moved.peak_bytes <= simulation.peak_bytes):
            by_ops = released.located(graph, on_hooks=False)
            if whole_blocks and budget_bytes is not None:  # the plan asked for, not one of a search's
                note = _op_by_op_note(graph, cost, policy, host_budget, by_ops, moved.peak_bytes)
                by_ops = replace(by_ops, notes=(*by_ops.notes, note))
            return by_ops
    return located


def _op_by_op_note(graph: Graph, cost: CostModel, policy: str, host_budget: int | str | None, by_ops: Plan,
                   hooked_peak: int) -> str:
    """Why ``by_ops`` is followed op by op, and the budget from which the policy's plan is followed by hooks, where
    the plan at its offloads' peak on hook points is."""
    note = (f"{OP_BY_OP_NOTE}, through a dispatch mode that costs the host time on every op (simulated step "
            f"{format_seconds(simulate_with(graph, by_ops, cost).step_time_s)}): with its offloads moved onto the hook "
            f"points the runtime can follow alone, it would peak at {format_bytes(hooked_peak)}, over the budget")
    larger = format_budget(hooked_peak)
    try:
        again = _plan_live(graph, cost, policy, parse_bytes(larger), host_budget, whole_blocks=False)
    except PlanInfeasible:
        return note
    if again.followed_op_by_op(graph):
        return note
    return (f"{note}; at a budget of {larger} its plan is followed by hooks alone (simulated step "
            f"{format_seconds(simulate_with(graph, again, cost).step_time_s)}), as the trainer callbacks need")


def op_by_op(plan: Plan) -> str:
    """The plan's note saying why it is followed op by op, and from what budget it would not be ('' when none)."""
    return next((note for note in plan.notes if note.startswith(OP_BY_OP_NOTE)), "")


def _recorded_note(block: str) -> str:
    return (f"each {block} call takes an argument that is not a tensor or a plain value (a cache object), so no "
            "recomputation re-runs a block, as checkpointing would: each is recorded and replayed op by op, which "
            "costs the host more; for a Hugging Face model in training, set model.config.use_cache = False")


def check_within_device(budget_bytes: int | None, hardware: Hardware) -> None:
    """Raise BudgetOverDevice for a budget larger than the device memory ``hardware`` has."""
    if budget_bytes is not None and budget_bytes > hardware.memory_bytes:
        raise BudgetOverDevice(
            f"the budget {format_bytes(budget_bytes)} is more than the {format_bytes(hardware.memory_bytes)} of "
            f"device memory {hardware.name} has: give a budget up to {format_bytes(hardware.memory_bytes)}, or pass "
            "hardware= the profile of a device with more", budget_bytes, int(hardware.memory_bytes))


def _planned(graph: Graph, cost: CostModel, policy: str, budget: int | None, host_budget: int | None,
             counted_within: int | None = None) -> Plan:
    """The policy's plan; auto's among those within the host budget (NOTE [host budget]) and, where given, the one
    ``counted_within`` takes (``auto_within_host``)."""
    choose = _policy(policy)
    if policy == "auto":
        return auto_within_host(graph, cost, budget, host_budget, counted_within)
    return choose(graph, cost, budget)


def _host_exceeded(graph: Graph, cost: CostModel, policy: str, result: Plan, peak: int, host_budget: int) -> None:
    """Raise HostBudgetExceeded for a plan that fits the device but not the host budget, saying what would."""
    needed = plan_host_bytes(graph, result)
    other = None if policy == "auto" or result.budget_bytes is None else \
        _fitting_policy(graph, cost, result.budget_bytes, host_budget)
    hint = "raise the budget (offload less), lower the batch size" if other is None else \
        f"{other!r} fits both" if other in POLICIES else f"'auto' fits both (it chooses {other})"
    raise HostBudgetExceeded(
        f"policy {policy!r} fits {graph.model_name} into {format_bytes(result.budget_bytes or 0)} only by "
        f"offloading {format_bytes(needed)} to host memory, more than the {format_bytes(host_budget)} host budget: "
        f"{hint}, or give host_budget= what the training machine can pin", peak, needed, host_budget, other)


def min_budget(graph: Graph, policy: str = "auto", hardware: Hardware | str | None = None,
               profile: Profile | None = None, rates: RateCurve | bool | None = None,
               cost: CostModel | None = None, *, ranks_per_node: int | None = None,
               within_device: bool = False) -> Bytes:
    """The smallest budget (bytes) whose plan of ``policy`` simulates within it.

    The figure is returned even where it is above the profile's device memory (a what-if across devices asks
    exactly that); with ``within_device`` such a figure raises BudgetOverDevice instead: no budget there fits.

    A plan that does not depend on the budget is simulated once with compute waiting for
    every copy in flight (its floor); other policies are bisected between a floor no plan
    can go under (what each op needs while every saved tensor it does not touch is away)
    and the keep-all peak. ``ranks_per_node`` as for ``plan`` (a ``cost`` model carries its own).
    """
    if cost is not None and ranks_per_node is not None:
        raise ValueError("a cost model carries its own ranks_per_node: give min_budget either cost or "
                         "ranks_per_node, or make the cost model with it (simulation.cost_model(..., ranks_per_node))")
    cost = cost or cost_model(graph, hardware, profile, rates, ranks_per_node)
    minimum = _smallest_budget(graph, cost, policy, whole_blocks=True)
    if within_device and minimum > cost.hardware.memory_bytes:
        memory = cost.hardware.memory_bytes
        raise BudgetOverDevice(
            f"policy {policy!r} needs at least {format_bytes(minimum)} for {graph.model_name}, more than the "
            f"{format_bytes(memory)} of device memory {cost.hardware.name} has: no budget there fits; lower the batch "
            "size, shard the model over more ranks, or give the profile of a device with more", minimum, memory)
    return minimum


def _smallest_budget(graph: Graph, cost: CostModel, policy: str, whole_blocks: bool) -> Bytes:
    """min_budget's figure: the least budget of live bytes whose plan simulates within it; with ``whole_blocks``,
    on CUDA, that plan's peak as the caching allocator counts allocated bytes where it is more (NOTE [whole
    blocks] in planning/reserved.py): plan() reaches it, searching down to the least budget of live bytes."""
    choose = _policy(policy)
    least = _least_live(graph, cost, policy, choose)
    if not whole_blocks:
        return least
    # as plan() returns it: auto's counted lowest, where none is counted within its live bytes
    chosen = _plan_live(graph, cost, policy, least, None, whole_blocks=False, counted_within=least)
    if not _counts_whole_blocks(graph, policy, chosen):
        return least
    return Bytes(max(least, allocated_peak_bytes(graph, chosen, simulate_with(graph, chosen, cost))))


def least_live_budget(graph: Graph, policy: str, cost: CostModel) -> Bytes:
    """The least budget of live bytes (the simulated peak, the planners' own measure) whose plan of ``policy`` fits
    it: ``min_budget`` less the whole blocks the caching allocator counts on CUDA (NOTE [whole blocks] in
    planning/reserved.py). What compares planners with one another."""
    return _least_live(graph, cost, policy, _policy(policy))


def _least_live(graph: Graph, cost: CostModel, policy: str, choose) -> Bytes:
    high = simulate_with(graph, Plan.keep_all(graph), cost).peak_bytes
    if policy in _BUDGET_FREE:
        fixed = choose(graph, cost, None)
        floor = simulate_with(graph, replace(fixed, budget_bytes=0), cost).peak_bytes
        return Bytes(floor if simulate_with(graph, replace(fixed, budget_bytes=floor), cost).fits else high)
    def fits(budget: int) -> bool:
        return auto_fits(graph, cost, budget) if policy == "auto" else _fits(graph, cost, choose, budget)

    if not fits(high):
        return Bytes(simulate_with(graph, choose(graph, cost, None), cost).peak_bytes)
    low, step = max(0, floor_bytes(graph) - 1), max(1, int(high * _RESOLUTION))
    while high - low > step:
        middle = (low + high) // 2
        if fits(middle):
            high = middle
        else:
            low = middle
    return Bytes(high)


def sweep(graph: Graph, budgets: Iterable[int | str], policies: Iterable[str] | None = None,
          hardware: Hardware | str | None = None, profile: Profile | None = None,
          rates: RateCurve | bool | None = None, *, ranks_per_node: int | None = None,
          host_budget: int | str | None = LOCAL) -> pd.DataFrame:
    """Budget x policy -> fits, predicted step time, peak, bytes moved, pinned and host bytes, stall time.

    ``policies``: by default every policy that plans in seconds (not ``optimal``'s solver: name it to include it).
    ``ranks_per_node`` and ``host_budget`` as for ``plan``: a plan fits when it fits the budget and its offloads the
    host budget (auto chooses among those that do). Every budget must be within the profile's device memory.
    """
    policies = quick_policies() if policies is None else policies
    cost = cost_model(graph, hardware, profile, rates, ranks_per_node)
    budget_list = [parse_bytes(budget) for budget in budgets]
    for budget_bytes in budget_list:
        check_within_device(budget_bytes, cost.hardware)
    rows = []
    for budget_bytes in budget_list:
        host_bytes = host_budget_bytes(host_budget, graph.device, budget_bytes)
        for name in policies:
            chosen = _planned(graph, cost, name, budget_bytes, host_bytes)
            sim = simulate_with(graph, chosen, cost)
            held = plan_host_bytes(graph, chosen)
            fits = sim.fits and (host_bytes is None or held <= host_bytes)
            rows.append({"budget_bytes": budget_bytes, "policy": name, "fits": fits,
                         "step_time_s": sim.step_time_s if fits else float("nan"),
                         "peak_bytes": sim.peak_bytes, "d2h_bytes": sim.d2h_bytes, "h2d_bytes": sim.h2d_bytes,
                         "pinned_bytes": chosen.pinned_pool_bytes, "host_bytes": held, "host_budget_bytes": host_bytes,
                         "stall_time_s": sim.stall_time_s, "compute_time_s": sim.compute_time_s,
                         "offloads": len(chosen.offloads), "recomputes": len(chosen.recomputes)})
    return pd.DataFrame(rows)


def _policy(name: str):
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; the policies are: {', '.join(POLICIES)}") from None


def _fits(graph: Graph, cost: CostModel, choose, budget: int) -> bool:
    return simulate_with(graph, choose(graph, cost, budget), cost).fits


def _fitting_policy(graph: Graph, cost: CostModel, budget: int, host_budget: int | None = None) -> str | None:
    """The policy auto picks for this budget and host budget (auto tries them all), or None if none fits."""
    chosen = auto_within_host(graph, cost, budget, host_budget)
    if not simulate_with(graph, chosen, cost).fits or \
            host_budget is not None and plan_host_bytes(graph, chosen) > host_budget:
        return None
    return chosen.chosen_policy or "auto"


def floor_bytes(graph: Graph) -> int:
    """No plan of any policy goes under this: the peak with every saved tensor away wherever no op touches it
    (what the ops need at once, with what the step holds throughout: parameters, gradients, optimizer state)."""
    estimate = CurveEstimate(graph)
    for c in candidates(graph):
        estimate.drop(c, (c.freed_after + 1, c.first_backward))
    return int(estimate.peak()[0])
