"""Segment checkpointing as a policy (Chen et al.'s sqrt(n) segments; torch.utils.checkpoint per block).

Forward is cut into k segments at layer boundaries. Inside a segment, saved tensors that
no later segment reads are dropped after forward and rebuilt in backward by re-running
the segment's forward ops once, just before the first backward op that needs any of
them; the tensors a segment hands to the next stay (they are the checkpoints). k starts
at sqrt(number of layers); under a budget the fastest of a few k that fits is kept. With
gradient accumulation each micro-batch's forward is cut into its own k segments. It does
not recompute less when the budget allows more: ``recompute`` does (and falls back to these
segments below what it reaches tensor by tensor).
"""

from __future__ import annotations

import bisect
import math

from udnn_lab.cost.model import CostModel
from udnn_lab.graph.cached import per_graph
from udnn_lab.graph.plan_ir import Plan, PlanError, Recompute, check_recompute
from udnn_lab.graph.reruns import repeated_block
from udnn_lab.graph.step_graph import Graph, ModuleCall, writes_in_place
from udnn_lab.planning._candidates import candidates, writers
from udnn_lab.planning.registry import policy
from udnn_lab.simulation.simulator import simulate_with
from udnn_lab.vocabulary import COLLECTIVE_NAMESPACES, LOSS_SCOPE

NAME = "checkpoint-segments"


@policy(NAME)
def checkpoint_segments(graph: Graph, cost: CostModel, budget: int | None) -> Plan:
    if budget is None:
        return checkpointed(graph, _root(graph), budget)
    times = cost.op_times_s(graph)
    floor = float(times.sum())  # no step is shorter than its ops' time and its recomputations'
    bounded = sorted(((floor + sum(float(times[list(r.ops)].sum()) for r in plan.recomputes), plan)
                      for plan in segment_plans(graph, budget)), key=lambda pair: pair[0])
    best = None
    for bound, plan in bounded:  # in order of that bound, up to a plan that fits no slower than the next's
        if best is not None and bound >= best[0]:
            break
        sim = simulate_with(graph, plan, cost)
        if sim.fits and (best is None or sim.step_time_s < best[0]):
            best = (sim.step_time_s, plan)
    return best[1] if best else checkpointed(graph, _root(graph), budget)


