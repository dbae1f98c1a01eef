"""Allocation and free events of a training step, for the allocator model to replay.

Three sources: the eager step of a Graph, the same step under a Plan as simulated,
and a real allocator's trace (``torch.cuda.memory._snapshot()['device_traces']``).

NOTE [event order of a step]
  1. Tensors that exist before the step (parameters, buffers, optimizer state, inputs)
     are allocated first, in tensor-id order. Zero-byte tensors make no event: the
     real allocator hands out no block for them.
  2. Op i allocates the storages it creates in the order of ``op.allocated``; then the
     tensors released after it are freed in the order of ``op.released``.
  3. Under a plan (simulation/simulator.py's NOTE [simulated streams]): an offloaded tensor is freed
     when its device-to-host copy ends, placed before the first allocation that starts
     at or after that time; a prefetch allocates when compute issues it (before op
     ``prefetch_at``); a recomputation allocates the tensors it restores just before
     op ``at_op``, after that op's prefetches; a recomputed tensor is freed after its
     last forward use. A tensor's later life is a new block, ``<name>~prefetch`` or
     ``<name>~recompute``; a cancelled prefetch means the tensor never left.
  4. Each block life is classed by when it lives: 'persistent' (exists before the step
     or outlives it), 'forward-to-backward' (allocated in forward, freed in backward or
     the optimizer step), else 'temporary'. Plan-aware heuristics use the class.
  5. An op's scratch, where the simulation priced one (a profile taken on CUDA measured it: cuDNN's
     workspaces, NOTE [simulated streams] 8), is a block of its own, ``scratch@<op>``, allocated after
     the op's outputs and freed before what is released after it.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

from udnn_lab.graph.plan_ir import Plan
from udnn_lab.graph.step_graph import Graph

LIFETIMES = ("persistent", "forward-to-backward", "temporary")


@dataclass(frozen=True)
class AllocEvent:
    """One allocation or free."""

    action: str  # 'alloc' or 'free'
    block: str  # names one allocation; a free names a block allocated before and not yet freed
    nbytes: int  # bytes requested by the alloc (a free repeats its alloc's)
    op: int = -1  # the op it belongs to (allocated for it, released after it, or issued before it); -1: before
    lifetime: str = "temporary"  # one of LIFETIMES (NOTE [event order of a step], 4)

    def __post_init__(self) -> None:
        if self.action not in ("alloc", "free"):
            raise ValueError(f"an event's action is 'alloc' or 'free', got {self.action!r}")
        if self.lifetime not in LIFETIMES:
            raise ValueError(f"an event's lifetime is one of {LIFETIMES}, got {self.lifetime!r}")


def events_from_graph(graph: Graph, *, baseline: bool = True, steps: int = 1) -> tuple[AllocEvent, ...]:
    """The eager step's allocations and frees on the graph's device (NOTE [event order of a step]).

    ``baseline=False`` leaves out the tensors that exist before the step (and their frees),
    for an allocator that already holds them. ``steps > 1`` repeats the step as a training
    loop would: before each further step the next batch's inputs are allocated, the old
    inputs freed, then what the step left behind (gradients, the loss) is freed.
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    if steps > 1 and not baseline:
        raise ValueError("repeated steps renew the inputs, which baseline=False leaves out: pass baseline=True")
    events: list[AllocEvent] = []
    if baseline:
        events += [_alloc(graph, t.id, -1, t.name) for t in _before_step(graph)]
        events += [_free(graph, t.id, -1, t.name) for t in _before_step(graph) if t.free_step == -1]
    for step in range(steps):
        suffix = f"#{step + 1}" if step else ""
        if step:
            events += _between_steps(graph, suffix, previous=f"#{step}" if step > 1 else "")
        for op in graph.ops:
            events += [_alloc(graph, t, op.index, graph.tensors[t].name + suffix) for t in op.allocated
                       if _counted(graph, t)]
            events += [_free(graph, t, op.index, _block_name(graph, t, suffix)) for t in op.released
                       if _counted(graph, t) and (baseline or graph.tensors[t].alloc_step >= 0)]
    return classify_lifetimes(graph, events)


