"""Budgets in the number an out-of-memory error is about: what PyTorch's caching allocator reserves from the device
(segments it keeps, free or not), plus what the process holds outside it (the CUDA context, library workspaces,
NCCL's buffers per rank), rather than the bytes of live tensors alone.

A plan is made for bytes allocated; the caching allocator model (``allocator``, NOTE [modelled allocator
behaviour]) replays the plan's step as the simulation runs it and says what it reserves. Where that, with the
bytes outside the allocator, is over the budget, the plan is made again for that many allocated bytes fewer, until
it fits or no plan of the policy does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from udnn_lab.allocator import events_from_simulation, replay
from udnn_lab.cost.model import CostModel
from udnn_lab.errors import PlanInfeasible
from udnn_lab.graph.plan_ir import Plan
from udnn_lab.graph.step_graph import Graph
from udnn_lab.simulation.simulator import Simulation, simulate_with
from udnn_lab.units import format_bytes

COUNTS = ("allocated", "reserved")  # what a budget counts
TRIES = 8  # plans made, at most, to bring the reserved peak under a budget
_STEP = 1 / 256  # each try lowers the allocated budget by at least this share of the budget


def reserved_peak_bytes(graph: Graph, plan: Plan, simulation: Simulation) -> int:
    """The most the caching allocator model reserves over the step under ``plan``, as ``simulation`` runs it (its
    best fit, from a fresh allocator holding the step's weights, state and batch)."""
    return replay(events_from_simulation(graph, plan, simulation)).reserved_peak_bytes


def check_counts(counts: str, graph: Graph) -> None:
    if counts not in COUNTS:
        raise ValueError(f"counts={counts!r}: a budget counts 'allocated' bytes (live tensors) or 'reserved' bytes "
                         "(what the caching allocator holds, plus outside_bytes)")
    if counts == "reserved" and graph.device != "cuda":
        raise ValueError(f"counts='reserved' needs a CUDA step (this one is on {graph.device}, where no caching "
                         "allocator reserves memory): trace it with device='cuda', or count the budget as allocated")


def plan_in_reserved(graph: Graph, budget: int, outside: int, cost: CostModel,
                     planned: Callable[[int], Plan]) -> Plan:
    """A plan whose predicted reserved peak plus ``outside`` fits ``budget``: made by ``planned`` (the policy's plan
    for a budget of allocated bytes) for fewer allocated bytes until it does. Raises PlanInfeasible otherwise."""
    room = budget - outside
    if room <= 0:
        raise PlanInfeasible(f"{format_bytes(outside)} outside the allocator leaves nothing of {format_bytes(budget)} "
                             "for the step: give a larger budget, or measure what the process holds outside the "
                             "allocator (the device's used memory less torch.cuda.memory_reserved())", budget, None)
    allocated, tried = room, None  # tried: (allocated, reserved) of the last plan made
    for _ in range(TRIES):
        try:
            chosen = planned(allocated)
        except PlanInfeasible as err:
            if tried is None or not err.minimum_bytes or err.minimum_bytes >= tried[0]:
                raise PlanInfeasible(_infeasible(graph, budget, outside, tried, str(err)), err.minimum_bytes,
                                     err.fitting_policy) from None
            allocated = err.minimum_bytes  # lowered past what the policy meets: its least, once
            continue
        reserved = reserved_peak_bytes(graph, chosen, simulate_with(graph, chosen, cost))
        if reserved <= room:
            said = (f"planned for {format_bytes(allocated)} allocated: the caching allocator is predicted to reserve "
                    f"{format_bytes(reserved)}, which with {format_bytes(outside)} outside it fits "
                    f"{format_bytes(budget)}")
            return replace(chosen, notes=(*chosen.notes, said))
        tried = (allocated, reserved)
        allocated -= max(reserved - room, int(budget * _STEP))
    raise PlanInfeasible(_infeasible(graph, budget, outside, tried, f"after {TRIES} plans the reserved peak is still "
                                     "over it"), allocated, None)


def _infeasible(graph: Graph, budget: int, outside: int, tried: tuple[int, int] | None, why: str) -> str:
    """One line: the budget in reserved bytes, the last plan made (its allocated budget and reserved peak), why."""
    said = f" (planned for {format_bytes(tried[0])} allocated, it reserves {format_bytes(tried[1])})" if tried else ""
    return (f"no plan fits {graph.model_name} into {format_bytes(budget)} counted as reserved bytes with "
            f"{format_bytes(outside)} outside the allocator{said}: {why.rstrip('.')}")