@per_graph  # auto asks for them as a contender and again through recompute's own contenders
def segment_plans(graph: Graph, budget: int | None, name: str = NAME) -> tuple[Plan, ...]:
    """Checkpointing with a few segment counts around sqrt(layers), and per block (``block_plans``)."""
    root = _root(graph)
    counts = sorted({root, max(1, root // 2), root * 2, max(1, _layers_per_forward(graph) // 2)})
    return tuple(checkpointed(graph, k, budget, name) for k in counts) + block_plans(graph, budget, name)


def block_plans(graph: Graph, budget: int | None, name: str = NAME) -> tuple[Plan, ...]:
    """Checkpointing whole calls of the model's repeated block (torch.utils.checkpoint around each block), the
    first n of them for a few n: a runtime that follows hooks re-runs such a call as it is (NOTE [hook points]
    7), where a recording replays its ops one by one. Offered where the step's hook calls are known (a runtime
    can re-run them), or would be on the device (``_blocks_offered``): elsewhere the segments above cover the
    same ground."""
    prefixes = block_prefixes(graph)
    if not prefixes:
        return ()
    counts = {len(prefixes), max(1, len(prefixes) // 2), max(1, len(prefixes) // 4)}
    if len(prefixes) <= 24:  # the last block's recomputation runs as backward starts: keeping it is often as good
        counts.add(len(prefixes) - 1)
    return tuple(Plan(name, graph.fingerprint, budget, recomputes=prefixes[n - 1],
                      notes=(f"checkpointed {n} of {len(prefixes)} {repeated_block(graph)[0].type} calls",))
                 for n in sorted(counts, reverse=True) if n and prefixes[n - 1])


@per_graph  # a budget search asks for the plans at many budgets: their actions do not depend on it
def block_prefixes(graph: Graph) -> tuple[tuple[Recompute, ...], ...]:
    """The recomputations that checkpoint the first n calls of the model's repeated block, for each n from 1
    (a call whose checkpointing is not a valid recomputation is left kept); () where none are offered."""
    blocks = repeated_block(graph)
    if len(blocks) < 2 or not _blocks_offered(graph):
        return ()
    pool = candidates(graph)
    producers = [c.producer for c in pool]
    dropped: set[int] = set()
    actions: list[Recompute] = []
    prefixes = []
    for call in blocks:
        action = _block_checkpointed(graph, call, pool, producers, dropped)
        if action is not None:
            dropped.update(action.tensors)
            actions.append(action)
        prefixes.append(tuple(actions))
    return tuple(prefixes)


def _blocks_offered(graph: Graph) -> bool:
    """The step's hook calls are known, or are not only because CPU kernels stood in for the device's (a CUDA
    step traced without a GPU keeps none: ``Graph.hook_events``): the device's own trace, on which a plan for it
    is followed, has them."""
    return bool(graph.hook_events) or graph.device == "cuda" and graph.fake


def _block_checkpointed(graph: Graph, call: ModuleCall, pool, producers: list[int],
                        dropped: set[int]) -> Recompute | None:
    """The recomputation that checkpoints ``call`` (its saved tensors that no later op of forward reads), after
    ``dropped``; None where there is none, or it is not a valid one."""
    first, last = call.first_op, call.last_op
    within = pool[bisect.bisect_left(producers, first):bisect.bisect_right(producers, last)]
    inside = [c for c in within if c.last_forward <= last and writers(graph, c.tensor)[-1] <= last]
    if not inside:
        return None
    action = Recompute(tuple(c.tensor for c in inside), tuple(range(first, last + 1)),
                       min(c.first_backward for c in inside))
    if any(graph.ops[i].name.split(".")[0] in COLLECTIVE_NAMESPACES for i in action.ops):
        return None
    try:
        check_recompute(graph, action, dropped | set(action.tensors))
    except PlanError:
        return None
    return action


def _root(graph: Graph) -> int:
    return max(1, round(math.sqrt(_layers_per_forward(graph))))


def _layers_per_forward(graph: Graph) -> int:
    """The layers of one micro-batch's forward pass."""
    return max((len(run) for run in _per_forward(forward_layers(graph))), default=0)


def _per_forward(layers) -> list[list[tuple[int, int]]]:
    """The layers of each forward pass (one per micro-batch): runs of layers with no other op between them."""
    runs: list[list[tuple[int, int]]] = []
    for layer in layers:
        if runs and runs[-1][-1][1] == layer[0] - 1:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return runs


def _segments(graph: Graph, segments: int) -> tuple[list[tuple[int, int]], int]:
    """(first op, last op) of each segment, no segment spanning two micro-batches' forward passes; and the
    layers per segment."""
    found, per_segment = [], 1
    for steps in _per_forward(forward_layers(graph)):
        per_segment = max(1, math.ceil(len(steps) / max(segments, 1)))
        for start in range(0, len(steps), per_segment):
            found.append((steps[start][0], steps[min(start + per_segment, len(steps)) - 1][1]))
    return found, per_segment


@per_graph
def forward_layers(graph: Graph) -> tuple[tuple[int, int], ...]:
    """(first op, last op) of each run of consecutive forward ops of one module, the loss's left out.

    A run that writes in place into a tensor made before it (ReLU6(inplace=True) after a
    BatchNorm: autograd clones the input, then the op overwrites it) joins the run before:
    a segment starting there would find its input already overwritten when it replays.
    """
    layers: list[list[int]] = []
    for op in graph.ops:
        if op.phase != "forward" or op.module == LOSS_SCOPE:  # backward starts right after the loss: nothing to gain
            continue
        if layers and graph.ops[layers[-1][1]].module == op.module and layers[-1][1] == op.index - 1:
            layers[-1][1] = op.index
        else:
            layers.append([op.index, op.index])
    merged: list[list[int]] = []
    for first, last in layers:
        if merged and merged[-1][1] == first - 1 and _overwrites_earlier(graph, first, last):
            merged[-1][1] = last
        else:
            merged.append([first, last])
    return tuple((first, last) for first, last in merged)


def _overwrites_earlier(graph: Graph, first: int, last: int) -> bool:
    for i in range(first, last + 1):
        op = graph.ops[i]
        for t in op.inputs:
            producer = graph.tensors[t].producer
            if t in op.outputs and writes_in_place(op.name) and producer is not None and producer < first:
                return True
    return False


def checkpointed(graph: Graph, segments: int, budget: int | None, name: str = NAME) -> Plan:
    pool = candidates(graph)  # in the order forward produces them
    producers = [c.producer for c in pool]
    dropped: set[int] = set()
    actions = []
    cuts, per_segment = _segments(graph, segments)
    for first, last in cuts:
        within = pool[bisect.bisect_left(producers, first):bisect.bisect_right(producers, last)]
        inside = [c for c in within if c.last_forward <= last]
        if not inside:
            continue
        end = max(writers(graph, c.tensor)[-1] for c in inside)  # in-place writes after a producer belong too
        ops = tuple(i for i in range(first, end + 1) if graph.ops[i].phase == "forward")
        if any(graph.ops[i].name.split(".")[0] in COLLECTIVE_NAMESPACES for i in ops):
            continue  # DDP's buffer broadcast: a collective, which one rank cannot re-run alone
        action = Recompute(tuple(c.tensor for c in inside), ops, min(c.first_backward for c in inside))
        try:
            check_recompute(graph, action, dropped | set(action.tensors))
        except PlanError:
            continue  # a segment whose inputs do not outlive it: keep its tensors
        dropped.update(action.tensors)
        actions.append(action)
    return Plan(name, graph.fingerprint, budget, recomputes=tuple(actions),
                notes=(f"{segments} segments of about {per_segment} layers",))