def _before_step(graph: Graph):
    return [t for t in graph.tensors if t.alloc_step < 0 and _counted(graph, t.id)]


def _between_steps(graph: Graph, suffix: str, previous: str) -> list[AllocEvent]:
    inputs = [t for t in _before_step(graph) if t.category == "input"]
    renewed = [_alloc(graph, t.id, -1, t.name + suffix) for t in inputs]
    renewed += [_free(graph, t.id, -1, _block_name(graph, t.id, previous)) for t in inputs if t.free_step is None]
    left = [t for t in graph.tensors if t.alloc_step >= 0 and t.free_step is None and _counted(graph, t.id)]
    return renewed + [_free(graph, t.id, -1, t.name + previous) for t in left]


def _block_name(graph: Graph, tensor_id: int, suffix: str) -> str:
    """Inputs are renewed every step; other baseline tensors keep their first name."""
    t = graph.tensors[tensor_id]
    if t.alloc_step < 0 and t.category != "input":
        return t.name
    return t.name + suffix


def events_from_simulation(graph: Graph, plan: Plan, simulation) -> tuple[AllocEvent, ...]:
    """The step under ``plan``, in the order ``simulation`` (of this graph and plan) runs it.

    See NOTE [event order of a step], 3. Only tensors on the graph's device take part.
    """
    plan.check_belongs(graph)
    if simulation.policy != plan.policy or simulation.model_name != graph.model_name:
        raise ValueError(f"the simulation is of {simulation.model_name!r} under {simulation.policy!r}, the plan "
                         f"{plan.policy!r} for {graph.model_name!r}: pass ul.simulate(graph, plan, ...)")
    return classify_lifetimes(graph, _PlannedStep(graph, plan, simulation).events())


class _PlannedStep:
    """Walks the compute stream op by op and slots the copy stream's frees in by time."""

    def __init__(self, graph: Graph, plan: Plan, simulation) -> None:
        self.graph, self.plan = graph, plan
        timeline = simulation.timeline
        compute = timeline[timeline.stream == "compute"]
        ops = compute[compute.kind == "op"].set_index("op")
        self.op_start, self.op_end = ops["start_s"].to_dict(), ops["end_s"].to_dict()
        issued = compute[compute.kind.isin(["recompute", "stall_prefetch", "op"])]
        self.issue = issued.groupby("op")["start_s"].min().to_dict()
        copies = timeline[timeline.kind == "offload"]
        self.copy_end = {graph.tensor(name).id: end for name, end in zip(copies.tensor, copies.end_s)}
        cancelled = timeline[timeline.kind == "prefetch_cancelled"].tensor
        self.cancelled = {graph.tensor(name).id for name in cancelled}
        self.current = {t.id: t.name for t in graph.tensors}  # block name of each tensor's current life
        self.pending: list[tuple[float, int, int]] = []  # (copy end, order, tensor) of offloads in flight
        scratch = simulation.scratch_by_op
        self.scratch = [int(b) for b in scratch] if scratch is not None else [0] * len(graph.ops)  # 5
        self.out: list[AllocEvent] = []

    def events(self) -> list[AllocEvent]:
        graph, events = self.graph, self.out
        events += [_alloc(graph, t.id, -1, t.name) for t in _before_step(graph)]
        events += [_free(graph, t.id, -1, t.name) for t in _before_step(graph) if t.free_step == -1]
        offloads_after, prefetches_at, recomputes_at, drops_after = self._actions()
        for op in graph.ops:
            i = op.index
            self._flush(self.issue.get(i, self.op_start[i]), i)
            for tensor in prefetches_at.get(i, []):
                self._new_life(tensor, i, "prefetch")
            for tensor in recomputes_at.get(i, []):
                self._new_life(tensor, i, "recompute")
            self._flush(self.op_start[i], i)
            events += [_alloc(graph, t, i, self.current[t]) for t in op.allocated if _counted(graph, t)]
            if self.scratch[i]:  # NOTE [event order of a step] 5
                events += [AllocEvent("alloc", f"scratch@{i}", self.scratch[i], i),
                           AllocEvent("free", f"scratch@{i}", self.scratch[i], i)]
            events += [_free(graph, t, i, self.current[t]) for t in op.released if _counted(graph, t)]
            events += [_free(graph, t, i, self.current[t]) for t in drops_after.get(i, [])]
            for tensor in offloads_after.get(i, []):
                heapq.heappush(self.pending, (self.copy_end[tensor], len(self.pending), tensor))
        self._flush(math.inf, len(graph.ops) - 1)
        return events

    def _actions(self):
        graph, counted = self.graph, (lambda t: _counted(self.graph, t))
        offloads_after, prefetches_at, recomputes_at, drops_after = {}, {}, {}, {}
        for offload in self.plan.offloads:
            if counted(offload.tensor) and offload.tensor not in self.cancelled:
                offloads_after.setdefault(offload.after_op, []).append(offload.tensor)
                prefetches_at.setdefault(offload.prefetch_at, []).append(offload.tensor)
        for recompute in self.plan.recomputes:
            for tensor in filter(counted, recompute.tensors):
                recomputes_at.setdefault(recompute.at_op, []).append(tensor)
                drops_after.setdefault(graph.tensors[tensor].last_forward_use, []).append(tensor)
        return offloads_after, prefetches_at, recomputes_at, drops_after

    def _new_life(self, tensor: int, op: int, how: str) -> None:
        self.current[tensor] = f"{self.graph.tensors[tensor].name}~{how}"
        self.out.append(_alloc(self.graph, tensor, op, self.current[tensor]))

    def _flush(self, until: float, op: int) -> None:
        """Free the offloaded tensors whose copies ended by ``until``."""
        while self.pending and self.pending[0][0] <= until:
            tensor = heapq.heappop(self.pending)[2]
            self.out.append(_free(self.graph, tensor, op, self.current[tensor]))


