"""Recomputations a runtime can carry out by calling a module's forward again (NOTE [hook points] 7)."""

from __future__ import annotations

from dataclasses import dataclass

from udnn_lab.graph.cached import per_graph
from udnn_lab.graph.step_graph import Graph, HookEvent, ModuleCall, writes_in_place
from udnn_lab.graph.step_records import TensorInfo
from udnn_lab.vocabulary import COLLECTIVE_NAMESPACES

NOT_RERUN = -1  # a Plan.reruns entry: the recomputation is recorded and replayed op by op
# the buffers batch normalization writes in training: a re-run writes copies of them (NOTE [hook points] 7)
RUNNING_STATISTICS = frozenset({"running_mean", "running_var", "num_batches_tracked"})


@dataclass(frozen=True)
class RerunCall:
    """The module call a recomputation re-runs, as the runtime meets it in the step's hook events."""

    enter: int  # position of the call's 'enter' in the hook events
    exit: int  # position of its 'exit'
    packs: tuple[int, ...]  # positions of the packs between them, in order
    restores: dict[int, int]  # index among those packs -> the Graph tensor id it restores (its first pack)


def module_reruns(graph: Graph, recomputes: tuple) -> tuple[int, ...]:
    """For each recomputation, the position of the 'enter' of the module call whose forward it re-runs whole, or
    NOT_RERUN; () when none is (NOTE [hook points] 7)."""
    events = graph.hook_events
    if not events or not recomputes:
        return ()
    spans, points = _calls_and_points(graph)
    found = tuple(_rerun_of(graph, recompute, spans, points) for recompute in recomputes)
    return found if any(enter != NOT_RERUN for enter in found) else ()


@per_graph
def _calls_and_points(graph: Graph) -> tuple[dict[tuple[int, int], list[tuple[int, int]]], frozenset[int]]:
    """The graph's module call spans and hook points: the same for every plan a planner simulates on it."""
    return call_spans(graph.hook_events), frozenset(event.boundary for event in graph.hook_events)


def call_spans(events: tuple[HookEvent, ...]) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """(first op, one past the last op) -> the (enter, exit) positions of the module calls that run exactly those
    ops and push no saved-tensor hooks, outermost first."""
    spans: dict[tuple[int, int], list[tuple[int, int]]] = {}
    stack: list[int] = []
    for ordinal, event in enumerate(events):
        if event.kind == "enter":
            stack.append(ordinal)
        elif event.kind == "exit" and stack:
            enter = stack.pop()
            if events[enter].own_hooks and event.own_hooks and events[enter].node == event.node:
                spans.setdefault((events[enter].boundary, event.boundary), []).append((enter, ordinal))
    for calls in spans.values():
        calls.sort()
    return spans


def rerun_call(events: tuple[HookEvent, ...], enter: int, tensors: tuple[int, ...]) -> RerunCall:
    """What the runtime needs of the call entered at ``enter`` to restore ``tensors`` by re-running it."""
    depth, exit_ = 0, None
    for ordinal in range(enter, len(events)):
        kind = events[ordinal].kind
        depth += kind == "enter"
        depth -= kind == "exit"
        if depth == 0:
            exit_ = ordinal
            break
    if exit_ is None:
        raise ValueError(f"hook event {enter} is not the 'enter' of a module call that returns")
    packs = tuple(i for i in range(enter, exit_) if events[i].kind == "pack")
    restores: dict[int, int] = {}
    for index, position in enumerate(packs):
        tensor = events[position].tensor
        if tensor in tensors and tensor not in restores.values():
            restores[index] = tensor
    return RerunCall(enter, exit_, packs, restores)


def rerun_calls(events: tuple[HookEvent, ...], enters: tuple[int, ...], recomputes: tuple) -> dict[int, RerunCall]:
    """Recomputation index -> the module call it re-runs, for those ``enters`` (``Plan.reruns``) names."""
    return {index: rerun_call(events, enter, recomputes[index].tensors)
            for index, enter in enumerate(enters) if enter != NOT_RERUN}


