"""vDNN's policies (document 002) and vDNN++'s fixes (document 003).

vDNN offloads a layer's input after the layer's forward and makes the next layer wait
for that copy (its per-layer synchronisation), prefetches one layer ahead in backward,
and gives every offloaded tensor its own pinned host buffer. vDNN++ drops the wait
(no delayed computation start), prefetches earlier, offloads only what the budget needs,
and shares one pinned pool among tensors whose host lifetimes do not overlap.
"""

from __future__ import annotations

from udnn_lab.cost.model import CostModel
from udnn_lab.graph.plan_ir import Offload, Plan
from udnn_lab.graph.step_graph import Graph
from udnn_lab.planning._candidates import Candidate, candidates, first_backward_op, next_forward_op, prefetch_point
from udnn_lab.planning._curve_estimate import choose_until_fits
from udnn_lab.planning.registry import policy
from udnn_lab.simulation.simulator import simulate_with

SIZE_FLOOR = 64 << 10  # smaller feature maps are not worth a copy
PLUS_PLUS_LOOKAHEAD = 3  # backward layers between a prefetch and the layer that needs it
MARGINS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.35)  # how far below budget to aim when the simulator disagrees


@policy("vdnn-all")
def vdnn_all(graph: Graph, cost: CostModel, budget: int | None) -> Plan:
    """vDNN_all: offload the input of every layer."""
    return _vdnn(graph, budget, "vdnn-all", candidates(graph, SIZE_FLOOR))


@policy("vdnn-conv")
def vdnn_conv(graph: Graph, cost: CostModel, budget: int | None) -> Plan:
    """vDNN_conv: offload only the inputs of convolution layers."""
    return _vdnn(graph, budget, "vdnn-conv", [c for c in candidates(graph, SIZE_FLOOR) if c.conv_input])


@policy("vdnn-dyn", chooses=True)
def vdnn_dyn(graph: Graph, cost: CostModel, budget: int | None) -> Plan:
    """vDNN_dyn: the fastest of keep-all, vDNN_conv and vDNN_all that fits (by simulation)."""
    options = [Plan.keep_all(graph, budget), vdnn_conv(graph, cost, budget), vdnn_all(graph, cost, budget)]
    runs = [(simulate_with(graph, option, cost), option) for option in options]
    fitting = [(sim.step_time_s, i) for i, (sim, _) in enumerate(runs) if sim.fits]
    chosen = runs[min(fitting)[1]][1] if fitting else options[-1]
    return _renamed(chosen, "vdnn-dyn")


def _vdnn(graph: Graph, budget: int | None, policy: str, chosen: list[Candidate]) -> Plan:
    offloads = tuple(
        Offload(c.tensor, c.last_forward, prefetch_point(graph, c.first_backward, 1), pinned=True,
                wait_before=next_forward_op(graph, c.last_forward))
        for c in chosen if _worth_moving(graph, c)
    )
    pinned = sum(graph.tensors[o.tensor].nbytes for o in offloads)  # one pinned buffer per tensor
    return Plan(policy, graph.fingerprint, budget, offloads=offloads, pinned_pool_bytes=pinned,
                size_floor_bytes=SIZE_FLOOR)


@policy("vdnn++")
def vdnn_plus_plus(graph: Graph, cost: CostModel, budget: int | None) -> Plan:
    """vDNN++: offload the fewest, longest-idle tensors that bring the peak under budget; no wait; early prefetch."""
    pool = [c for c in candidates(graph, SIZE_FLOOR) if _worth_moving(graph, c)]
    if budget is None:
        return _plus_plus(graph, budget, [])

    def window(c: Candidate) -> tuple[int, int]:
        return c.freed_after + 1, prefetch_point(graph, c.first_backward, PLUS_PLUS_LOOKAHEAD)

    plan = _plus_plus(graph, budget, [])
    for margin in MARGINS:
        chosen = choose_until_fits(graph, pool, budget * (1 - margin), window,
                                   score=lambda c: c.first_backward - c.freed_after)
        plan = _plus_plus(graph, budget, chosen)
        if simulate_with(graph, plan, cost).fits:
            break
    return plan


def _plus_plus(graph: Graph, budget: int | None, chosen: list[Candidate]) -> Plan:
    offloads = tuple(sorted(
        (Offload(c.tensor, c.last_forward, prefetch_point(graph, c.first_backward, PLUS_PLUS_LOOKAHEAD), pinned=True)
         for c in chosen), key=lambda o: (o.after_op, o.tensor)))
    return Plan("vdnn++", graph.fingerprint, budget, offloads=offloads,
                pinned_pool_bytes=pinned_pool_bytes(graph, offloads), size_floor_bytes=SIZE_FLOOR)


def pinned_pool_bytes(graph: Graph, offloads: tuple[Offload, ...]) -> int:
    """Most bytes in host memory at once: a pool reused by tensors whose host lifetimes do not overlap."""
    events = sorted([(o.after_op, graph.tensors[o.tensor].nbytes) for o in offloads]
                    + [(o.prefetch_at, -graph.tensors[o.tensor].nbytes) for o in offloads],
                    key=lambda e: (e[0], e[1]))
    held = most = 0
    for _, delta in events:
        held += delta
        most = max(most, held)
    return most


def _worth_moving(graph: Graph, candidate: Candidate) -> bool:
    """Idle across the forward/backward boundary, so there is time to move it out and back."""
    return candidate.freed_after < first_backward_op(graph) and \
        prefetch_point(graph, candidate.first_backward, 1) > candidate.freed_after


def _renamed(plan: Plan, policy: str) -> Plan:
    return Plan(policy, plan.graph_fingerprint, plan.budget_bytes, plan.offloads, plan.recomputes,
                plan.pinned_pool_bytes, plan.size_floor_bytes, plan.notes,
                chosen_policy=plan.chosen_policy or plan.policy)
