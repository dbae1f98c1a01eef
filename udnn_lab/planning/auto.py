"""auto: choose keep, offload or recompute per saved tensor, jointly, for the fastest step that fits.

For each candidate it prices both ways out of memory: a recompute costs re-running its
producer and the in-place ops that follow it (when their inputs outlive it); offloads
share the copy streams, so they cost nothing while their copies fit in the compute they
overlap, and their whole copy time beyond. An offload is away from when its copy out
would be done until a prefetch early enough for its copy in to be hidden; where a peak
comes later than that, its prefetch moves to just before its use, at the cost of the
wait. Greedily, at the op where the estimated curve peaks, it drops whatever frees bytes
for the least time, until the estimate fits; the simulator checks, and it aims lower if
it must. Then every other policy is planned and simulated as well; the fastest of them
that do not fit are completed by the same greedy (what they still need, on top of their
actions), and the fastest plan that fits wins, so auto is never slower (in simulation)
than any of them. ``optimal`` (the exact reference) measures how far from the best it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from udnn_lab.cost.model import CostModel
from udnn_lab.graph.plan_ir import Offload, Plan, Recompute, replay_reads
from udnn_lab.graph.step_graph import Graph
from udnn_lab.planning._candidates import Candidate, candidates, first_backward_op, prefetch_point
from udnn_lab.planning._estimate import CurveEstimate
from udnn_lab.planning._rebuild import rebuilds
from udnn_lab.planning.registry import POLICIES, policy
from udnn_lab.planning.vdnn import MARGINS, SIZE_FLOOR, pinned_pool_bytes
from udnn_lab.simulation.simulator import simulate_with

LOOKAHEAD = 2
HIDE = 2.0  # a prefetch is issued this many copy times before its first reader: hidden even behind another copy
COMPLETED = 2  # how many of the fastest plans that do not fit auto completes
_NOT_CONTENDERS = ("auto", "vdnn-dyn", "optimal")  # vdnn-dyn picks among others; optimal is the exact reference


@dataclass(frozen=True)
class _Option:
    candidate: Candidate
    action: str  # 'offload' or 'recompute'
    window: tuple[int, int]  # ops it is away from the device
    cost_s: float  # recompute: the ops' time; offload: both copies' time (hidden, or not, by _choose)
    d2h_s: float = 0.0
    h2d_s: float = 0.0
    exposed_s: float = 0.0  # offload: copy-in time its first reader waits for, even with the stream free
    late: bool = False  # offload: prefetched just before its use, only to move an offload's prefetch later
    ops: tuple[int, ...] = ()  # forward ops a recompute re-runs
    sources: tuple[int, ...] = ()  # tensors a recompute needs kept


@policy("auto")
def auto(graph: Graph, cost: CostModel, budget: int | None) -> Plan:
    if budget is None:
        return Plan.keep_all(graph)  # nothing to save: every action only adds time
    contenders = [joint(graph, cost, budget)]
    contenders += [POLICIES[name](graph, cost, budget) for name in POLICIES if name not in _NOT_CONTENDERS]
    runs = [(simulate_with(graph, plan, cost), plan) for plan in contenders]
    # the fastest plans that act but do not fit, with what they still need chosen by the same greedy
    over = sorted((sim.step_time_s, i) for i, (sim, plan) in enumerate(runs)
                  if not sim.fits and (plan.offloads or plan.recomputes))
    bases = list({(runs[i][1].offloads, runs[i][1].recomputes): runs[i][1] for _, i in reversed(over)}.values())
    for base in bases[::-1][:COMPLETED]:
        completed = joint(graph, cost, budget, base=base)
        runs.append((simulate_with(graph, completed, cost), completed))
    best = None
    for sim, plan in runs:
        key = (sim.step_time_s, len(plan.offloads) + len(plan.recomputes))
        if sim.fits and (best is None or key < best[0]):
            best = (key, plan)
    chosen = best[1] if best else contenders[0]
    return Plan("auto", chosen.graph_fingerprint, budget, chosen.offloads, chosen.recomputes,
                chosen.pinned_pool_bytes, chosen.size_floor_bytes, chosen.notes + (f"chose {chosen.policy}",))


def joint(graph: Graph, cost: CostModel, budget: int, base: Plan | None = None) -> Plan:
    """The joint keep/offload/recompute greedy, checked by simulation; from ``base``'s actions if given."""
    options = _options(graph, cost)
    times = cost.op_times_s(graph)
    boundary = first_backward_op(graph)
    hideable = (float(times[:boundary].sum()), float(times[boundary:].sum()))  # copy time each stream can hide
    plan = _build(graph, budget, [], base)
    for margin in MARGINS:
        plan = _build(graph, budget, _choose(graph, options, budget * (1 - margin), hideable, base), base)
        if simulate_with(graph, plan, cost).fits:
            break
    return plan