@per_graph
def repeated_block(graph: Graph) -> tuple[ModuleCall, ...]:
    """The calls of the module class that, at one depth of the model, runs the most forward ops (a transformer's
    layers, a ResNet's bottlenecks), in forward order; () when none is called twice."""
    groups: dict[tuple[str, int], list[ModuleCall]] = {}
    for call in graph.module_calls:
        if call.path and call.last_op >= call.first_op and graph.ops[call.first_op].phase == "forward":
            groups.setdefault((call.type, call.path.count(".")), []).append(call)
    best = max(groups.values(), key=lambda calls: (len(calls) >= 2, sum(c.last_op - c.first_op + 1 for c in calls)),
               default=[])
    return tuple(sorted(best, key=lambda c: c.first_op)) if len(best) >= 2 else ()


def blocks_taking_objects(graph: Graph) -> str:
    """The class of the step's repeated block when its calls take an argument that is neither a tensor nor a plain
    value (a Hugging Face decoder's cache, made when ``use_cache`` is on), which no recomputation may re-run (NOTE
    [hook points] 7); '' otherwise."""
    calls = repeated_block(graph)
    if not calls:
        return ""
    paths = {call.path for call in calls}
    exits = [e for e in graph.hook_events if e.kind == "exit" and e.path in paths]
    return calls[0].type if exits and not any(e.plain_arguments for e in exits) else ""


def _rerun_of(graph: Graph, recompute, spans: dict, points: frozenset[int]) -> int:
    first, last = recompute.ops[0], recompute.ops[-1]
    if recompute.ops != tuple(range(first, last + 1)) or recompute.at_op not in points:
        return NOT_RERUN
    for op in (graph.ops[i] for i in recompute.ops):
        if op.phase != "forward" or op.name.split(".")[0] in COLLECTIVE_NAMESPACES:
            return NOT_RERUN
        if writes_in_place(op.name) and any(_from_before(graph, t, first) for t in op.outputs if t in op.inputs):
            return NOT_RERUN  # it would write again into what forward left behind
    for enter, exit_ in (*spans.get((first, last + 1), ()), *_forward_only(graph, first, last)):
        call = rerun_call(graph.hook_events, enter, recompute.tensors)
        if call.exit == exit_ and graph.hook_events[exit_].plain_arguments \
                and set(call.restores.values()) == set(recompute.tensors):
            return enter
    return NOT_RERUN


def _forward_only(graph: Graph, first: int, last: int) -> list[tuple[int, int]]:
    """The (enter, exit) of a module call whose forward alone runs ops ``first`` to ``last``, its own forward
    pre-hooks having run ops before them (FSDP2's all-gather; NOTE [hook points] 7): a re-run calls ``forward``,
    which runs those ops only. None where a pre-hook saved a tensor for backward."""
    events = graph.hook_events
    found = []
    for call in _calls_by_ops(graph).get((first, last), ()):
        for enter, exit_ in _calls_by_path(graph).get(call.path, ()):
            starts = events[enter].boundary
            if starts < first and events[exit_].boundary == last + 1 \
                    and not any(events[i].kind == "pack" and events[i].boundary < first for i in range(enter, exit_)):
                found.append((enter, exit_))
    return found


@per_graph
def _calls_by_ops(graph: Graph) -> dict[tuple[int, int], list[ModuleCall]]:
    found: dict[tuple[int, int], list[ModuleCall]] = {}
    for call in graph.module_calls:
        found.setdefault((call.first_op, call.last_op), []).append(call)
    return found


@per_graph
def _calls_by_path(graph: Graph) -> dict[str, list[tuple[int, int]]]:
    """Module path -> the (enter, exit) positions of its calls that push no saved-tensor hooks."""
    found: dict[str, list[tuple[int, int]]] = {}
    for span in call_spans(graph.hook_events).values():
        for enter, exit_ in span:
            path = graph.hook_events[enter].path
            if path is not None:
                found.setdefault(path, []).append((enter, exit_))
    return found


def _from_before(graph: Graph, tensor_id: int, first: int) -> bool:
    tensor = graph.tensors[tensor_id]
    if running_statistic(tensor):
        return False
    return tensor.producer is None or tensor.producer < first


def running_statistic(tensor: TensorInfo) -> bool:
    """Whether it is batch normalization's running statistic, which a recomputation writes a copy of (NOTE [hook
    points] 7, NOTE [offload runtime] 6)."""
    return tensor.category == "buffer" and tensor.name.rsplit(".", 1)[-1] in RUNNING_STATISTICS
