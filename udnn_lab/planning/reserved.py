"""Budgets in the number an out-of-memory error is about: what PyTorch's caching allocator reserves from the device
(segments it keeps, free or not), plus what the process holds outside it (the CUDA context, library workspaces,
NCCL's buffers per rank), rather than the bytes of live tensors alone.

A plan is made for bytes allocated; the caching allocator model (``allocator``, NOTE [modelled allocator
behaviour]) replays the plan's step as the simulation runs it and says what it reserves. Where that, with the
bytes outside the allocator, is over the budget, the plan is made again for fewer allocated bytes (``_Search``: steps
that double, then halving the gap), until it fits or no plan of the policy does.
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


def check_count_name(counts: str) -> None:
    """Raise ValueError unless ``counts`` is one of COUNTS."""
    if counts not in COUNTS:
        raise ValueError(f"counts={counts!r}: a budget counts 'allocated' bytes (live tensors) or 'reserved' bytes "
                         "(what the caching allocator holds, plus outside_bytes)")


def check_counts(counts: str, graph: Graph) -> None:
    check_count_name(counts)
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
    search = _Search(room, max(1, int(budget * _STEP)))
    for _ in range(TRIES):
        if search.next is None:
            break
        allocated = search.next
        try:
            chosen = planned(allocated)
        except PlanInfeasible as err:
            if not search.below_policy(err.minimum_bytes):
                raise PlanInfeasible(_infeasible(graph, budget, outside, search.over, str(err)), err.minimum_bytes,
                                     err.fitting_policy) from None
            continue
        search.made(allocated, chosen, reserved_peak_bytes(graph, chosen, simulate_with(graph, chosen, cost)))
    if search.best is None:
        assert search.over is not None  # every plan made was over the room
        raise PlanInfeasible(_infeasible(graph, budget, outside, search.over, f"after {search.plans} plans, down "
                                         f"to {format_bytes(search.over[0])} allocated, the reserved peak is still "
                                         "over it"), search.over[0], None)
    allocated, chosen, reserved = search.best
    said = (f"planned for {format_bytes(allocated)} allocated: the caching allocator is predicted to reserve "
            f"{format_bytes(reserved)}, which with {format_bytes(outside)} outside it fits {format_bytes(budget)}")
    return replace(chosen, notes=(*chosen.notes, said))


class _Search:
    """The allocated budget to plan for next. The reserved peak climbs in steps of whole segments as allocated
    bytes grow, so a plan over by a little may need many fewer allocated bytes: from the room, the step down is
    the overage, and at least twice the last step, until a plan fits; then the gap between that plan and the
    least allocated one over is halved, to keep the most allocated bytes (the fastest plan) that fits."""

    def __init__(self, room: int, resolution: int) -> None:
        self.room, self.resolution = room, resolution
        self.next: int | None = room
        self.step = 0
        self.best: tuple[int, Plan, int] | None = None  # (allocated, plan, reserved): fits, the most allocated
        self.over: tuple[int, int] | None = None  # (allocated, reserved): over the room, the least allocated
        self._took_minimum = False
        self.plans = 0

    def below_policy(self, minimum: int | None) -> bool:
        """The policy meets no plan for ``next``: try the policy's least once, when below every plan over the
        room; False when there is nothing left to try."""
        ceiling = self.over[0] if self.over is not None else self.room
        if self.best is not None or self._took_minimum or not minimum or minimum >= ceiling:
            return False
        self._took_minimum = True
        self.next = minimum
        return True

    def made(self, allocated: int, chosen: Plan, reserved: int) -> None:
        self.plans += 1
        if reserved <= self.room:
            if self.best is None or allocated > self.best[0]:
                self.best = (allocated, chosen, reserved)
        elif self.over is None or allocated < self.over[0]:
            self.over = (allocated, reserved)
        self.next = self._next()

    def _next(self) -> int | None:
        if self.best is None:
            assert self.over is not None
            self.step = max(self.over[1] - self.room, 2 * self.step, self.resolution)
            lower = self.over[0] - self.step
            # a reserved peak that does not come down with the allocated budget (a library's workspace beside a
            # step that fits) steps past zero: there is no plan left to try
            return lower if lower >= self.resolution else None
        if self.over is None or self.over[0] - self.best[0] <= self.resolution:
            return None
        return (self.over[0] + self.best[0]) // 2


def _infeasible(graph: Graph, budget: int, outside: int, tried: tuple[int, int] | None, why: str) -> str:
    """One line: the budget in reserved bytes, the last plan made (its allocated budget and reserved peak), why."""
    said = f" (planned for {format_bytes(tried[0])} allocated, it reserves {format_bytes(tried[1])})" if tried else ""
    return (f"no plan fits {graph.model_name} into {format_bytes(budget)} counted as reserved bytes with "
            f"{format_bytes(outside)} outside the allocator{said}: {why.rstrip('.')}")