def _options(graph: Graph, cost: CostModel) -> list[_Option]:
    found = []
    starts = np.concatenate([[0.0], np.cumsum(cost.op_times_s(graph))])  # each op's start with nothing delaying it
    for c in candidates(graph, SIZE_FLOOR):
        if c.last_forward >= first_backward_op(graph):
            continue
        d2h, h2d = cost.transfer_time_s(c.nbytes, "d2h"), cost.transfer_time_s(c.nbytes, "h2d")
        # away from when its copy out is done until the op that leaves its copy in time to be done
        gone = max(c.freed_after + 1, int(np.searchsorted(starts, starts[c.last_forward + 1] + d2h)))
        ahead = int(np.searchsorted(starts, starts[c.first_backward] - HIDE * h2d, side="right")) - 1
        reader = _first_reader(graph, c)
        # in time to be hidden; and, to cover a peak just before the tensor is needed, as late as it can be
        early = min(prefetch_point(graph, c.first_backward, LOOKAHEAD), ahead)
        for prefetch in sorted({early, c.first_backward - 1}):
            if prefetch > gone:
                exposed = max(0.0, h2d - float(starts[reader] - starts[prefetch]))
                found.append(_Option(c, "offload", (gone, prefetch), d2h + h2d, d2h, h2d, exposed_s=exposed,
                                     late=prefetch != early))
    for r in rebuilds(graph, cost, SIZE_FLOOR):
        # back on the device from the op before its replay (NOTE [simulated streams] 1)
        window = (r.window[0], r.candidate.first_backward - 1)
        found.append(_Option(r.candidate, "recompute", window, r.time_s, ops=r.ops, sources=r.sources))
    return found


def _choose(graph: Graph, options: list[_Option], target: float, hideable: tuple[float, float],
            base: Plan | None = None) -> list[_Option]:
    """Drop, at the estimated peak, whatever frees bytes for the least time, until the estimate fits.

    A recompute costs its ops' time. Offloads share the copy streams: while the copies fit
    in the compute time they overlap (forward for the copies out, backward for the copies
    in) they cost nothing, beyond that their whole copy time.
    """
    estimate = CurveEstimate(graph)
    recomputes = sorted((o for o in options if o.action == "recompute"),
                        key=lambda o: (o.cost_s / estimate.size(o.candidate), o.candidate.tensor))
    offloads = sorted((o for o in options if o.action == "offload"),
                      key=lambda o: (-o.candidate.nbytes, o.exposed_s, o.candidate.tensor))
    chosen: dict[int, _Option] = {}
    pinned: set[int] = set()  # sources of chosen recomputes: they must stay
    away: set[int] = set()  # what base offloads or recomputes: no replay may read it
    d2h_left, h2d_left = hideable
    if base is not None:
        pinned |= _taken(graph, base, estimate)
        away = {o.tensor for o in base.offloads} | {t for r in base.recomputes for t in r.tensors}
        d2h_left -= sum(cost_of for cost_of in _copy_times(base, options, "d2h"))
        h2d_left -= sum(cost_of for cost_of in _copy_times(base, options, "h2d"))
    peak, op = estimate.peak()
    while peak > target:
        recompute = _first(recomputes, op, chosen, pinned, away)
        offload = _first(offloads, op, chosen, pinned, away)
        if recompute is None and offload is None:
            break
        offload_cost = float("inf") if offload is None else \
            max(0.0, offload.d2h_s - d2h_left) + max(0.0, offload.h2d_s - h2d_left) + offload.exposed_s
        if offload is None or (recompute is not None and recompute.cost_s / estimate.size(recompute.candidate)
                               < offload_cost / estimate.size(offload.candidate)):
            assert recompute is not None  # not with offload None too: the loop broke then
            pick = recompute
        else:
            pick = offload
        before = chosen.get(pick.candidate.tensor)
        if pick.action == "offload" and before is None:
            d2h_left, h2d_left = d2h_left - pick.d2h_s, h2d_left - pick.h2d_s
        chosen[pick.candidate.tensor] = pick
        pinned.update(pick.sources)
        # a later prefetch of a tensor already offloaded keeps it away longer: only the difference is new
        estimate.drop(pick.candidate, pick.window if before is None else (before.window[1], pick.window[1]))
        peak, op = estimate.peak()
    return list(chosen.values())