def events_from_memory_trace(trace: Iterable[dict]) -> tuple[AllocEvent, ...]:
    """Events of a real allocator trace: one device's list of ``torch.cuda.memory._snapshot()['device_traces']``.

    'alloc' and 'free_completed' entries become events named by address (``0x...``), as
    :func:`udnn_lab.allocator.heuristics.model_from_snapshot` names the blocks it seeds; other
    entries (segment_alloc, free_requested, oom, ...) are the allocator's own doing.
    """
    events = []
    for entry in trace:
        action = entry["action"]
        if action == "alloc":
            events.append(AllocEvent("alloc", address_name(entry["addr"]), int(entry["size"])))
        elif action == "free_completed":
            events.append(AllocEvent("free", address_name(entry["addr"]), int(entry["size"])))
    return tuple(events)


def address_name(address: int) -> str:
    return f"0x{address:x}"


def classify_lifetimes(graph: Graph, events: list[AllocEvent]) -> tuple[AllocEvent, ...]:
    """Set each block life's class (NOTE [event order of a step], 4) on its alloc and free."""
    boundary = next((op.index for op in graph.ops if op.phase != "forward"), len(graph.ops))
    born: dict[str, int] = {}
    died: dict[str, int] = {}
    for position, event in enumerate(events):
        (born if event.action == "alloc" else died)[event.block] = position
    lifetime = {}
    for block, position in born.items():
        alloc = events[position]
        end = died.get(block)
        if alloc.op < 0 or end is None or events[end].op < alloc.op:  # the last: freed in a later step
            lifetime[block] = "persistent"
        elif alloc.op < boundary <= events[end].op:
            lifetime[block] = "forward-to-backward"
        else:
            lifetime[block] = "temporary"
    return tuple(replace(e, lifetime=lifetime.get(e.block, "persistent")) for e in events)


def _counted(graph: Graph, tensor_id: int) -> bool:
    tensor = graph.tensors[tensor_id]
    return graph.on_device(tensor) and tensor.nbytes > 0


def _alloc(graph: Graph, tensor_id: int, op: int, name: str) -> AllocEvent:
    return AllocEvent("alloc", name, graph.tensors[tensor_id].nbytes, op)


def _free(graph: Graph, tensor_id: int, op: int, name: str) -> AllocEvent:
    return AllocEvent("free", name, graph.tensors[tensor_id].nbytes, op)
