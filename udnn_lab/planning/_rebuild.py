"""Rebuilding one saved tensor: the forward ops that remake it, what they need kept, and what that costs.

A tensor is rebuilt by re-running its producer and the forward ops that write its storage
again (in-place activations, views), just before the first backward op that needs it. The
tensors those ops read must still be on the device then (its sources). Planners rank these
options by recompute time per byte freed (the cost model's op times on the hardware).
"""

from __future__ import annotations

from dataclasses import dataclass

from udnn_lab.cost.model import CostModel
from udnn_lab.graph.plan_ir import Recompute, gathered_at, kept_by_the_step, written_after
from udnn_lab.graph.step_graph import Graph
from udnn_lab.planning._candidates import Candidate, candidates, first_backward_op, writers
from udnn_lab.planning._curve_estimate import CurveEstimate


@dataclass(frozen=True)
class Rebuild:
    candidate: Candidate
    ops: tuple[int, ...]  # forward ops re-run, in order
    sources: tuple[int, ...]  # tensors they read that must stay on the device
    time_s: float  # the ops' compute time

    @property
    def window(self) -> tuple[int, int]:
        """Ops [first, last) the tensor is off the device."""
        return self.candidate.freed_after + 1, self.candidate.first_backward

    def action(self) -> Recompute:
        return Recompute((self.candidate.tensor,), self.ops, self.candidate.first_backward)


def rebuilds(graph: Graph, cost: CostModel, size_floor: int = 0) -> list[Rebuild]:
    """Every candidate of at least ``size_floor`` bytes that can be rebuilt from tensors that outlive it."""
    times = cost.op_times_s(graph)
    boundary = first_backward_op(graph)
    found = []
    for c in candidates(graph, size_floor):
        if c.last_forward >= boundary:
            continue
        ops = writers(graph, c.tensor)
        sources = _sources(graph, c, ops)
        if sources is not None:
            found.append(Rebuild(c, ops, sources, float(sum(times[i] for i in ops))))
    return found


def _sources(graph: Graph, c: Candidate, ops: tuple[int, ...]) -> tuple[int, ...] | None:
    """Tensors those ops read that must stay; None if one of them does not outlive the recompute."""
    needed = []
    for source in {s for i in ops for s in graph.ops[i].inputs} - {c.tensor}:
        tensor = graph.tensors[source]
        if written_after(graph, source, min(i for i in ops if source in graph.ops[i].inputs)) is not None:
            return None  # overwritten in place after the recompute reads it: forward cannot be replayed
        if kept_by_the_step(tensor):
            continue
        if tensor.category == "parameter":  # FSDP2's unsharded storage: there if gathered again by then
            if not gathered_at(graph, source, c.first_backward):
                return None
            continue
        if tensor.free_step is not None and tensor.free_step < c.first_backward:
            return None
        needed.append(source)
    return tuple(sorted(needed))


def cheapest_first(graph: Graph, cost: CostModel) -> tuple[tuple[Rebuild, ...], tuple[float, ...]]:
    """The order budget-aware recompute drops tensors in, and the estimated peak after each drop.

    At the op where the estimated curve peaks, drop the tensor away there that costs the
    least recompute time per byte freed; a dropped tensor's sources stay, and a tensor that
    needs a dropped one is passed over. The order does not depend on the budget, so a
    larger budget takes a prefix of a smaller one's drops: recompute time only falls as the
    budget grows. Kept in the cost model's memo (the budget search asks again and again).
    """
    key = ("recompute order", id(graph), graph.fingerprint)
    if key not in cost.memo:
        cost.memo[key] = _order(graph, rebuilds(graph, cost))
    return cost.memo[key]


def _order(graph: Graph, options: list[Rebuild]) -> tuple[tuple[Rebuild, ...], tuple[float, ...]]:
    estimate = CurveEstimate(graph)
    ranked = sorted(options, key=lambda o: (o.time_s / max(1, estimate.size(o.candidate)), o.candidate.tensor))
    order: list[Rebuild] = []
    peaks: list[float] = [estimate.peak()[0]]
    dropped: set[int] = set()
    kept: set[int] = set()  # sources of dropped tensors
    while True:
        peak, op = estimate.peak()
        pick = _first_away(ranked, op, dropped, kept)
        if pick is None:
            break
        order.append(pick)
        dropped.add(pick.candidate.tensor)
        kept.update(pick.sources)
        estimate.drop(pick.candidate, pick.window)
        peaks.append(estimate.peak()[0])
    return tuple(order), tuple(peaks)


def _first_away(ranked: list[Rebuild], op: int, dropped: set[int], kept: set[int]) -> Rebuild | None:
    """Take the best option away at ``op`` out of ``ranked``; options no longer allowed leave it on the way."""
    stale = []
    found = None
    for index, option in enumerate(ranked):
        if option.candidate.tensor in kept or not dropped.isdisjoint(option.sources):
            stale.append(index)
        elif option.window[0] <= op < option.window[1]:
            found = index
            break
    pick = ranked[found] if found is not None else None
    for index in sorted(stale + ([found] if found is not None else []), reverse=True):
        del ranked[index]
    return pick