def _first(ranked: list[_Option], op: int, chosen: dict[int, _Option], pinned: set[int],
           away: set[int]) -> _Option | None:
    """The best option away at ``op``; options no longer allowed are dropped from ``ranked`` on the way
    (what is chosen or pinned stays so), so each is passed over at most once."""
    stale = []
    found = None
    for index, option in enumerate(ranked):
        if not _allowed(option, chosen, pinned, away):
            stale.append(index)
        elif option.window[0] <= op < option.window[1]:
            found = option
            break
    for index in reversed(stale):
        del ranked[index]
    return found


def _allowed(option: _Option, chosen: dict[int, _Option], pinned: set[int], away: set[int]) -> bool:
    tensor = option.candidate.tensor
    before = chosen.get(tensor)
    if before is not None:  # an offload may still be prefetched later, to cover a peak closer to its use
        return option.action == before.action == "offload" and option.window[1] > before.window[1]
    return not option.late and tensor not in pinned and not any(s in chosen or s in away for s in option.sources)


def _first_reader(graph: Graph, c: Candidate) -> int:
    """The first op after forward that reads the tensor (it waits for a prefetch)."""
    return next((i for i in graph.tensors[c.tensor].consumers if i >= c.first_backward), c.first_backward)


def _taken(graph: Graph, base: Plan, estimate: CurveEstimate) -> set[int]:
    """Take ``base``'s tensors out of the estimate; what they are and what its replays read stays as it is."""
    where = {c.tensor: c for c in candidates(graph)}
    taken: set[int] = set()
    for offload in base.offloads:
        if offload.tensor in where:
            estimate.drop(where[offload.tensor], (where[offload.tensor].freed_after + 1, offload.prefetch_at))
        taken.add(offload.tensor)
    for recompute in base.recomputes:
        taken |= replay_reads(graph, recompute.ops) | set(recompute.tensors)
        for t in recompute.tensors:
            if t in where:
                estimate.drop(where[t], (where[t].freed_after + 1, recompute.at_op - 1))
    return taken


def _copy_times(base: Plan, options: list[_Option], direction: str) -> list[float]:
    offloaded = {o.tensor for o in base.offloads}
    return [o.d2h_s if direction == "d2h" else o.h2d_s for o in options
            if o.action == "offload" and o.candidate.tensor in offloaded]


def _build(graph: Graph, budget: int, chosen: list[_Option], base: Plan | None = None) -> Plan:
    offloads = tuple(sorted([Offload(o.candidate.tensor, o.candidate.last_forward, o.window[1])
                             for o in chosen if o.action == "offload"] + list(base.offloads if base else ()),
                            key=lambda x: (x.after_op, x.tensor)))
    recomputes = tuple(sorted([Recompute((o.candidate.tensor,), o.ops, o.candidate.first_backward)
                               for o in chosen if o.action == "recompute"] + list(base.recomputes if base else ()),
                              key=lambda r: (r.at_op, r.tensors)))
    name = "auto-joint" if base is None else f"{base.policy} completed by auto-joint"
    return Plan(name, graph.fingerprint, budget, offloads=offloads, recomputes=recomputes,
                pinned_pool_bytes=pinned_pool_bytes(graph, offloads), size_floor_bytes=SIZE_FLOOR)
