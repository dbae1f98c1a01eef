"""auto: choose keep, offload or recompute per saved tensor, jointly, for the fastest step that fits.

For each candidate it prices both ways out of memory: a recompute costs re-running its
producer and the in-place ops that follow it (when their inputs outlive it); offloads
share the copy streams, so they cost nothing while their copies fit in the compute they
overlap, and their whole copy time beyond. Greedily, at the op where the estimated curve
peaks, it drops whatever frees bytes for the least time, until the estimate fits; the
simulator checks, and it aims lower if it must.
Then every other policy is planned and simulated as well, and the fastest plan that
fits wins, so auto is never slower (in simulation) than any of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from udnn_lab.cost.model import CostModel
from udnn_lab.graph.plan_ir import Offload, Plan, Recompute
from udnn_lab.graph.step_graph import Graph
from udnn_lab.planning._candidates import Candidate, candidates, first_backward_op, prefetch_point
from udnn_lab.planning._estimate import CurveEstimate
from udnn_lab.planning._rebuild import rebuilds
from udnn_lab.planning.registry import POLICIES, policy
from udnn_lab.planning.vdnn import MARGINS, SIZE_FLOOR, pinned_pool_bytes
from udnn_lab.simulation.simulator import simulate_with

LOOKAHEAD = 2
_NOT_CONTENDERS = ("auto", "vdnn-dyn", "optimal")  # vdnn-dyn picks among others; optimal is the exact reference


@dataclass(frozen=True)
class _Option:
    candidate: Candidate
    action: str  # 'offload' or 'recompute'
    window: tuple[int, int]  # ops it is away from the device
    cost_s: float  # recompute: the ops' time; offload: both copies' time (hidden, or not, by _choose)
    d2h_s: float = 0.0
    h2d_s: float = 0.0
    ops: tuple[int, ...] = ()  # forward ops a recompute re-runs
    sources: tuple[int, ...] = ()  # tensors a recompute needs kept


@policy("auto")
def auto(graph: Graph, cost: CostModel, budget: int | None) -> Plan:
    if budget is None:
        return Plan.keep_all(graph)  # nothing to save: every action only adds time
    contenders = [joint(graph, cost, budget)]
    contenders += [POLICIES[name](graph, cost, budget) for name in POLICIES if name not in _NOT_CONTENDERS]
    best = None
    for plan in contenders:
        sim = simulate_with(graph, plan, cost)
        key = (sim.step_time_s, len(plan.offloads) + len(plan.recomputes))
        if sim.fits and (best is None or key < best[0]):
            best = (key, plan)
    chosen = best[1] if best else contenders[0]
    return Plan("auto", chosen.graph_fingerprint, budget, chosen.offloads, chosen.recomputes,
                chosen.pinned_pool_bytes, chosen.size_floor_bytes, chosen.notes + (f"chose {chosen.policy}",))


def joint(graph: Graph, cost: CostModel, budget: int) -> Plan:
    """The joint keep/offload/recompute greedy, checked by simulation."""
    options = _options(graph, cost)
    times = cost.op_times_s(graph)
    boundary = first_backward_op(graph)
    hideable = (float(times[:boundary].sum()), float(times[boundary:].sum()))  # copy time each stream can hide
    plan = _build(graph, budget, [])
    for margin in MARGINS:
        plan = _build(graph, budget, _choose(graph, options, budget * (1 - margin), hideable))
        if simulate_with(graph, plan, cost).fits:
            break
    return plan


def _options(graph: Graph, cost: CostModel) -> list[_Option]:
    found = []
    for c in candidates(graph, SIZE_FLOOR):
        if c.last_forward >= first_backward_op(graph):
            continue
        prefetch = prefetch_point(graph, c.first_backward, LOOKAHEAD)
        d2h, h2d = cost.transfer_time_s(c.nbytes, "d2h"), cost.transfer_time_s(c.nbytes, "h2d")
        if prefetch > c.freed_after:
            found.append(_Option(c, "offload", (c.freed_after + 1, prefetch), d2h + h2d, d2h, h2d))
    for r in rebuilds(graph, cost, SIZE_FLOOR):
        found.append(_Option(r.candidate, "recompute", r.window, r.time_s, ops=r.ops, sources=r.sources))
    return found


def _choose(graph: Graph, options: list[_Option], target: float, hideable: tuple[float, float]) -> list[_Option]:
    """Drop, at the estimated peak, whatever frees bytes for the least time, until the estimate fits.

    A recompute costs its ops' time. Offloads share the copy streams: while the copies fit
    in the compute time they overlap (forward for the copies out, backward for the copies
    in) they cost nothing, beyond that their whole copy time.
    """
    estimate = CurveEstimate(graph)
    recomputes = sorted((o for o in options if o.action == "recompute"),
                        key=lambda o: (o.cost_s / estimate.size(o.candidate), o.candidate.tensor))
    offloads = sorted((o for o in options if o.action == "offload"),
                      key=lambda o: (-o.candidate.nbytes, o.candidate.tensor))
    chosen: dict[int, _Option] = {}
    pinned: set[int] = set()  # sources of chosen recomputes: they must stay
    d2h_left, h2d_left = hideable
    peak, op = estimate.peak()
    while peak > target:
        recompute = _first(recomputes, op, chosen, pinned)
        offload = _first(offloads, op, chosen, pinned)
        if recompute is None and offload is None:
            break
        offload_cost = float("inf") if offload is None else \
            max(0.0, offload.d2h_s - d2h_left) + max(0.0, offload.h2d_s - h2d_left)
        if offload is None or (recompute is not None and recompute.cost_s / estimate.size(recompute.candidate)
                               < offload_cost / estimate.size(offload.candidate)):
            assert recompute is not None  # not with offload None too: the loop broke then
            pick = recompute
        else:
            pick = offload
            d2h_left, h2d_left = d2h_left - offload.d2h_s, h2d_left - offload.h2d_s
        chosen[pick.candidate.tensor] = pick
        pinned.update(pick.sources)
        estimate.drop(pick.candidate, pick.window)
        peak, op = estimate.peak()
    return list(chosen.values())


def _first(ranked: list[_Option], op: int, chosen: dict[int, _Option], pinned: set[int]) -> _Option | None:
    """The best option away at ``op``; options no longer allowed are dropped from ``ranked`` on the way
    (what is chosen or pinned stays so), so each is passed over at most once."""
    stale = []
    found = None
    for index, option in enumerate(ranked):
        if not _allowed(option, chosen, pinned):
            stale.append(index)
        elif option.window[0] <= op < option.window[1]:
            found = option
            break
    for index in reversed(stale):
        del ranked[index]
    return found


def _allowed(option: _Option, chosen: dict[int, _Option], pinned: set[int]) -> bool:
    tensor = option.candidate.tensor
    return tensor not in chosen and tensor not in pinned and not any(s in chosen for s in option.sources)


def _build(graph: Graph, budget: int, chosen: list[_Option]) -> Plan:
    offloads = tuple(sorted((Offload(o.candidate.tensor, o.candidate.last_forward, o.window[1])
                             for o in chosen if o.action == "offload"), key=lambda x: (x.after_op, x.tensor)))
    recomputes = tuple(sorted((Recompute((o.candidate.tensor,), o.ops, o.candidate.first_backward)
                               for o in chosen if o.action == "recompute"), key=lambda r: (r.at_op, r.tensors)))
    return Plan("auto-joint", graph.fingerprint, budget, offloads=offloads, recomputes=recomputes,
                pinned_pool_bytes=pinned_pool_bytes(graph, offloads), size_floor_bytes=SIZE_FLOOR)
