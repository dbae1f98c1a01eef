"""auto: choose keep, offload or recompute per saved tensor, jointly, for the fastest step that fits.

For each candidate it prices both ways out of memory: an offload costs the part of its
copies that compute cannot hide (the copies against the compute time between its last
forward use and its first backward use), a recompute costs re-running its producer (when
the producer's inputs outlive it). Greedily, at the op where the estimated curve peaks,
it drops the candidate that frees the most bytes per second of cost, by its cheaper
action, until the estimate fits; the simulator checks, and it aims lower if it must.
Then every other policy is planned and simulated as well, and the fastest plan that
fits wins, so auto is never slower (in simulation) than any of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from udnn_lab.cost import CostModel
from udnn_lab.graph import Graph
from udnn_lab.plan.candidates import Candidate, candidates, first_backward_op, prefetch_point, writers
from udnn_lab.plan.estimate import CurveEstimate
from udnn_lab.plan.ir import Offload, Plan, Recompute
from udnn_lab.plan.vdnn import MARGINS, SIZE_FLOOR, pinned_pool_bytes
from udnn_lab.simulate import simulate_with

LOOKAHEAD = 2
_KEPT = ("parameter", "buffer", "input")


@dataclass(frozen=True)
class _Option:
    candidate: Candidate
    action: str  # 'offload' or 'recompute'
    window: tuple[int, int]  # ops it is away from the device
    cost_s: float
    ops: tuple[int, ...] = ()  # forward ops a recompute re-runs
    sources: tuple[int, ...] = ()  # tensors a recompute needs kept


def auto(graph: Graph, cost: CostModel, budget: int | None) -> Plan:
    from udnn_lab.plan.policies import POLICIES

    if budget is None:
        return Plan.keep_all(graph)  # nothing to save: every action only adds time
    contenders = [joint(graph, cost, budget)]
    contenders += [POLICIES[name](graph, cost, budget) for name in POLICIES if name not in ("auto", "vdnn-dyn")]
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
    plan = _build(graph, budget, [])
    for margin in MARGINS:
        plan = _build(graph, budget, _choose(graph, options, budget * (1 - margin)))
        if simulate_with(graph, plan, cost).fits:
            break
    return plan


def _options(graph: Graph, cost: CostModel) -> list[_Option]:
    times = cost.op_times_s(graph)
    elapsed = np.concatenate([[0.0], np.cumsum(times)])
    boundary = first_backward_op(graph)
    found = []
    for c in candidates(graph, SIZE_FLOOR):
        if c.last_forward >= boundary:
            continue
        prefetch = prefetch_point(graph, c.first_backward, LOOKAHEAD)
        hidden = elapsed[c.first_backward] - elapsed[c.last_forward + 1]
        copies = cost.transfer_time_s(c.nbytes, "d2h") + cost.transfer_time_s(c.nbytes, "h2d")
        if prefetch > c.last_forward:
            found.append(_Option(c, "offload", (c.last_forward + 1, prefetch), max(0.0, copies - hidden) + 1e-3 * copies))
        ops = writers(graph, c.tensor)
        sources = _recompute_sources(graph, c, ops)
        if sources is not None:
            found.append(_Option(c, "recompute", (c.last_forward + 1, c.first_backward),
                                 float(sum(times[i] for i in ops)), ops, sources))
    return found


def _recompute_sources(graph: Graph, c: Candidate, ops: tuple[int, ...]) -> tuple[int, ...] | None:
    """Tensors those ops read that must stay; None if one of them does not outlive the recompute."""
    needed = []
    for source in {s for i in ops for s in graph.ops[i].inputs} - {c.tensor}:
        tensor = graph.tensors[source]
        if tensor.category in _KEPT:
            continue
        if tensor.free_step is not None and tensor.free_step < c.first_backward:
            return None
        needed.append(source)
    return tuple(sorted(needed))


def _choose(graph: Graph, options: list[_Option], target: float) -> list[_Option]:
    estimate = CurveEstimate(graph)
    ranked = sorted(options, key=lambda o: (-estimate.size(o.candidate) / (o.cost_s + 1e-9), o.candidate.tensor))
    chosen: dict[int, _Option] = {}
    pinned: set[int] = set()  # sources of chosen recomputes: they must stay
    peak, op = estimate.peak()
    while peak > target:
        pick = next((o for o in ranked if o.window[0] <= op < o.window[1] and _allowed(o, chosen, pinned)), None)
        if pick is None:
            break
        chosen[pick.candidate.tensor] = pick
        pinned.update(pick.sources)
        estimate.drop(pick.candidate, pick.window)
        peak, op = estimate.peak()
    return list(chosen.values())


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
