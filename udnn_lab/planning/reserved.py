"""Budgets in the numbers PyTorch's caching allocator keeps, rather than the bytes of live tensors alone.

- counted as 'allocated' on a CUDA step: what ``torch.cuda.max_memory_allocated`` counts, the blocks handed out.
  NOTE [whole blocks]: a free block whose remainder after a request is too small to split (up to 1 MiB in the
  large pool) is handed out whole, and the allocator counts all of it: on an H200 ConvNeXt-T's and
  MobileNet-V3's plans peaked 4 to 17 MiB above their simulated peaks, by about what the allocator model hands
  out beyond the requests, and went over budgets they met in live bytes. A plan's counted peak is the most,
  over its ops, of the simulated bytes while the op runs (its scratch with them) plus the most the model hands
  out beyond the requests meanwhile. It holds a plan that moves tensors, of a policy that plans for a budget;
  keeping everything is the step as it runs without udnn_lab, whose peak is the graph's.
- counted as 'reserved': what the allocator reserves from the device (segments it keeps, free or not), plus
  what the process holds outside it (the CUDA context, library workspaces, NCCL's buffers per rank), the
  number an out-of-memory error is about.

A plan is made for bytes allocated; the caching allocator model (``allocator``, NOTE [modelled allocator
behaviour]) replays the plan's step as the simulation runs it and says what it hands out and reserves. Where
that is over the budget, the plan is made again for fewer allocated bytes (``_Search``: steps that double, then
halving the gap), until it fits or no plan of the policy does. At auto's least budget of live bytes, its plans that
fit may be counted differently: min_budget counts the lowest of them, and plan() falls back on the fastest counted
within the budget there (``auto_within_host``'s ``counted_within``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pandas as pd

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


def allocated_peak_bytes(graph: Graph, plan: Plan, simulation: Simulation,
                         replayed: pd.DataFrame | None = None) -> int:
    """The step's peak under ``plan`` as ``torch.cuda.max_memory_allocated`` counts it (NOTE [whole blocks]): at each
    op, the simulated bytes plus the most the caching allocator model hands out beyond the requests while it runs;
    on a step without a caching allocator (CPU), the simulated peak. ``replayed``: the allocator model's frame of
    this simulation, when the caller has replayed it already."""
    if not counts_whole_blocks(graph):
        return simulation.peak_bytes
    frame = replay(events_from_simulation(graph, plan, simulation)).frame if replayed is None else replayed
    counted, before = simulation.counted_by_op()
    if not len(frame) or not len(counted):
        return simulation.peak_bytes
    whole = (frame["allocated_bytes"] - frame["live_bytes"]).to_numpy()
    ops = frame["op"].to_numpy()
    inside = (ops >= 0) & (ops < len(counted))
    most = np.zeros(len(counted), dtype=np.int64)  # the most handed out whole by each op's own events
    np.maximum.at(most, ops[inside], whole[inside])
    left = dict(zip(ops[inside], whole[inside]))  # what each op's last event leaves handed out whole
    entering = int(whole[ops < 0][-1]) if (ops < 0).any() else 0
    for index in range(len(counted)):  # an op runs at least with what the events before it left
        most[index] = max(most[index], entering)
        entering = int(left.get(index, entering))
    return int(max(before, simulation.peak_bytes, (counted + most).max()))


def counts_whole_blocks(graph: Graph) -> bool:
    """Whether a budget of allocated bytes on ``graph``'s device counts whole blocks (NOTE [whole blocks]): a CUDA
    step, but not one rank's step of several, whose collectives the allocator model does not replay."""
    return graph.device == "cuda" and not any(op.ranks > 1 for op in graph.ops)


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
    for a budget of live bytes) for fewer live bytes until it does. Raises PlanInfeasible otherwise."""
    return _plan_counted(graph, budget, outside, cost, planned, "reserved")


def plan_in_allocated(graph: Graph, budget: int, cost: CostModel, planned: Callable[[int], Plan],
                      first: tuple[Plan, int]) -> Plan:
    """A plan whose peak as the caching allocator counts allocated bytes fits ``budget`` (NOTE [whole blocks]): made
    by ``planned`` for fewer live bytes until it does, after ``first`` (the plan for ``budget`` itself, its counted
    peak). Raises PlanInfeasible otherwise."""
    return _plan_counted(graph, budget, 0, cost, planned, "allocated", first)


def _plan_counted(graph: Graph, budget: int, outside: int, cost: CostModel, planned: Callable[[int], Plan],
                  counts: str, first: tuple[Plan, int] | None = None) -> Plan:
    peak_of = reserved_peak_bytes if counts == "reserved" else allocated_peak_bytes
    room = budget - outside
    if room <= 0:
        raise PlanInfeasible(f"{format_bytes(outside)} outside the allocator leaves nothing of {format_bytes(budget)} "
                             "for the step: give a larger budget, or measure what the process holds outside the "
                             "allocator (the device's used memory less torch.cuda.memory_reserved())", budget, None)
    search = _Search(room, max(1, int(budget * _STEP)))
    if first is not None:  # the plan for the whole room, made and counted already
        search.made(room, *first)
    for _ in range(TRIES - search.plans):
        if search.next is None:
            break
        allocated = search.next
        try:
            chosen = planned(allocated)
        except PlanInfeasible as err:
            if search.below_policy(err.minimum_bytes):
                continue
            if counts == "allocated" and err.minimum_bytes:  # the least budget that fits, counted as the budget is
                least = planned(err.minimum_bytes)
                counted = max(err.minimum_bytes, peak_of(graph, least, simulate_with(graph, least, cost)))
                raise PlanInfeasible(_infeasible(graph, budget, outside, (err.minimum_bytes, counted),
                                                 f"the least budget that fits is {format_bytes(counted)}", counts),
                                     counted, err.fitting_policy) from None
            raise PlanInfeasible(_infeasible(graph, budget, outside, search.over, str(err), counts),
                                 err.minimum_bytes, err.fitting_policy) from None
        search.made(allocated, chosen, peak_of(graph, chosen, simulate_with(graph, chosen, cost)))
    if search.best is None:
        assert search.over is not None  # every plan made was over the room
        raise PlanInfeasible(_infeasible(graph, budget, outside, search.over, f"after {search.plans} plans, down "
                                         f"to {format_bytes(search.over[0])} of live bytes, the {counts} peak is "
                                         "still over it", counts), search.over[0], None)
    allocated, chosen, counted = search.best
    if counts == "reserved":
        said = (f"planned for {format_bytes(allocated)} allocated: the caching allocator is predicted to reserve "
                f"{format_bytes(counted)}, which with {format_bytes(outside)} outside it fits {format_bytes(budget)}")
    else:  # the budget is the user's, which the plan meets as the allocator counts it
        said = (f"planned for {format_bytes(allocated)} of live bytes: the caching allocator, handing out whole "
                f"blocks, is predicted to count {format_bytes(counted)} allocated, within {format_bytes(budget)}")
        chosen = replace(chosen, budget_bytes=budget)
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


def _infeasible(graph: Graph, budget: int, outside: int, tried: tuple[int, int] | None, why: str,
                counts: str) -> str:
    """One line: the budget as it counts bytes, the last plan made (its live-bytes budget and counted peak), why."""
    if counts == "reserved":
        said = f" (planned for {format_bytes(tried[0])} allocated, it reserves {format_bytes(tried[1])})" \
            if tried else ""
        return (f"no plan fits {graph.model_name} into {format_bytes(budget)} counted as reserved bytes with "
                f"{format_bytes(outside)} outside the allocator{said}: {why.rstrip('.')}")
    said = f" (planned for {format_bytes(tried[0])} of live bytes, it counts {format_bytes(tried[1])})" \
        if tried else ""
    return (f"no plan fits {graph.model_name} into {format_bytes(budget)} as the caching allocator counts "
            f"allocated bytes, whole blocks{said}: {why.rstrip('.')}")
